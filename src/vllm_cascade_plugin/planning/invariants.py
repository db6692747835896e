"""The contract check of a :class:`~.plan.CascadePlan` (numpy only).

:func:`plan_violations` is what ``CASCADE_DEBUG`` runs on every plan before a kernel reads memory;
the contract is written down in :mod:`.planner`.
"""

from __future__ import annotations

import numpy as np

from .plan import CascadePlan


def plan_violations(plan: CascadePlan, block_table: np.ndarray, seq_lens: np.ndarray,
                    query_lens: np.ndarray) -> list[str]:
    """Every way ``plan`` breaks its contract for this step; empty when it keeps it.

    The ``CASCADE_DEBUG`` check, run before any kernel reads memory: per-group Python loops,
    so it costs milliseconds on large batches. Inputs as for
    :func:`~vllm_cascade_plugin.planning.planner.plan_cascade`.
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
