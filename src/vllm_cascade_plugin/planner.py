"""The cascade planner: one engine step's block tables in, a :class:`CascadePlan` out.

Pure numpy: no torch, vLLM or flashinfer import here (a test enforces it).

INTERFACE CONTRACT
------------------------------------------------------------------------
Input, per request row ``r`` of the step (vLLM batch order):

- ``block_table``: int32 ``[R, max_pages]``; row ``r`` holds the physical KV block ids of request
  ``r`` in order. Only the first ``ceil(seq_lens[r] / page_size)`` entries are meaningful.
- ``seq_lens``: int32 ``[R]``, tokens in the KV cache after this step's tokens are written.
- ``query_lens``: int32 ``[R]``, tokens scheduled this step (decode = 1, prefill chunk > 1).
  Rows with ``query_lens[r] == 0`` are padding and take part in no level.

Output: a :class:`CascadePlan` whose levels, executed and merged with base-2 log-sum-exp, compute
exactly per-request causal attention over ``seq_lens[r]`` tokens for the last ``query_lens[r]``
query tokens of every row.

How sharing is found: row ``r`` may share its first ``(seq_lens[r] - query_lens[r]) // page_size``
pages (shared levels are non-causal, so only pages wholly before its queries), cut at its first
block 0 (vLLM's null block). Over these id sequences the planner builds the compressed trie; a
node that at least two rows pass through and that owns ``>= min_shared_pages`` pages becomes a
group on the level of its depth among kept nodes, up to ``max_levels - 1`` shared levels. A
dropped node's pages fall to its children, and finally to the rows' own causal level, so every
page of every row is read exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, eq=False)
class CascadeLevel:
    """One cascade level: independent groups, each a contiguous run of queries over paged KV.

    All arrays are int32 numpy arrays in FlashInfer's paged format.

    q_index : ``[n_q]`` positions, in the step's query-token order (vLLM's order), of the queries
        that take part in this level, arranged so every group's queries are contiguous.
    q_is_identity : ``q_index`` equals ``arange(num_tokens)``: executors skip gather/scatter.
    qo_indptr : ``[G + 1]`` group ``g`` owns ``q_index[qo_indptr[g]:qo_indptr[g + 1]]``.
    kv_page_indptr : ``[G + 1]`` group ``g`` reads
        ``kv_page_indices[kv_page_indptr[g]:kv_page_indptr[g + 1]]``.
    kv_page_indices : ``[nnz_pages]`` physical block ids; never block 0 on a shared level.
    kv_last_page_len : ``[G]`` valid tokens in the group's last page, in ``1..page_size``.
    row_indptr, rows : the request rows of each group (``rows[row_indptr[g]:row_indptr[g + 1]]``).
    causal : only the last (per-request) level is causal; shared levels are not.
    """

    q_index: np.ndarray
    q_is_identity: bool
    qo_indptr: np.ndarray
    kv_page_indptr: np.ndarray
    kv_page_indices: np.ndarray
    kv_last_page_len: np.ndarray
    row_indptr: np.ndarray
    rows: np.ndarray
    causal: bool

    @property
    def num_groups(self) -> int:
        return len(self.qo_indptr) - 1

    def kv_lens(self, page_size: int) -> np.ndarray:
        """int32 ``[G]``: KV tokens each group reads (its pages, the last one partly)."""
        pages = np.diff(self.kv_page_indptr).astype(np.int64)
        return ((pages - 1) * page_size + self.kv_last_page_len).astype(np.int32)

    def block_table(self) -> np.ndarray:
        """int32 ``[G, max_pages]``: group ``g``'s page ids in row ``g``, 0-padded.

        The same pages in the block-table form FlashAttention reads (``seqused_k`` =
        :meth:`kv_lens` bounds each row, so the padding is never read).
        """
        pages = np.diff(self.kv_page_indptr)
        table = np.zeros((self.num_groups, max(int(pages.max(initial=0)), 1)), np.int32)
        rows = np.repeat(np.arange(self.num_groups), pages)
        cols = np.arange(rows.size) - np.repeat(self.kv_page_indptr[:-1], pages)
        table[rows, cols] = self.kv_page_indices[self.kv_page_indptr[0]:self.kv_page_indptr[-1]]
        return table


@dataclass(frozen=True)
class PlanStats:
    """Numbers the cost model needs; pages are KV pages of ``page_size`` tokens."""

    pages_flat: int  # pages a flat (non-cascade) kernel reads: sum of every row's pages
    pages_cascade: int  # pages the cascade reads: every level's kv_page_indices together
    shared_levels: int  # levels before the per-request level
    group_sizes: tuple[int, ...]  # rows per shared group, all shared levels
    shared_pages: tuple[int, ...]  # pages per shared group, same order as group_sizes
    num_tokens: int
    num_requests: int
    max_page: int = -1  # largest block id any level reads (-1: none); checked against the cache


@dataclass(frozen=True, eq=False)
class CascadePlan:
    """A whole step: shared (non-causal) levels first, the per-request causal level last.

    ``permutation`` (int32 ``[num_tokens]``) orders the queries so that every group of every level
    is a contiguous range (depth-first over the prefix forest); identity when they already are.
    A plan with a single level has found no sharing worth a level.
    """

    levels: tuple[CascadeLevel, ...]
    permutation: np.ndarray
    page_size: int
    stats: PlanStats

    @property
    def num_levels(self) -> int:
        return len(self.levels)


__all__ = ["CascadeLevel", "CascadePlan", "CascadePlanner", "PlanStats", "nothing_shared",
           "plan_cascade", "plan_violations"]

# Pages a snapshot of the block table keeps beyond the longest shareable prefix, so that rows
# growing by a page in steady decode do not force a re-copy of the snapshot every step.
_SNAPSHOT_SLACK_PAGES = 16


def plan_cascade(
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    page_size: int,
    *,
    max_levels: int = 3,
    min_shared_pages: int = 1,
) -> CascadePlan:
    """Plan one step from scratch (see the module docstring for the inputs and the contract).

    Parameters
    ----------
    block_table : int ``[R, max_pages]`` physical block ids per request row.
    seq_lens : int ``[R]`` tokens in the KV cache including this step's.
    query_lens : int ``[R]`` tokens of this step; ``0`` marks a padding row.
    page_size : tokens per KV page (= vLLM block size).
    max_levels : levels in all, the per-request level included (``>= 2``).
    min_shared_pages : fewest pages a group must own to become a group (``>= 1``).

    Returns
    -------
    CascadePlan
        With no levels at all when every row is padding.
    """
    _check_limits(max_levels, min_shared_pages)
    step = _read_step(block_table, seq_lens, query_lens, page_size)
    structure = _build(step, _shareable_pages(step), max_levels, min_shared_pages)
    return _assemble(_emit_shared(structure, step), structure, step)


def nothing_shared(first_pages: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                   page_size: int) -> bool:
    """True when no two rows can share a page, judged from each row's first block id alone.

    Every shared prefix starts at a row's first page, and only rows with a whole page before
    their first query token (not block 0) can share one; if those rows' first block ids are all
    different, :func:`plan_cascade` finds no shared level. ``O(R log R)``, without reading the
    rest of the block table: a step without sharing skips the planner. ``False`` proves nothing.
    """
    qry = np.asarray(query_lens, dtype=np.int64)
    bound = _shareable_bound(np.asarray(seq_lens, dtype=np.int64), qry, qry > 0, page_size)
    first_pages = np.asarray(first_pages)
    firsts = first_pages[(bound >= 1) & (first_pages != 0)]
    return firsts.size < 2 or np.unique(firsts).size == firsts.size


class CascadePlanner:
    """:func:`plan_cascade` with a memory: reuses the prefix structure across engine steps.

    In steady decode the groups stay the same while every row grows by a token and now and then
    by a page. Before reusing what it found, the planner checks that every row's shareable block
    ids are still the ones it planned with (vLLM frees and reuses block ids) and that no row
    grew into pages it might share; otherwise it plans from scratch. ``plan`` therefore returns
    exactly what :func:`plan_cascade` returns for the same arguments.

    While the structure and the query lengths stay the same, consecutive plans hold the very same
    shared :class:`CascadeLevel` objects (and permutation array): executors may skip re-planning
    a level that ``is`` the previous step's, and must treat every plan array as read-only.
    """

    def __init__(self, *, max_levels: int = 3, min_shared_pages: int = 1) -> None:
        _check_limits(max_levels, min_shared_pages)
        self.max_levels = max_levels
        self.min_shared_pages = min_shared_pages
        self._memory: _Memory | None = None

    def plan(
        self,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        query_lens: np.ndarray,
        page_size: int,
    ) -> CascadePlan:
        """Plan one step; arguments as in :func:`plan_cascade`."""
        step = _read_step(block_table, seq_lens, query_lens, page_size)
        memory = self._memory
        structure = self._reuse(step)
        if structure is None or memory is None:
            structure = _build(step, _shareable_pages(step), self.max_levels, self.min_shared_pages)
            width = min(
                step.block_table.shape[1],
                int(structure.shareable.max(initial=0)) + _SNAPSHOT_SLACK_PAGES,
            )
            memory = self._memory = _Memory(
                page_size=step.page_size,
                active=step.active,
                snapshot=step.block_table[:, :width].copy(),
                structure=structure,
                query_lens=step.query_lens.copy(),  # callers update theirs in place
                shared=_emit_shared(structure, step),
            )
        elif not np.array_equal(memory.query_lens, step.query_lens):
            memory.query_lens = step.query_lens.copy()
            memory.shared = _emit_shared(structure, step)
        return _assemble(memory.shared, structure, step)

    def _reuse(self, step: _Step) -> _Structure | None:
        """The remembered structure, updated for this step, or ``None`` when it may be stale."""
        memory = self._memory
        if (
            memory is None
            or memory.page_size != step.page_size
            or step.block_table.shape[1] < memory.snapshot.shape[1]
            or not np.array_equal(memory.active, step.active)
        ):
            return None
        old = memory.structure
        bound = step.shareable_bound
        if (bound < old.shareable).any():  # a row lost shareable pages (preempted, recomputed)
            return None
        if not _refresh_snapshot(step.block_table, memory.snapshot, old.shareable):
            return None
        growing = np.flatnonzero(bound > old.shareable)
        if growing.size == 0:
            return old
        shareable = old.shareable.copy()
        shareable[growing] = _first_zero(
            step.block_table, growing, old.shareable[growing], bound[growing]
        )
        # A row can share more pages than before only if, before, it shared its whole shareable
        # prefix with some row (a mismatch, once there, stays). Rows that grew past a private
        # page keep every pairwise common prefix, hence the trie and the plan.
        grown = shareable > old.shareable
        if (old.diverge[grown] >= old.shareable[grown]).any():
            return None
        width = int(shareable.max())
        if width > memory.snapshot.shape[1]:
            width = min(step.block_table.shape[1], width + _SNAPSHOT_SLACK_PAGES)
            memory.snapshot = step.block_table[:, :width].copy()
        memory.structure = replace(old, shareable=shareable)
        return memory.structure


@dataclass(frozen=True)
class _Step:
    """One step's validated inputs and the per-row numbers every stage needs (int64 ``[R]``)."""

    block_table: np.ndarray  # int32 [R, max_pages]
    seq_lens: np.ndarray
    query_lens: np.ndarray
    page_size: int
    active: np.ndarray  # bool [R]: not a padding row
    rows: np.ndarray  # the active rows in batch order
    num_pages: np.ndarray  # 0 for padding rows
    shareable_bound: np.ndarray  # whole pages before the row's first query token; 0 for padding
    query_start: np.ndarray
    num_tokens: int


