"""The cascade planner: invariants of every plan, an independent trie oracle, targeted rules."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_cascade_plugin import planner as planner_module
from vllm_cascade_plugin.planner import CascadePlan, CascadePlanner, plan_cascade

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Batch:
    """One step's planner input, built in tests from explicit page lists."""

    block_table: np.ndarray
    seq_lens: np.ndarray
    query_lens: np.ndarray
    page_size: int

    def plan(self, **limits: int) -> CascadePlan:
        return plan_cascade(
            self.block_table, self.seq_lens, self.query_lens, self.page_size, **limits
        )

    @property
    def num_blocks(self) -> int:
        return int(self.block_table.max()) + 1


def make_batch(
    pages: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    page_size: int,
    width: int = 0,
) -> Batch:
    table = np.zeros((len(pages), max(width, *map(len, pages))), np.int32)
    for row, ids in enumerate(pages):
        table[row, : len(ids)] = ids
    return Batch(table, np.array(seq_lens, np.int32), np.array(query_lens, np.int32), page_size)


@st.composite
def batches(draw: st.DrawFn, max_requests: int = 8) -> Batch:
    """A random prefix forest (1-3 shared levels deep, any group size) as one shuffled batch.

    Rows mix decode and prefill chunks (some starting inside their shared prefix), a few null
    blocks, padding rows and stale ids past each row's last page.
    """
    page_size = draw(st.sampled_from([1, 4, 16]))
    fresh = itertools.count(1)
    paths: list[list[int]] = []

    def grow(prefix: list[int], depth: int) -> None:
        for _ in range(draw(st.integers(1, 3))):
            if len(paths) >= max_requests:
                return
            if depth < 3 and draw(st.booleans()):
                run = [next(fresh) for _ in range(draw(st.integers(1, 3)))]
                grow(prefix + run, depth + 1)
            else:
                paths.append(prefix)

    grow([], 0)
    pages, seq_lens, query_lens = [], [], []
    for path in paths:
        ids = path + [next(fresh) for _ in range(draw(st.integers(1, 3)))]
        if draw(st.integers(0, 9)) == 0:  # a null block (sliding window, padding) in the row
            ids[draw(st.integers(0, len(ids) - 1))] = 0
        seq_len = (len(ids) - 1) * page_size + draw(st.integers(1, page_size))
        decode = draw(st.booleans())
        pages.append(ids)
        seq_lens.append(seq_len)
        query_lens.append(1 if decode else draw(st.integers(1, seq_len)))
    for _ in range(draw(st.integers(0, 2))):  # padding rows: stale ids, any length, no query
        pages.append([draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 3)))])
        seq_lens.append(draw(st.integers(0, 3)) * page_size)
        query_lens.append(0)
    order = draw(st.permutations(range(len(pages))))
    width = max(map(len, pages)) + draw(st.integers(0, 2))
    table = np.full((len(pages), width), draw(st.integers(0, 5)), np.int32)  # stale ids
    for row, i in enumerate(order):
        table[row, : len(pages[i])] = pages[i]
    return Batch(
        table,
        np.array([seq_lens[i] for i in order], np.int32),
        np.array([query_lens[i] for i in order], np.int32),
        page_size,
    )


limits = st.fixed_dictionaries(
    {"max_levels": st.integers(2, 4), "min_shared_pages": st.integers(1, 2)}
)


