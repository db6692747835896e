"""The planner's step inputs, and the shared levels' layout its prefix trie gives (numpy only).

:func:`read_step` validates one step's arguments of
:func:`~.planner.plan_cascade`; :func:`layout` turns each row's node of the
:class:`~.trie.PrefixTrie` into the :class:`Structure`: the rows' depth-first
order and every shared level's groups, rows and pages. The layout is a function of the trie, the
rows' nodes and which rows are active, so the same inputs give the same arrays however the trie
and the nodes were found.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from .trie import PrefixTrie

# Rows few enough to handle one by one in Python rather than by gathering them all.
FEW_ROWS = 4


# The planner's own records are plain (slotted) dataclasses, not frozen ones: they are made
# every step, and a frozen dataclass's __init__ costs several times more. Nothing mutates them.


@dataclass(slots=True, eq=False)
class Step:
    """One step's validated inputs and the per-row numbers every stage needs (int64 ``[R]``).

    Row ``r``'s block ids are ``block_table[r]``, or with ``row_index``
    ``block_table[row_index[r]]``: a table of more rows than the step's (Model Runner V2's
    request slots), read where needed instead of copied whole every step.
    """

    block_table: np.ndarray  # int32 [R, max_pages], or [slots, max_pages] with row_index
    seq_lens: np.ndarray
    query_lens: np.ndarray
    page_size: int
    active: np.ndarray  # bool [R]: not a padding row
    all_active: bool  # no padding row: rows is arange(R)
    rows: np.ndarray  # the active rows in batch order
    num_pages: np.ndarray  # 0 for padding rows
    shareable_bound: np.ndarray  # whole pages before the row's first query token; 0 for padding
    query_start: np.ndarray
    num_tokens: int
    row_index: np.ndarray | None = None  # int64 [R]: each row's row of block_table
    _dense: np.ndarray | None = None

    def table_rows(self, rows: np.ndarray) -> np.ndarray:
        """The rows of ``block_table`` that hold the ids of the step's ``rows``."""
        return rows if self.row_index is None else self.row_index[rows]

    def dense(self) -> np.ndarray:
        """int32 ``[R, P]``: the step's rows' ids; with ``row_index`` gathered (once), as many
        columns as the longest row has pages."""
        if self.row_index is None:
            return self.block_table
        if self._dense is None:
            width = int(np.maximum.reduce(self.num_pages)) if self.num_pages.size else 0
            self._dense = self.block_table[self.row_index, :width]
        return self._dense


@dataclass(slots=True, eq=False)
class SharedLevel:
    """A shared level without its queries, which the planner adds for each step."""

    rows: np.ndarray  # int32, every group's rows, groups contiguous, in plan order
    row_indptr: np.ndarray  # int32 [G + 1]
    kv_page_indptr: np.ndarray  # int32 [G + 1]
    kv_page_indices: np.ndarray  # int32
    spans_batch: bool  # rows are all active rows in batch order: q_index is the identity
    spans_order: bool  # rows are all active rows (in the structure's order)
    group_sizes: tuple[int, ...]  # rows per group
    group_pages: tuple[int, ...]  # pages per group


@dataclass(slots=True, eq=False)
class Structure:
    """Everything the block ids decide, valid while the rows' shareable block ids hold."""

    trie: PrefixTrie
    shareable: np.ndarray  # int64 [R]: leading pages a row may share (before its queries, no 0)
    node: np.ndarray  # int64 [R]: the row's node in the trie (0: the root, or none)
    continuation: np.ndarray  # int64 [R]: the row's block id after its node, 0 for none
    own_start: np.ndarray  # int64 [R]: the row's first page on the per-request level
    order: np.ndarray  # int64: active rows in depth-first order of the kept groups
    order_is_batch: bool
    levels: tuple[SharedLevel, ...]