@dataclass(frozen=True, eq=False)
class _SharedLevel:
    """A shared level without its queries, which :func:`_emit_shared` adds."""

    rows: np.ndarray  # int32, every group's rows, groups contiguous, in plan order
    row_indptr: np.ndarray  # int32 [G + 1]
    kv_page_indptr: np.ndarray  # int32 [G + 1]
    kv_page_indices: np.ndarray  # int32
    spans_batch: bool  # rows are all active rows in batch order: q_index is the identity


@dataclass(frozen=True, eq=False)
class _Structure:
    """Everything the block ids decide, valid while the rows' shareable block ids hold."""

    shareable: np.ndarray  # int64 [R]: leading pages a row may share (before its queries, no 0)
    diverge: np.ndarray  # int64 [R]: leading pages the row shares with its closest other row
    own_start: np.ndarray  # int64 [R]: the row's first page on the per-request level
    order: np.ndarray  # int64: active rows in depth-first order of the kept groups
    order_is_batch: bool
    levels: tuple[_SharedLevel, ...]


@dataclass(frozen=True, eq=False)
class _SharedPart:
    """The shared levels and permutation of a plan: a function of structure and query_lens."""

    levels: tuple[CascadeLevel, ...]
    permutation: np.ndarray
    group_sizes: tuple[int, ...]
    shared_pages: tuple[int, ...]