def row_pages(batch: Batch, row: int) -> list[int]:
    num_pages = -(-int(batch.seq_lens[row]) // batch.page_size)
    return batch.block_table[row, :num_pages].tolist()


def shareable_ids(batch: Batch, row: int) -> list[int]:
    bound = (int(batch.seq_lens[row]) - int(batch.query_lens[row])) // batch.page_size
    ids = batch.block_table[row, :bound].tolist()
    return ids[: ids.index(0)] if 0 in ids else ids


def groups(plan: CascadePlan):
    """``(level, rows, pages, tokens)`` for every group of every level."""
    for depth, level in enumerate(plan.levels):
        for g in range(level.num_groups):
            yield (
                depth,
                level.rows[level.row_indptr[g] : level.row_indptr[g + 1]].tolist(),
                level.kv_page_indices[level.kv_page_indptr[g] : level.kv_page_indptr[g + 1]],
                level.q_index[level.qo_indptr[g] : level.qo_indptr[g + 1]].tolist(),
            )


def check_invariants(batch: Batch, plan: CascadePlan) -> None:
    active = [r for r in range(len(batch.seq_lens)) if batch.query_lens[r] > 0]
    starts = np.concatenate(([0], np.cumsum(batch.query_lens)))
    tokens_of = {r: list(range(starts[r], starts[r + 1])) for r in active}
    assert plan.num_levels == (0 if not active else plan.stats.shared_levels + 1)
    covered: dict[int, list[int]] = defaultdict(list)
    for depth, rows, pages, tokens in groups(plan):
        last = depth == plan.num_levels - 1
        level = plan.levels[depth]
        assert level.causal == last
        assert rows and len(pages) and tokens, "no empty segment"
        assert tokens == [t for r in rows for t in tokens_of[r]]
        if not last:
            assert len(rows) >= 2 and 0 not in pages
            assert (level.kv_last_page_len == batch.page_size).all()
        for r in rows:
            covered[r].extend(pages.tolist())
            if not last:  # non-causal: only pages wholly before the row's first query token
                before_query = batch.seq_lens[r] - batch.query_lens[r]
                assert len(covered[r]) * batch.page_size <= before_query
    for r in active:
        assert covered[r] == row_pages(batch, r), "each page once, in order"
    own = plan.levels[-1] if active else None
    if own is not None:
        assert own.rows.tolist() == active and own.q_is_identity
        assert own.q_index.tolist() == list(range(plan.stats.num_tokens))
        num_pages = np.array([len(row_pages(batch, r)) for r in active])
        expected_last = batch.seq_lens[active] - (num_pages - 1) * batch.page_size
        assert own.kv_last_page_len.tolist() == expected_last.tolist()
    for level in plan.levels:
        assert level.q_is_identity == (level.q_index.tolist() == list(range(plan.stats.num_tokens)))
    # The permutation keeps every group contiguous, and moves nothing when nothing needs to move.
    assert sorted(plan.permutation.tolist()) == list(range(plan.stats.num_tokens))
    position = np.argsort(plan.permutation)
    already_contiguous = True
    for _, _, _, tokens in groups(plan):
        where = np.sort(position[tokens])
        assert where[-1] - where[0] == len(where) - 1
        already_contiguous &= max(tokens) - min(tokens) == len(tokens) - 1
    for level in plan.levels[:-1]:  # shared levels: subsequences of the permutation
        assert (np.diff(position[level.q_index]) > 0).all()
    if already_contiguous:
        assert plan.permutation.tolist() == list(range(plan.stats.num_tokens))
    assert plan.stats.pages_flat == sum(len(row_pages(batch, r)) for r in active)
    assert plan.stats.pages_cascade == sum(len(level.kv_page_indices) for level in plan.levels)
    assert plan.stats.num_tokens == int(batch.query_lens.sum())
    assert plan.stats.num_requests == len(active)
    for level in plan.levels:
        for name in ("q_index", "qo_indptr", "kv_page_indptr", "kv_page_indices", "rows"):
            assert getattr(level, name).dtype == np.int32


def expected_groups(batch: Batch, max_levels: int, min_shared_pages: int) -> set:
    """The spec, brute force: trie nodes of >= 2 rows, kept top-down by the two limits."""
    through: dict[tuple[int, ...], set[int]] = defaultdict(set)
    child_ids: dict[tuple[int, ...], set[int]] = defaultdict(set)
    for r in range(len(batch.seq_lens)):
        if batch.query_lens[r] > 0:
            ids = shareable_ids(batch, r)
            for n in range(1, len(ids) + 1):
                through[tuple(ids[:n])].add(r)
                child_ids[tuple(ids[: n - 1])].add(ids[n - 1])
    # A compressed node: >= 2 rows pass through, and not all of them continue along one child.
    nodes = [
        path
        for path, rows in through.items()
        if len(rows) >= 2 and all(through.get((*path, x)) != rows for x in child_ids[path])
    ]
    kept: dict[tuple[int, ...], int] = {}  # kept node -> level
    result = set()
    for path in sorted(nodes, key=len):
        above = [p for p in kept if path[: len(p)] == p]
        top = max(map(len, above), default=0)
        level = len(above) + 1
        if len(path) - top >= min_shared_pages and level < max_levels:
            kept[path] = level
            result.add((level - 1, frozenset(through[path]), path[top:]))
    return result


def planned_groups(plan: CascadePlan) -> set:
    return {
        (depth, frozenset(rows), tuple(pages.tolist()))
        for depth, rows, pages, _ in groups(plan)
        if depth < plan.num_levels - 1
    }


def assert_same_plan(a: CascadePlan, b: CascadePlan) -> None:
    assert a.num_levels == b.num_levels and a.page_size == b.page_size and a.stats == b.stats
    assert np.array_equal(a.permutation, b.permutation)
    for level_a, level_b in zip(a.levels, b.levels, strict=True):
        for field in fields(level_a):
            x, y = getattr(level_a, field.name), getattr(level_b, field.name)
            assert np.array_equal(x, y), field.name


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), limits=limits)
def test_every_plan_keeps_the_invariants_and_finds_every_kept_trie_node(batch, limits):
    plan = batch.plan(**limits)
    check_invariants(batch, plan)
    assert planned_groups(plan) == expected_groups(batch, **limits)


