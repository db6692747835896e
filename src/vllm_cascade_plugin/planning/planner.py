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

This module holds the entry points; the plan's types are :mod:`.plan`, the trie :mod:`.trie`,
the step inputs and the groups' layout :mod:`.layout`, what :class:`CascadePlanner` carries from
one step to the next :mod:`.memory`, and the contract's check (``CASCADE_DEBUG``)
:func:`~.invariants.plan_violations`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .layout import Step, Structure, indptr, layout, read_step, shareable_bound, shareable_pages
from .memory import PlanMemory
from .plan import CascadeLevel, CascadePlan, PlanStats
from .trie import build_trie

__all__ = ["CascadeLevel", "CascadePlan", "CascadePlanner", "PlanStats", "nothing_shared",
           "plan_cascade"]


def plan_cascade(
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    query_lens: np.ndarray,
    page_size: int,
    *,
    max_levels: int = 3,
    min_shared_pages: int = 1,
    row_index: np.ndarray | None = None,
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
    row_index : optional int ``[R]``: row ``r``'s ids are ``block_table[row_index[r]]`` (a
        table of more rows, read where needed rather than copied whole).

    Returns
    -------
    CascadePlan
        With no levels at all when every row is padding.
    """
    _check_limits(max_levels, min_shared_pages)
    step = read_step(block_table, seq_lens, query_lens, page_size, row_index)
    structure = _build(step, shareable_pages(step), max_levels, min_shared_pages)
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
    bound = shareable_bound(np.asarray(seq_lens, dtype=np.int64), qry, qry > 0, page_size)
    first_pages = np.asarray(first_pages)
    firsts = first_pages[(bound >= 1) & (first_pages != 0)]
    return firsts.size < 2 or np.unique(firsts).size == firsts.size


class CascadePlanner:
    """:func:`plan_cascade` with a memory: carries the prefix structure across engine steps.

    In steady decode the groups stay the same while every row grows by a token and now and then
    by a page; under online serving requests also finish, arrive and change places every step.
    The planner remembers the prefix trie it found and each row's place in it. A row that still
    holds, where it was, the shareable block ids it was planned with (checked id by id: vLLM
    frees and reuses block ids) keeps its place; a new, moved or changed row is looked up in the
    trie. As long as the rows form the same trie, only the layout of the groups is redone (and
    while every row keeps its place, not even that); when they do not (a new shared prefix, a
    group left with one row, many rows moved), the planner plans from scratch. A keyed step of
    the last step's decode rows, each one token longer (steady decode), is not even read: its
    inputs and structure follow from the last step's (:meth:`.PlanMemory.continue_decode`). ``plan``
    therefore returns exactly what :func:`plan_cascade` returns for the same arguments.

    While the structure and the query lengths stay the same, consecutive plans hold the very same
    shared :class:`CascadeLevel` objects (and permutation array): executors may skip re-planning
    a level that ``is`` the previous step's, and must treat every plan array as read-only.
    """

    def __init__(self, *, max_levels: int = 3, min_shared_pages: int = 1) -> None:
        _check_limits(max_levels, min_shared_pages)
        self.max_levels = max_levels
        self.min_shared_pages = min_shared_pages
        self._memory: PlanMemory | None = None
        # How the last plan was made: "continued" (the last step's decode rows, one token
        # longer), "followed" (the rows looked up in the last step's trie) or "from scratch".
        self.last_path = ""
        self._shared: _SharedPart | None = None
        self._shared_order: np.ndarray | None = None  # the structure's order `_shared` is for
        self._shared_query_lens = np.empty(0, np.int64)  # and the step's query lengths

    def plan(
        self,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        query_lens: np.ndarray,
        page_size: int,
        row_keys: np.ndarray | None = None,
        row_index: np.ndarray | None = None,
    ) -> CascadePlan:
        """Plan one step; arguments as in :func:`plan_cascade`.

        ``row_keys``: optional int ``[R]``, one key per row, which spares comparing the block
        table with the last step's. A row whose key some row had when the planner last
        planned with keys must hold, wherever it is now, that row's ids in every column that
        step read (vLLM only appended to them); a row whose ids may have changed otherwise (a
        new request, one whose ids were rewritten) must bring a key no row had then. Keys that
        repeat within a step are trusted at the same place only. A broken promise gives a plan
        of stale ids: :func:`~.invariants.plan_violations` (``CASCADE_DEBUG``) finds it.
        """
        # Held out while it is updated: a step that fails half way leaves no memory behind.
        memory, self._memory = self._memory, None
        continued = None
        if memory is not None and row_keys is not None and page_size == memory.page_size:
            # Steady decode: each row one token longer, read from the last step's inputs.
            continued = memory.continue_decode(block_table, seq_lens, query_lens, row_keys,
                                               row_index)
        if continued is not None:
            step, structure = continued
            path = "continued"
        else:
            step = read_step(block_table, seq_lens, query_lens, page_size, row_index)
            keys = None
            if row_keys is not None:
                keys = np.asarray(row_keys, dtype=np.int64)
                if keys.shape != step.seq_lens.shape:
                    raise ValueError(
                        f"need row_keys [R] = {step.seq_lens.shape}, got {keys.shape}")
            followed = None if memory is None else memory.follow(step, keys)
            path = "followed"
            if followed is None:
                followed = _build(step, shareable_pages(step), self.max_levels,
                                  self.min_shared_pages)
                memory = PlanMemory(step, followed, keys)
                path = "from scratch"
            structure = followed
        self._memory = memory
        self.last_path = path
        # A structure carried over unchanged keeps its order array: the shared levels emitted
        # for it still hold while the query lengths do.
        known = self._shared_query_lens
        if (self._shared is None or self._shared_order is not structure.order
                or known.shape != step.query_lens.shape
                or np.count_nonzero(known != step.query_lens)):
            self._shared = _emit_shared(structure, step)
            self._shared_order = structure.order
            self._shared_query_lens = step.query_lens.copy()  # callers update theirs in place
        return _assemble(self._shared, structure, step)

    def advance(self, block_table: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                page_size: int, row_keys: np.ndarray, row_index: np.ndarray | None = None,
                ) -> bool:
        """Carry the memory over a step that :meth:`continues` the last one without making its
        plan (arguments as :meth:`plan`'s): True when it did, as :meth:`plan` would have on its
        continued path; False, the memory unchanged, where :meth:`plan` must place a row anew
        (then plan it). For a step whose plan the caller knows it will not run."""
        memory = self._memory
        if memory is None or page_size != memory.page_size:
            return False
        if memory.continue_decode(block_table, seq_lens, query_lens, row_keys,
                                  row_index) is None:
            return False
        self.last_path = "continued"
        return True

    def continues(self, seq_lens: np.ndarray, query_lens: np.ndarray,
                  row_keys: np.ndarray | Callable[[], np.ndarray | None] | None,
                  row_index: np.ndarray | None = None) -> bool:
        """Whether a step (arguments as :meth:`plan`'s; ``row_keys`` may be a function that
        reads them, called only where the lengths match) is the last planned step's decode rows,
        each one token longer, with a shared level: it still shares (its rows hold the ids they
        shared), and the cost model's floor, which only flat attention's estimate moves, grew
        no more favourable to flat. The runner hooks then skip their pre-checks."""
        memory = self._memory
        return (memory is not None and bool(memory.structure.levels)
                and memory.continues(seq_lens, query_lens, row_keys, row_index))


def _build(step: Step, shareable: np.ndarray, max_levels: int, min_shared_pages: int) -> Structure:
    """The structure of a step from scratch: sort the rows' shareable ids into the prefix trie."""
    trie, node, continuation = build_trie(step.dense(), shareable, max_levels,
                                          min_shared_pages)
    return layout(trie, node, continuation, shareable, step)


@dataclass(slots=True, eq=False)
class _SharedPart:
    """The shared levels and permutation of a plan: a function of structure and query_lens."""

    levels: tuple[CascadeLevel, ...]
    permutation: np.ndarray
    group_sizes: tuple[int, ...]
    shared_pages: tuple[int, ...]
    pages: int  # pages the shared levels read
    max_page: int  # largest block id they read, -1 for none


def _check_limits(max_levels: int, min_shared_pages: int) -> None:
    if max_levels < 2:
        raise ValueError(f"max_levels must be >= 2 (shared + per-request), got {max_levels}")
    if min_shared_pages < 1:
        raise ValueError(f"min_shared_pages must be >= 1, got {min_shared_pages}")


def _tokens(rows: np.ndarray, step: Step) -> tuple[np.ndarray, np.ndarray | None]:
    """Query-token positions of ``rows`` (concatenated) and the ``[len(rows) + 1]`` row offsets.

    The offsets are ``None`` in a pure decode step, where they are ``arange(len(rows) + 1)``.
    """
    if step.num_tokens == len(step.rows):  # pure decode: one token per row
        return step.query_start[rows].astype(np.int32), None
    counts = step.query_lens[rows]
    offsets = indptr(counts)
    tokens = (step.query_start[rows] - offsets[:-1]).repeat(counts)
    tokens += np.arange(offsets[-1])
    return tokens.astype(np.int32), offsets


def _emit_shared(structure: Structure, step: Step) -> _SharedPart:
    """The structure's shared levels with this step's queries, and the query permutation."""
    if structure.order_is_batch:
        permutation, order_offsets = np.arange(step.num_tokens, dtype=np.int32), None
    else:
        permutation, order_offsets = _tokens(structure.order, step)
    levels = []
    for shared in structure.levels:
        if shared.spans_order and not structure.order_is_batch:  # its queries: the permutation
            q_index, row_tokens = permutation, order_offsets
        else:
            q_index, row_tokens = _tokens(shared.rows, step)
        qo_indptr = shared.row_indptr if row_tokens is None else row_tokens[shared.row_indptr]
        levels.append(
            CascadeLevel(
                q_index=q_index,
                q_is_identity=shared.spans_batch,
                qo_indptr=qo_indptr,
                kv_page_indptr=shared.kv_page_indptr,
                kv_page_indices=shared.kv_page_indices,
                kv_last_page_len=_full_pages(len(shared.row_indptr) - 1, step.page_size),
                row_indptr=shared.row_indptr,
                rows=shared.rows,
                causal=False,
            )
        )
    return _SharedPart(
        levels=tuple(levels),
        permutation=permutation,
        group_sizes=tuple(n for s in structure.levels for n in s.group_sizes),
        shared_pages=tuple(n for s in structure.levels for n in s.group_pages),
        pages=structure.trie.pages,
        max_page=structure.trie.max_page,
    )


def _full_pages(count: int, page_size: int) -> np.ndarray:
    """int32 ``[count]`` of ``page_size``: the last page length of groups of whole pages."""
    lengths = np.empty(count, np.int32)
    lengths.fill(page_size)
    return lengths


def _assemble(shared: _SharedPart, structure: Structure, step: Step) -> CascadePlan:
    """The finished plan: shared levels, then the per-request level of this step."""
    levels = shared.levels
    pages, max_page = shared.pages, shared.max_page
    if step.rows.size:
        own = _own_level(structure, step)
        levels = (*levels, own)
        pages += len(own.kv_page_indices)
        max_page = max(max_page, int(np.maximum.reduce(own.kv_page_indices)))
    return CascadePlan(
        levels=levels,
        permutation=shared.permutation,
        page_size=step.page_size,
        stats=PlanStats(
            pages_flat=int(np.add.reduce(step.num_pages)),
            pages_cascade=pages,
            shared_levels=len(shared.levels),
            group_sizes=shared.group_sizes,
            shared_pages=shared.shared_pages,
            num_tokens=step.num_tokens,
            num_requests=len(step.rows),
            max_page=max_page,
            max_row_pages=int(np.maximum.reduce(step.num_pages)) if step.rows.size else 0,
        ),
    )


def _own_level(structure: Structure, step: Step) -> CascadeLevel:
    """The causal per-request level: each row's pages after its deepest group, in batch order."""
    rows = step.rows
    if step.all_active:  # rows is arange(R): per-row arrays need no gathering
        start, num_pages, seq_lens = structure.own_start, step.num_pages, step.seq_lens
        query_lens = step.query_lens
    else:
        start, num_pages = structure.own_start[rows], step.num_pages[rows]
        seq_lens, query_lens = step.seq_lens[rows], step.query_lens[rows]
    counts = num_pages - start
    page_indptr = indptr(counts)
    table = step.block_table
    where = step.table_rows(rows)
    if table.flags.c_contiguous:  # one flat gather is several times faster than a 2-D one
        flat = (where * table.shape[1] + start - page_indptr[:-1]).repeat(counts)
        flat += np.arange(page_indptr[-1])
        pages = table.reshape(-1).take(flat)
    else:
        cols = (start - page_indptr[:-1]).repeat(counts) + np.arange(page_indptr[-1])
        pages = table[where.repeat(counts), cols]
    row_indptr = np.arange(len(rows) + 1, dtype=np.int32)
    last_page = seq_lens - 1
    last_page %= step.page_size
    last_page += 1
    return CascadeLevel(
        q_index=np.arange(step.num_tokens, dtype=np.int32),
        q_is_identity=True,
        qo_indptr=row_indptr if step.num_tokens == len(rows) else indptr(query_lens),
        kv_page_indptr=page_indptr,
        kv_page_indices=pages,
        kv_last_page_len=last_page.astype(np.int32),
        row_indptr=row_indptr,
        rows=rows.astype(np.int32),
        causal=True,
    )
