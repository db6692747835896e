"""A cascade plan: the data :func:`~.planner.plan_cascade` returns and every executor reads.

numpy only. What a plan must satisfy is written down in :mod:`.planner` and checked by
:func:`~.invariants.plan_violations`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["CascadeLevel", "CascadePlan", "PlanStats"]


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

    @cached_property
    def query_pages(self) -> float:
        """Query tokens times KV pages, summed over the groups (float: int32 products overflow):
        the cost model's work of the level. Computed once per level object, and the planner
        hands consecutive steps the same shared levels. With one query per group (a decode
        step's per-request level) it is the level's page count."""
        queries = int(self.qo_indptr[-1] - self.qo_indptr[0])
        if queries == self.num_groups:  # every group holds at least one query
            return float(self.kv_page_indptr[-1] - self.kv_page_indptr[0])
        return float(np.diff(self.qo_indptr).astype(np.float64)
                     @ np.diff(self.kv_page_indptr).astype(np.float64))

    @cached_property
    def repeat_reads(self) -> tuple[np.ndarray, np.ndarray]:
        """Every read of a group's pages by a row after an earlier row (in batch order) of the
        group read them: (rows since that earlier row, the group's pages), int64 arrays, empty
        where each group has one row. What flat attention reads again (the cost model's L2
        window); once per level object, as :attr:`query_pages`."""
        counts = np.diff(self.row_indptr)
        if not counts.size or int(np.maximum.reduce(counts)) < 2:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        group = np.repeat(np.arange(counts.size), counts)
        order = np.lexsort((self.rows, group))  # by group, then batch row
        rows, group = self.rows[order].astype(np.int64), group[order]
        again = (group[1:] == group[:-1]).nonzero()[0]
        pages = np.diff(self.kv_page_indptr).astype(np.int64)
        return rows[again + 1] - rows[again], pages[group[again + 1]]

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
    # Most pages one row reads over every level: its own count, as every row's pages are each
    # read once (the plan's contract). What a graphed step's last level is sized for.
    max_row_pages: int = 0


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