# ---- steady state ---------------------------------------------------------------------------


def decode_step(batch: Batch, fresh: itertools.count) -> Batch:
    """Every live row gains one token; a row entering a new page gets a fresh block there."""
    table = batch.block_table.copy()
    seq = batch.seq_lens.copy()
    live = batch.query_lens > 0
    for r in np.flatnonzero(live):
        if seq[r] % batch.page_size == 0:
            table[r, seq[r] // batch.page_size] = next(fresh)
    seq[live] += 1
    return replace(batch, block_table=table, seq_lens=seq, query_lens=live.astype(np.int32))


@st.composite
def engine_steps(draw: st.DrawFn) -> list[Batch]:
    """A batch and what the engine does to it over a few steps, as the planner sees it."""
    first = draw(batches())
    steps = [replace(first, block_table=np.pad(first.block_table, ((0, 0), (0, 24))))]
    fresh = itertools.count(steps[0].num_blocks + 100)
    actions = st.sampled_from(["decode"] * 4 + ["reuse", "swap", "end", "chunk"])
    for action in draw(st.lists(actions, max_size=12)):
        batch = steps[-1]
        rows = len(batch.seq_lens)
        if action == "decode":
            batch = decode_step(batch, fresh)
        elif action == "reuse":  # a block is freed and its id (or the null block) put elsewhere
            table = batch.block_table.copy()
            r, c = draw(st.integers(0, rows - 1)), draw(st.integers(0, table.shape[1] - 1))
            table[r, c] = draw(st.sampled_from([next(fresh), 0, *table.ravel()[:8].tolist()]))
            batch = replace(batch, block_table=table)
        elif action == "chunk":  # a row (re)computes a chunk: preempted, or a new prompt part
            r = draw(st.integers(0, rows - 1))
            query_lens = batch.query_lens.copy()
            query_lens[r] = draw(st.integers(min(1, batch.seq_lens[r]), batch.seq_lens[r]))
            batch = replace(batch, query_lens=query_lens)
        elif action == "swap":
            order = np.array(draw(st.permutations(range(rows))))
            batch = Batch(
                batch.block_table[order],
                batch.seq_lens[order],
                batch.query_lens[order],
                batch.page_size,
            )
        else:
            query_lens = batch.query_lens.copy()
            query_lens[draw(st.integers(0, rows - 1))] = 0
            batch = replace(batch, query_lens=query_lens)
        steps.append(batch)
    return steps


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=engine_steps(), limits=limits)
def test_steady_planner_always_equals_a_fresh_plan(steps, limits):
    planner = CascadePlanner(**limits)
    for batch in steps:
        assert_same_plan(
            planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size),
            batch.plan(**limits),
        )