@dataclass(eq=False)
class _Memory:
    page_size: int
    active: np.ndarray
    snapshot: np.ndarray  # int32 copy of the block table's leading columns as last planned
    structure: _Structure
    query_lens: np.ndarray  # of the step `shared` was emitted for
    shared: _SharedPart


def _check_limits(max_levels: int, min_shared_pages: int) -> None:
    if max_levels < 2:
        raise ValueError(f"max_levels must be >= 2 (shared + per-request), got {max_levels}")
    if min_shared_pages < 1:
        raise ValueError(f"min_shared_pages must be >= 1, got {min_shared_pages}")


def _shareable_bound(seq: np.ndarray, qry: np.ndarray, active: np.ndarray,
                     page_size: int) -> np.ndarray:
    """Whole pages before each row's first query token: the most it may share (0 for padding)."""
    return np.where(active, (seq - qry) // page_size, 0)


def _read_step(
    block_table: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray, page_size: int
) -> _Step:
    table = np.asarray(block_table)
    if table.dtype != np.int32:
        table = table.astype(np.int32)
    seq = np.asarray(seq_lens, dtype=np.int64)
    qry = np.asarray(query_lens, dtype=np.int64)
    if table.ndim != 2 or seq.shape != (table.shape[0],) or qry.shape != seq.shape:
        raise ValueError(
            f"need block_table [R, P], seq_lens [R], query_lens [R]; got {table.shape}, "
            f"{seq.shape}, {qry.shape}"
        )
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if qry.size and (qry.min() < 0 or (seq < qry).any()):
        raise ValueError("need 0 <= query_lens <= seq_lens in every row")
    active = qry > 0
    num_pages = np.where(active, -(-seq // page_size), 0)
    if num_pages.size and num_pages.max() > table.shape[1]:
        raise ValueError(f"a row needs more than the block table's {table.shape[1]} pages")
    query_start = np.cumsum(qry)
    query_start -= qry
    return _Step(
        block_table=table,
        seq_lens=seq,
        query_lens=qry,
        page_size=page_size,
        active=active,
        rows=np.flatnonzero(active),
        num_pages=num_pages,
        shareable_bound=_shareable_bound(seq, qry, active, page_size),
        query_start=query_start,
        num_tokens=int(qry.sum()),
    )


def _shareable_pages(step: _Step) -> np.ndarray:
    """Per row, its leading pages that lie before its queries and precede its first block 0."""
    bound = step.shareable_bound
    width = int(bound.max(initial=0))
    if width == 0:
        return bound.copy()
    zero = step.block_table[:, :width] == 0
    first_zero = np.where(zero.any(axis=1), zero.argmax(axis=1), width)
    return np.minimum(bound, first_zero)


def _first_zero(
    table: np.ndarray, rows: np.ndarray, start: np.ndarray, stop: np.ndarray
) -> np.ndarray:
    """Per ``rows[i]``, the first column in ``[start[i], stop[i])`` holding block 0, else ``stop``.

    Keeping the shareable length exact here spares a rebuild per page for rows cut short by a
    null block (sliding window). In steady decode a row grows by one page, so the first column
    is looked at on its own; only longer ranges, rarer, are gathered.
    """
    result = np.where(table[rows, start] == 0, start, stop)
    scan = np.flatnonzero((result == stop) & (stop - start > 1))
    if scan.size == 0:
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


def _refresh_snapshot(table: np.ndarray, snapshot: np.ndarray, lens: np.ndarray) -> bool:
    """Whether ``table[r, :lens[r]] == snapshot[r, :lens[r]]`` for every row ``r``.

    When so, rows that changed only beyond ``lens[r]`` (new pages, stale ids) are copied into the
    snapshot so that it mirrors ``table`` again.
    """
    width = snapshot.shape[1]
    differs = table[:, :width] != snapshot
    changed = np.flatnonzero(differs.any(axis=1))
    if changed.size == 0:
        return True
    if (differs[changed].argmax(axis=1) < lens[changed]).any():
        return False
    snapshot[changed] = table[changed, :width]
    return True


def _sorted_prefixes(
    table: np.ndarray, rows: np.ndarray, shareable: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort ``rows`` by their shareable block ids and measure neighbours' common prefixes.

    Returns the sorted rows, their block-table rows (same order, leading columns) and ``lcp``
    where ``lcp[i]`` is the number of leading pages sorted rows ``i`` and ``i + 1`` share.
    """
    lens = shareable[rows]
    width = int(lens.max())
    # Big-endian bytes compare like the id sequences themselves, and a prefix sorts first.
    big_endian = table[:, :width].astype(">u4")
    keys = [big_endian[r, :n].tobytes() for r, n in zip(rows.tolist(), lens.tolist(), strict=True)]
    order = np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
    rows, lens = rows[order], lens[order]
    ids = table[rows, :width]
    differs = ids[1:] != ids[:-1]
    first_difference = np.where(differs.any(axis=1), differs.argmax(axis=1), width)
    lcp = np.minimum(first_difference, np.minimum(lens[1:], lens[:-1]))
    return rows, ids, lcp


def _trie_nodes(lcp: list[int]) -> list[tuple[int, int, int, int]]:
    """The shared nodes of the compressed trie over sorted rows, from neighbours' prefixes.

    Returns ``(depth, first, last, parent)`` per node, parents before children: sorted rows
    ``first..last`` (at least two) share their first ``depth`` pages, and ``parent`` indexes the
    returned list (``-1`` for the root). This is the classic LCP-interval stack walk.
    """
    depth, first, last, parent = [0], [0], [len(lcp)], [-1]
    stack = [0]
    for i, common in enumerate([*lcp, 0], start=1):
        left, child = i - 1, -1
        while common < depth[stack[-1]]:
            node = stack.pop()
            last[node], left, child = i - 1, first[node], node
            if common <= depth[stack[-1]]:
                parent[node], child = stack[-1], -1
        if common > depth[stack[-1]]:
            depth.append(common)
            first.append(left)
            last.append(-1)
            parent.append(-1)
            if child >= 0:
                parent[child] = len(depth) - 1
            stack.append(len(depth) - 1)
    preorder = sorted(range(1, len(depth)), key=lambda v: (first[v], depth[v]))
    position = {v: i for i, v in enumerate(preorder)}
    position[0] = -1
    return [(depth[v], first[v], last[v], position[parent[v]]) for v in preorder]


def _build(
    step: _Step, shareable: np.ndarray, max_levels: int, min_shared_pages: int
) -> _Structure:
    """Find the groups: kept trie nodes become groups on the level of their kept depth."""
    num_rows = len(shareable)
    diverge = np.zeros(num_rows, np.int64)
    own_start = np.zeros(num_rows, np.int64)
    rows = np.flatnonzero(shareable > 0)
    ids = np.empty((0, 0), np.int32)
    # Per kept node: (level, first sorted row, last sorted row, first page, end page).
    kept: list[tuple[int, int, int, int, int]] = []
    if rows.size >= 2:
        rows, ids, lcp = _sorted_prefixes(step.block_table, rows, shareable)
        padded = np.concatenate(([0], lcp, [0]))
        diverge[rows] = np.maximum(padded[:-1], padded[1:])
        # Per node: pages of its nearest kept ancestor-or-self, and how many of those are kept.
        kept_depth: list[int] = []
        kept_levels: list[int] = []
        for depth, first, last, parent in _trie_nodes(lcp.tolist()):
            above_depth = kept_depth[parent] if parent >= 0 else 0
            level = (kept_levels[parent] if parent >= 0 else 0) + 1
            # A dropped node's pages fall to its children (or the rows' own level): each row
            # still covers every page exactly once.
            if depth - above_depth >= min_shared_pages and level < max_levels:
                kept.append((level, first, last, above_depth, depth))
                kept_depth.append(depth)
                kept_levels.append(level)
            else:
                kept_depth.append(above_depth)
                kept_levels.append(level - 1)
        for _, first, last, _, end in kept:  # pre-order: deeper groups overwrite
            own_start[rows[first : last + 1]] = end
    num_levels = max((k[0] for k in kept), default=0)
    group_of = np.full((num_levels, num_rows), -1, np.int64)
    # Depth-first order in which a group sorts where its earliest batch row is, so the order is
    # the batch order whenever groups are already contiguous there.
    sort_keys = np.tile(np.arange(num_rows), (num_levels + 1, 1))
    for g, (level, first, last, _, _) in enumerate(kept):
        members = rows[first : last + 1]
        group_of[level - 1, members] = g
        sort_keys[level - 1, members] = members.min()
    order = step.rows[np.lexsort(sort_keys[::-1, step.rows])]
    order_is_batch = bool(np.array_equal(order, step.rows))
    levels = []
    for level in range(num_levels):
        in_level = order[group_of[level, order] >= 0]
        groups = group_of[level, in_level]
        starts = np.flatnonzero(np.concatenate(([True], groups[1:] != groups[:-1])))
        segments = [(kept[g][1], kept[g][3], kept[g][4]) for g in groups[starts].tolist()]
        pages = np.array([end - begin for _, begin, end in segments], np.int64)
        levels.append(
            _SharedLevel(
                rows=in_level.astype(np.int32),
                row_indptr=np.append(starts, len(in_level)).astype(np.int32),
                kv_page_indptr=_indptr(pages),
                kv_page_indices=np.concatenate([ids[f, b:e] for f, b, e in segments]),
                spans_batch=order_is_batch and len(in_level) == len(order),
            )
        )
    return _Structure(
        shareable=shareable,
        diverge=diverge,
        own_start=own_start,
        order=order,
        order_is_batch=order_is_batch,
        levels=tuple(levels),
    )


def _indptr(counts: np.ndarray) -> np.ndarray:
    indptr = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=indptr[1:])
    return indptr


def _tokens(rows: np.ndarray, step: _Step) -> tuple[np.ndarray, np.ndarray]:
    """Query-token positions of ``rows`` (concatenated) and the ``[len(rows) + 1]`` row offsets."""
    if step.num_tokens == len(step.rows):  # pure decode: one token per row
        return step.query_start[rows].astype(np.int32), np.arange(len(rows) + 1, dtype=np.int32)
    counts = step.query_lens[rows]
    indptr = _indptr(counts)
    tokens = np.repeat(step.query_start[rows] - indptr[:-1], counts) + np.arange(indptr[-1])
    return tokens.astype(np.int32), indptr


def _emit_shared(structure: _Structure, step: _Step) -> _SharedPart:
    """The structure's shared levels with this step's queries, and the query permutation."""
    levels = []
    for shared in structure.levels:
        q_index, row_tokens = _tokens(shared.rows, step)
        levels.append(
            CascadeLevel(
                q_index=q_index,
                q_is_identity=shared.spans_batch,
                qo_indptr=row_tokens[shared.row_indptr],
                kv_page_indptr=shared.kv_page_indptr,
                kv_page_indices=shared.kv_page_indices,
                kv_last_page_len=np.full(len(shared.row_indptr) - 1, step.page_size, np.int32),
                row_indptr=shared.row_indptr,
                rows=shared.rows,
                causal=False,
            )
        )
    if structure.order_is_batch:
        permutation = np.arange(step.num_tokens, dtype=np.int32)
    else:
        permutation = _tokens(structure.order, step)[0]
    return _SharedPart(
        levels=tuple(levels),
        permutation=permutation,
        group_sizes=tuple(n for s in structure.levels for n in np.diff(s.row_indptr).tolist()),
        shared_pages=tuple(n for s in structure.levels for n in np.diff(s.kv_page_indptr).tolist()),
    )


def _assemble(shared: _SharedPart, structure: _Structure, step: _Step) -> CascadePlan:
    """The finished plan: shared levels, then the per-request level of this step."""
    levels = shared.levels
    if step.rows.size:
        levels = (*levels, _own_level(structure, step))
    return CascadePlan(
        levels=levels,
        permutation=shared.permutation,
        page_size=step.page_size,
        stats=PlanStats(
            pages_flat=int(step.num_pages.sum()),
            pages_cascade=sum(len(level.kv_page_indices) for level in levels),
            shared_levels=len(shared.levels),
            group_sizes=shared.group_sizes,
            shared_pages=shared.shared_pages,
            num_tokens=step.num_tokens,
            num_requests=len(step.rows),
            max_page=max((int(level.kv_page_indices.max()) for level in levels), default=-1),
        ),
    )


def _own_level(structure: _Structure, step: _Step) -> CascadeLevel:
    """The causal per-request level: each row's pages after its deepest group, in batch order."""
    rows = step.rows
    start = structure.own_start[rows]
    num_pages = step.num_pages[rows]
    counts = num_pages - start
    page_indptr = _indptr(counts)
    table = step.block_table
    if table.flags.c_contiguous:  # one flat gather is several times faster than a 2-D one
        flat = np.repeat(rows * table.shape[1] + start - page_indptr[:-1], counts)
        flat += np.arange(page_indptr[-1])
        pages = table.reshape(-1)[flat]
    else:
        cols = np.repeat(start - page_indptr[:-1], counts) + np.arange(page_indptr[-1])
        pages = table[np.repeat(rows, counts), cols]
    return CascadeLevel(
        q_index=np.arange(step.num_tokens, dtype=np.int32),
        q_is_identity=True,
        qo_indptr=_indptr(step.query_lens[rows]),
        kv_page_indptr=page_indptr,
        kv_page_indices=pages,
        kv_last_page_len=(step.seq_lens[rows] - (num_pages - 1) * step.page_size).astype(np.int32),
        row_indptr=np.arange(len(rows) + 1, dtype=np.int32),
        rows=rows.astype(np.int32),
        causal=True,
    )


def plan_violations(plan: CascadePlan, block_table: np.ndarray, seq_lens: np.ndarray,
                    query_lens: np.ndarray) -> list[str]:
    """Every way ``plan`` breaks its contract for this step; empty when it keeps it.

    The ``CASCADE_DEBUG`` check, run before any kernel reads memory: per-group Python loops,
    so it costs milliseconds on large batches. Inputs as for :func:`plan_cascade`.
    """
    page = plan.page_size
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    query_lens = np.asarray(query_lens, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(query_lens)))
    covered: list[list[int]] = [[] for _ in seq_lens]
    problems: list[str] = []
    for depth, level in enumerate(plan.levels):
        last = depth == plan.num_levels - 1
        where = f"level {depth}"
        if level.causal != last:
            problems.append(f"{where}: only the last level may be causal")
        groups = level.num_groups
        if not (len(level.kv_page_indptr) == len(level.row_indptr) == groups + 1
                and len(level.kv_last_page_len) == groups):
            problems.append(f"{where}: array lengths disagree")
            continue
        if (np.diff(level.qo_indptr) <= 0).any() or (np.diff(level.kv_page_indptr) <= 0).any():
            problems.append(f"{where}: empty segment")
            continue
        if not last and (level.kv_page_indices == 0).any():
            problems.append(f"{where}: shares block 0")
        if not ((level.kv_last_page_len >= 1) & (level.kv_last_page_len <= page)).all():
            problems.append(f"{where}: last page length outside 1..{page}")
        for g in range(groups):
            rows = level.rows[level.row_indptr[g]:level.row_indptr[g + 1]]
            pages = level.kv_page_indices[level.kv_page_indptr[g]:level.kv_page_indptr[g + 1]]
            tokens = level.q_index[level.qo_indptr[g]:level.qo_indptr[g + 1]]
            expected = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in rows])
            if not np.array_equal(tokens, expected):
                problems.append(f"{where} group {g}: queries are not its rows' tokens")
            for r in rows:
                covered[r].extend(pages.tolist())
                if not last and len(covered[r]) * page > seq_lens[r] - query_lens[r]:
                    problems.append(f"{where} group {g}: row {r} shares a page it queries")
    for r in np.flatnonzero(query_lens > 0):
        if covered[r] != block_table[r, :-(-seq_lens[r] // page)].tolist():
            problems.append(f"row {r}: its pages are not each read once, in order")
    return problems