def shareable_bound(seq: np.ndarray, qry: np.ndarray, active: np.ndarray,
                    page_size: int) -> np.ndarray:
    """Whole pages before each row's first query token: the most it may share (0 for padding)."""
    return np.where(active, (seq - qry) // page_size, 0)


def read_step(
    block_table: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray, page_size: int,
    row_index: np.ndarray | None = None,
) -> Step:
    """Validate one step's inputs (see :func:`~.planner.plan_cascade`)."""
    table = np.asarray(block_table)
    if table.dtype != np.int32:
        table = table.astype(np.int32)
    seq = np.asarray(seq_lens, dtype=np.int64)
    qry = np.asarray(query_lens, dtype=np.int64)
    index = None
    if row_index is not None:
        index = np.asarray(row_index, dtype=np.int64)
        if table.ndim != 2 or index.shape != seq.shape or (index.size and not (
                0 <= int(np.minimum.reduce(index))
                and int(np.maximum.reduce(index)) < table.shape[0])):
            raise ValueError(f"need row_index [R] = {seq.shape} of rows of the block table's "
                             f"{table.shape[0] if table.ndim == 2 else 0}, got {index.shape}")
    rows_given = table.shape[0] if index is None or table.ndim != 2 else len(index)
    if table.ndim != 2 or seq.shape != (rows_given,) or qry.shape != seq.shape:
        raise ValueError(
            f"need block_table [R, P], seq_lens [R], query_lens [R]; got {table.shape}, "
            f"{seq.shape}, {qry.shape}"
        )
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    fewest = int(np.minimum.reduce(qry)) if qry.size else 1
    if fewest < 0 or np.count_nonzero(seq < qry):
        raise ValueError("need 0 <= query_lens <= seq_lens in every row")
    # Every row active is the common case: it spares the masking and gathering by rows.
    active = qry > 0
    num_pages = seq + (page_size - 1)
    num_pages //= page_size
    bound = seq - qry
    bound //= page_size
    if fewest == 0:
        num_pages[~active] = 0
        bound[~active] = 0
    if qry.size and int(np.maximum.reduce(num_pages)) > table.shape[1]:
        raise ValueError(f"a row needs more than the block table's {table.shape[1]} pages")
    query_start = np.add.accumulate(qry)
    num_tokens = int(query_start[-1]) if qry.size else 0
    query_start -= qry
    return Step(
        block_table=table,
        seq_lens=seq,
        query_lens=qry,
        page_size=page_size,
        active=active,
        all_active=fewest > 0,
        rows=np.arange(len(qry)) if fewest > 0 else active.nonzero()[0],
        num_pages=num_pages,
        shareable_bound=bound,
        query_start=query_start,
        num_tokens=num_tokens,
        row_index=index,
    )


def shareable_pages(step: Step) -> np.ndarray:
    """Per row, its leading pages that lie before its queries and precede its first block 0."""
    bound = step.shareable_bound
    width = int(bound.max(initial=0))
    if width == 0:
        return bound.copy()
    zero = step.dense()[:, :width] == 0  # a plan from scratch reads the rows gathered once
    first_zero = np.where(zero.any(axis=1), zero.argmax(axis=1), width)
    return np.minimum(bound, first_zero)


def first_zero(
    table: np.ndarray, rows: np.ndarray, start: np.ndarray, stop: np.ndarray
) -> np.ndarray:
    """Per ``rows[i]``, the first column in ``[start[i], stop[i])`` holding block 0, else ``stop``.

    Needs ``start < stop``. Keeping the shareable length exact here spares a rebuild per page
    for rows cut short by a null block (sliding window). In steady decode a row grows by one
    page, so the first column is looked at on its own; only longer ranges are read further,
    row by row when they are few (a new request), else gathered.
    """
    if table.flags.c_contiguous:  # one flat gather is several times faster than a 2-D one
        firsts = table.reshape(-1).take(rows * table.shape[1] + start)
    else:
        firsts = table[rows, start]
    result = np.where(firsts == 0, start, stop)
    scan = ((result == stop) & (stop - start > 1)).nonzero()[0]
    if scan.size == 0:
        return result
    if scan.size <= FEW_ROWS:
        for i in scan.tolist():
            row, after, end = int(rows[i]), int(start[i]) + 1, int(stop[i])
            zeros = (table[row, after:end] == 0).nonzero()[0]
            if zeros.size:
                result[i] = after + zeros[0]
        return result
    begin = start[scan] + 1
    counts = stop[scan] - begin
    offsets = np.cumsum(counts) - counts
    cols = np.repeat(begin - offsets, counts) + np.arange(int(counts.sum()))
    zeros = np.flatnonzero(table[np.repeat(rows[scan], counts), cols] == 0)
    if zeros.size:
        segment = np.searchsorted(offsets, zeros, side="right") - 1
        segment, first = np.unique(segment, return_index=True)
        result[scan[segment]] = cols[zeros[first]]
    return result


def indptr(counts: np.ndarray) -> np.ndarray:
    """int32 ``[len(counts) + 1]``: where each count's run starts, and the end."""
    result = np.empty(len(counts) + 1, np.int32)
    result[0] = 0
    result[1:] = np.add.accumulate(counts)  # np.cumsum, without its Python wrapper
    return result


def layout(
    trie: PrefixTrie, node: np.ndarray, continuation: np.ndarray, shareable: np.ndarray,
    step: Step,
) -> Structure:
    """The structure of a step whose rows sit at ``node`` of ``trie``.

    Parameters
    ----------
    trie : the prefix trie of the step's shareable ids.
    node, continuation, shareable : int64 ``[R]`` each row's node, continuation and shareable
        pages (kept in the structure for the next step).
    step : the step.

    The active rows go in depth-first order of the kept groups, a group where its earliest batch
    row is (so the order is the batch order whenever the groups are already contiguous there):
    row ``r`` in groups ``g_1 .. g_k`` on levels ``1 .. k`` sorts by ``(e(g_1), .., e(g_k), r,
    .., r)`` over all levels, ``e`` the earliest row of a group.
    """
    rows = step.rows
    own_start = trie.kept_depth[node]
    if trie.num_levels == 0:
        return Structure(trie, shareable, node, continuation, own_start, rows, True, ())
    nodes = node if step.all_active else node[rows]
    num_rows = len(node)
    per_row = trie.groups[:, nodes]  # [levels, active rows]: each row's group per level
    # Each group's earliest row; a row's -1 (no group) lands on the extra last entry, which
    # then becomes the 0 that `first[-1]` gives rows without a group.
    first = np.empty(len(trie.group_pages) + 1, np.int64)
    first.fill(num_rows)
    if trie.num_levels == 1:
        np.minimum.at(first, per_row[0], rows)
    else:
        np.minimum.at(first, per_row.ravel(), np.tile(rows, trie.num_levels))
    first[-1] = 0
    weights = trie.sort_weights(num_rows)
    if weights is not None:  # the keys fit one int64: base num_rows, one digit per level
        powers, weight = weights
        key = first[per_row[0]] * powers[0]
        for level in range(1, trie.num_levels):
            key += first[per_row[level]] * powers[level]
        key += rows * weight[nodes]
        positions = key.argsort()
    else:
        keys = np.where(per_row >= 0, first[per_row], rows)
        positions = np.lexsort((rows, *keys[::-1]))
    order = positions if step.all_active else rows[positions]
    order_is_batch = not np.count_nonzero(order != rows)
    levels = []
    for groups in per_row[:, positions]:
        kept = groups >= 0
        everyone = bool(np.count_nonzero(kept) == len(kept))
        in_level, ordered = (order, groups) if everyone else (order[kept], groups[kept])
        starts = (ordered[1:] != ordered[:-1]).nonzero()[0]
        starts += 1
        bounds = [0, *starts.tolist(), len(in_level)]
        kv_page_indptr, kv_page_indices, group_pages = trie.level_pages(
            ordered[bounds[:-1]].tolist())
        levels.append(
            SharedLevel(
                rows=in_level.astype(np.int32),
                row_indptr=np.array(bounds, np.int32),
                kv_page_indptr=kv_page_indptr,
                kv_page_indices=kv_page_indices,
                spans_batch=order_is_batch and everyone,
                spans_order=everyone,
                group_sizes=tuple(b - a for a, b in pairwise(bounds)),
                group_pages=group_pages,
            )
        )
    return Structure(trie, shareable, node, continuation, own_start, order, order_is_batch,
                     tuple(levels))