def interleaved_decode_batch(groups: int, per_group: int, shared: int, page_size: int = 4):
    """``groups`` prefixes of ``shared`` pages, rows interleaved, each row with a private page
    full and one partly filled (so it has diverged from its siblings before growing)."""
    fresh = itertools.count(1000)
    prefixes = [[next(fresh) for _ in range(shared)] for _ in range(groups)]
    pages = [prefixes[r % groups] + [next(fresh), next(fresh)] for r in range(groups * per_group)]
    seq_lens = [(shared + 1) * page_size + 1 + r % page_size for r in range(len(pages))]
    return make_batch(pages, seq_lens, [1] * len(pages), page_size, width=shared + 40)


def test_steady_decode_reuses_the_structure(monkeypatch):
    batch = interleaved_decode_batch(groups=3, per_group=4, shared=5)
    # And a sliding-window row whose leading blocks went back to the null block: it grows, but
    # never into anything it could share.
    window_row = np.zeros_like(batch.block_table[:1])
    window_row[0, 5:7] = [900, 901]
    batch = Batch(
        np.vstack([batch.block_table, window_row]),
        np.append(batch.seq_lens, 6 * batch.page_size + 2),
        np.append(batch.query_lens, 1),
        batch.page_size,
    )
    builds = []
    real_build = planner_module._build
    monkeypatch.setattr(planner_module, "_build", lambda *a: builds.append(1) or real_build(*a))
    planner = CascadePlanner()
    fresh = itertools.count(5000)
    for _ in range(3 * batch.page_size):  # every row crosses a page boundary on the way
        planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size)
        batch = decode_step(batch, fresh)
    assert len(builds) == 1


def test_steady_planner_detects_reused_block_ids():
    batch = interleaved_decode_batch(groups=2, per_group=2, shared=3)
    planner = CascadePlanner()
    before = planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size)
    assert before.stats.shared_pages == (3, 3)
    table = batch.block_table.copy()
    table[2, 1] = 777  # row 2's block was freed and the id reused: it no longer shares page 1+
    after = planner.plan(table, batch.seq_lens, batch.query_lens, batch.page_size)
    assert_same_plan(after, replace(batch, block_table=table).plan())
    assert after.stats.shared_pages == (1, 3)


def test_steady_planner_notices_rows_growing_into_shared_pages():
    # Row 1 prefills a chunk starting inside block 12, which row 0 already shares in full.
    batch = make_batch([[11, 12, 13], [11, 12, 14]], [9, 9], [1, 3], page_size=4)
    planner = CascadePlanner()
    plan = planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size)
    assert plan.stats.shared_pages == (1,)
    plan = planner.plan(batch.block_table, batch.seq_lens + 1, [1, 1], batch.page_size)
    assert plan.stats.shared_pages == (2,)


def test_steady_planner_unshares_pages_a_recomputed_row_now_queries():
    batch = interleaved_decode_batch(groups=1, per_group=3, shared=4)
    planner = CascadePlanner()
    planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size)
    query_lens = batch.query_lens.copy()
    query_lens[1] = batch.seq_lens[1] - 9  # row 1 was preempted: recomputes from token 9 on
    plan = planner.plan(batch.block_table, batch.seq_lens, query_lens, batch.page_size)
    check_invariants(replace(batch, query_lens=query_lens), plan)
    assert [(level, sorted(rows), len(pages)) for level, rows, pages, _ in groups(plan)][:2] == [
        (0, [0, 1, 2], 2),
        (1, [0, 2], 2),
    ]


def test_steady_planner_stops_a_growing_row_at_block_zero():
    batch = make_batch([[1, 2, 3, 0, 0], [1, 2, 4, 5, 0]], [9, 13], [1, 1], 4)
    planner = CascadePlanner()
    planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size)
    table = batch.block_table.copy()
    table[1, 4] = 6
    grown = replace(batch, block_table=table, seq_lens=batch.seq_lens + 4)  # row 0: over block 0
    plan = planner.plan(grown.block_table, grown.seq_lens, grown.query_lens, grown.page_size)
    check_invariants(grown, plan)
    assert_same_plan(plan, grown.plan())


def test_steady_planner_drops_a_finished_row():
    batch = interleaved_decode_batch(groups=1, per_group=3, shared=2)
    planner = CascadePlanner()
    planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size)
    plan = planner.plan(batch.block_table, batch.seq_lens, [1, 0, 1], batch.page_size)
    assert [level.rows.tolist() for level in plan.levels] == [[0, 2], [0, 2]]


def test_steady_planner_takes_in_a_new_row():
    batch = make_batch([[1, 2, 3], [1, 2, 4], [0]], [9, 9, 0], [1, 1, 0], 4)
    planner = CascadePlanner()
    planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size)
    table = batch.block_table.copy()
    table[2, 0] = 7
    joined = Batch(table, np.array([9, 9, 3]), np.array([1, 1, 3]), 4)
    plan = planner.plan(joined.block_table, joined.seq_lens, joined.query_lens, 4)
    check_invariants(joined, plan)


def test_steady_planner_follows_new_query_lens():
    batch = interleaved_decode_batch(groups=1, per_group=3, shared=2)
    planner = CascadePlanner()
    seq_lens = batch.seq_lens.astype(np.int64)
    query_lens = batch.query_lens.astype(np.int64)
    planner.plan(batch.block_table, seq_lens, query_lens, batch.page_size)
    seq_lens[1] += 1  # in place, as vLLM does: row 1 verifies two speculative tokens
    query_lens[1] = 2
    plan = planner.plan(batch.block_table, seq_lens, query_lens, batch.page_size)
    assert plan.levels[0].q_index.tolist() == [0, 1, 2, 3]
    assert plan.levels[0].qo_indptr.tolist() == [0, 4]


def test_steady_planner_rebuilds_when_rows_change_places():
    batch = interleaved_decode_batch(groups=2, per_group=2, shared=2)
    planner = CascadePlanner()
    planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size)
    order = [1, 0, 3, 2]
    swapped = Batch(batch.block_table[order], batch.seq_lens[order], batch.query_lens[order], 4)
    plan = planner.plan(swapped.block_table, swapped.seq_lens, swapped.query_lens, 4)
    assert_same_plan(plan, swapped.plan())
    assert plan.levels[0].rows.tolist() == [0, 2, 1, 3]


# ---- targeted rules -------------------------------------------------------------------------


def test_planner_never_shares_block_zero():
    batch = make_batch(
        [[5, 0, 7, 8], [5, 0, 7, 9], [0, 3, 4], [0, 3, 6]], [13, 13, 9, 9], [1, 1, 1, 1], 4
    )
    plan = batch.plan()
    check_invariants(batch, plan)
    assert planned_groups(plan) == {(0, frozenset({0, 1}), (5,))}


def test_interleaved_groups_get_a_permutation():
    batch = interleaved_decode_batch(groups=2, per_group=2, shared=2)
    plan = batch.plan()
    check_invariants(batch, plan)
    assert plan.permutation.tolist() == [0, 2, 1, 3]
    assert plan.levels[0].q_index.tolist() == [0, 2, 1, 3]
    assert not plan.levels[0].q_is_identity


def test_contiguous_groups_keep_the_identity_permutation():
    batch = make_batch([[1, 2, 5], [1, 2, 6], [3, 7], [3, 8], [9]], [9, 9, 5, 5, 2], [1] * 5, 4)
    plan = batch.plan()
    assert plan.permutation.tolist() == [0, 1, 2, 3, 4]
    assert plan.levels[0].q_is_identity is False  # row 4 shares nothing: not on level 0
    assert plan.levels[0].q_index.tolist() == [0, 1, 2, 3]


def test_nested_sharing_becomes_separate_levels():
    system, doc_a, doc_b = [1, 2], [3, 4, 5], [6]
    pages = [
        system + doc_a + [10],
        system + doc_b + [11],
        system + doc_a + [12],
        system + doc_b + [13],
    ]
    batch = make_batch(pages, [len(p) * 4 for p in pages], [1] * 4, 4)
    plan = batch.plan()
    check_invariants(batch, plan)
    assert plan.num_levels == 3
    assert planned_groups(plan) == {
        (0, frozenset({0, 1, 2, 3}), (1, 2)),
        (1, frozenset({0, 2}), (3, 4, 5)),
        (1, frozenset({1, 3}), (6,)),
    }
    # Every shared level lists its queries in the one depth-first order of the permutation.
    assert plan.permutation.tolist() == [0, 2, 1, 3]
    assert [level.q_index.tolist() for level in plan.levels[:2]] == [[0, 2, 1, 3]] * 2


def test_sampling_siblings_sharing_their_whole_prompt_form_a_group():
    prompt = [1, 2, 3]
    batch = make_batch([[*prompt, 10 + i] for i in range(4)], [14] * 4, [1] * 4, 4)
    plan = batch.plan()
    assert planned_groups(plan) == {(0, frozenset(range(4)), (1, 2, 3))}


def test_partial_page_before_query_is_not_shared():
    # Both rows hold blocks 1, 2, 3; row 1's prefill chunk starts at token 6, inside block 2.
    batch = make_batch([[1, 2, 3], [1, 2, 3]], [12, 12], [1, 6], 4)
    plan = batch.plan()
    check_invariants(batch, plan)
    assert planned_groups(plan) == {(0, frozenset({0, 1}), (1,))}


def test_no_sharing_gives_single_level():
    batch = make_batch([[1, 2], [3], [4, 5, 6]], [5, 2, 12], [1, 2, 4], 4)
    plan = batch.plan()
    check_invariants(batch, plan)
    assert plan.num_levels == 1 and plan.stats.pages_cascade == plan.stats.pages_flat == 6


def test_max_levels_pushes_deep_pages_down():
    pages = [[1, 2, 3, 10], [1, 2, 3, 11], [1, 4, 12], [1, 4, 13]]
    batch = make_batch(pages, [len(p) * 4 for p in pages], [1] * 4, 4)
    plan = batch.plan(max_levels=2)
    check_invariants(batch, plan)
    assert planned_groups(plan) == {(0, frozenset(range(4)), (1,))}
    assert plan.levels[-1].kv_page_indices.tolist() == [2, 3, 10, 2, 3, 11, 4, 12, 4, 13]


def test_min_shared_pages_drops_small_groups():
    # The one-page node {all} is dropped and its page falls into both children.
    pages = [[1, 2, 3, 10], [1, 2, 3, 11], [1, 4, 5, 12], [1, 4, 5, 13], [1, 6, 14], [1, 7, 15]]
    batch = make_batch(pages, [len(p) * 4 for p in pages], [1] * 6, 4)
    plan = batch.plan(min_shared_pages=3)
    check_invariants(batch, plan)
    assert planned_groups(plan) == {
        (0, frozenset({0, 1}), (1, 2, 3)),
        (0, frozenset({2, 3}), (1, 4, 5)),
    }


def test_padding_rows_take_part_in_no_level():
    batch = make_batch([[1, 2, 3], [0, 0], [1, 2, 4], [1, 2]], [9, 8, 9, 5], [1, 0, 2, 0], 4)
    plan = batch.plan()
    check_invariants(batch, plan)
    assert [level.rows.tolist() for level in plan.levels] == [[0, 2], [0, 2]]
    assert plan.levels[0].q_is_identity and plan.stats.num_tokens == 3


def test_one_page_requests_and_all_padding():
    plan = make_batch([[4], [4]], [3, 1], [1, 1], 4).plan()
    assert plan.num_levels == 1 and plan.stats.pages_cascade == 2
    empty = make_batch([[0], [0]], [0, 0], [0, 0], 4).plan()
    assert empty.num_levels == 0 and empty.stats.num_tokens == 0


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "width", "limits"),
    [
        ([4, 4], [5, 1], 1, {}),  # more queries than tokens
        ([4, 9], [1, 1], 2, {}),  # row 1 needs 3 pages, the table has 2
        ([4, 4], [1, 1], 1, {"max_levels": 1}),
        ([4, 4], [1, 1], 1, {"min_shared_pages": 0}),
    ],
)
def test_planner_rejects_impossible_inputs(seq_lens, query_lens, width, limits):
    with pytest.raises(ValueError):
        plan_cascade(np.ones((2, width), np.int32), seq_lens, query_lens, 4, **limits)


def run_python(*args: str) -> str:
    """Run this interpreter in a subprocess that imports the package from this checkout."""
    path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    return done.stdout


def test_planner_imports_numpy_only():
    code = "import sys, vllm_cascade_plugin.planner; print('torch' in sys.modules)"
    assert run_python("-c", code).strip() == "False"


def test_planner_bench_quick_writes_rows(tmp_path):
    run_python(str(REPO / "benchmarks" / "planner_bench.py"), "--quick", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "planner.json").read_text())
    assert rows and all(
        set(row) == {"case", "requests", "pages", "steady_median_us", "cold_median_us",
                     "precheck_median_us", "planner_skipped"}
        for row in rows
    )
    # The pre-check lets the hooks skip the planner on the batch without sharing, and only there.
    assert {row["case"]: row["planner_skipped"] for row in rows} == {
        "1x32K": False, "8 groups": False, "16 groups": False, "no sharing": True}
    assert json.loads((tmp_path / "planner.meta.json").read_text())["command"]


@given(batch=batches(), limits=limits)
def test_nothing_shared_never_skips_a_step_that_has_a_shared_level(batch, limits):
    """The hooks skip the planner when nothing_shared() says so: the planner must agree."""
    skip = planner_module.nothing_shared(batch.block_table[:, 0], batch.seq_lens,
                                         batch.query_lens, batch.page_size)
    if skip:
        assert batch.plan(**limits).num_levels <= 1


def test_nothing_shared_sees_sharing_only_where_a_whole_page_precedes_the_queries():
    # Rows 0 and 1 start with block 7; row 2 with block 9.
    first = np.array([7, 7, 9])
    page = 16
    # Both rows sharing block 7 have a whole page before their queries: sharing is possible.
    assert not planner_module.nothing_shared(first, [40, 33, 40], [1, 1, 1], page)
    # Row 1 is a prefill chunk starting inside its first page: block 7 is not shareable there.
    assert planner_module.nothing_shared(first, [40, 33, 40], [1, 30, 1], page)
    # Padding rows (no query) and block 0 never count.
    assert planner_module.nothing_shared(first, [40, 33, 40], [1, 0, 1], page)
    assert planner_module.nothing_shared(np.array([0, 0, 9]), [40, 40, 40], [1, 1, 1], page)
    # Distinct first blocks: nothing can be shared, whatever follows them.
    assert planner_module.nothing_shared(np.array([3, 4, 5]), [400] * 3, [1] * 3, page)
    assert planner_module.nothing_shared(np.array([], np.int32), [], [], page)
