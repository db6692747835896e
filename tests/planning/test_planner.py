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

from vllm_cascade_plugin.planning import planner as planner_module
from vllm_cascade_plugin.planning import trie as trie_module
from vllm_cascade_plugin.planning.invariants import plan_violations
from vllm_cascade_plugin.planning.planner import CascadePlan, CascadePlanner, plan_cascade

REPO = Path(__file__).resolve().parents[2]


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


@given(batch=batches(), limits=limits)
def test_a_plans_most_pages_per_row_is_what_its_levels_give_its_busiest_query(batch, limits):
    """``PlanStats.max_row_pages`` (a graphed step's last level is sized by it) against the
    pages each query reads, summed over the levels; rows without queries read nothing."""
    plan = batch.plan(**limits)
    total = np.zeros(plan.stats.num_tokens, np.int64)
    for level in plan.levels:
        total[level.q_index] += np.repeat(np.diff(level.kv_page_indptr),
                                          np.diff(level.qo_indptr))
    assert plan.stats.max_row_pages == int(total.max(initial=0))


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


def test_steady_planner_follows_rows_that_change_places(monkeypatch):
    batch = interleaved_decode_batch(groups=2, per_group=2, shared=2)
    planner = CascadePlanner()
    planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size)
    builds = count_builds(monkeypatch)
    order = [1, 0, 3, 2]
    swapped = Batch(batch.block_table[order], batch.seq_lens[order], batch.query_lens[order], 4)
    plan = plan_and_check(planner, swapped, builds)
    assert plan.levels[0].rows.tolist() == [0, 2, 1, 3]
    assert builds.count == 0


# ---- churn: requests finish, arrive and change places ---------------------------------------


@dataclass
class Builds:
    """How many structures planners built from scratch (the fresh plans they are checked
    against, which always build, are not counted)."""

    count: int = 0
    counting: bool = True


def count_builds(monkeypatch) -> Builds:
    builds = Builds()
    real_build = planner_module._build

    def build(*args):
        builds.count += builds.counting
        return real_build(*args)

    monkeypatch.setattr(planner_module, "_build", build)
    return builds


def plan_and_check(planner: CascadePlanner, batch: Batch, builds: Builds | None = None,
                   **limits: int) -> CascadePlan:
    """Plan ``batch`` with ``planner``; it must be the fresh plan, and keep its contract."""
    plan = planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size)
    builds = builds or Builds()
    builds.counting = False
    assert_same_plan(plan, batch.plan(**limits))
    builds.counting = True
    assert plan_violations(plan, batch.block_table, batch.seq_lens, batch.query_lens) == []
    return plan


def with_rows(batch: Batch, table: np.ndarray, seq_lens: np.ndarray,
              query_lens: np.ndarray) -> Batch:
    return Batch(table, seq_lens.astype(np.int32), query_lens.astype(np.int32), batch.page_size)


@st.composite
def churn_steps(draw: st.DrawFn) -> list[Batch]:
    """A batch and what online serving does to it, step by step, as the planner sees it.

    Requests arrive (with a known prefix, part of one, or none; appended, inserted or put in a
    padding row's place), finish (their row removed, or the last row moved into its place as
    vLLM condenses the batch), change places, decode (a new page when the last one is full),
    get preempted (losing pages, then recomputing them), prefill chunks, and idle as padding.
    Freed block ids come back in other rows, and ids change under rows.
    """
    first = draw(batches())
    page = first.page_size
    width = first.block_table.shape[1] + 24
    steps = [replace(first, block_table=np.pad(first.block_table, ((0, 0), (0, 24))))]
    fresh = itertools.count(first.num_blocks + 100)
    freed: list[int] = []

    def new_id() -> int:
        if freed and draw(st.booleans()):
            return freed.pop(draw(st.integers(0, len(freed) - 1)))
        return next(fresh)

    actions = st.sampled_from(
        ["decode"] * 3 + ["arrive"] * 3 + ["finish"] * 2 + ["condense"] * 2
        + ["swap", "permute", "preempt", "reuse", "idle", "chunk", "widen"]
    )
    for action in draw(st.lists(actions, max_size=16)):
        batch = steps[-1]
        table, seq, qry = batch.block_table.copy(), batch.seq_lens.copy(), batch.query_lens.copy()
        rows = len(seq)
        r = draw(st.integers(0, rows - 1))
        if action == "decode":
            for row in np.flatnonzero(qry > 0):
                if seq[row] % page == 0:
                    if seq[row] // page >= width:
                        continue  # the row is as long as the table: it stays
                    table[row, seq[row] // page] = new_id()
                seq[row] += 1
            qry = (qry > 0).astype(np.int32)
        elif action == "arrive":
            known = row_pages(batch, r)
            ids = known[: draw(st.integers(0, len(known)))]
            ids = (ids + [new_id() for _ in range(draw(st.integers(1, 3)))])[:width]
            seq_len = (len(ids) - 1) * page + draw(st.integers(1, page))
            query = draw(st.sampled_from([1, seq_len, draw(st.integers(1, seq_len))]))
            row = np.full(width, draw(st.integers(0, 5)), np.int32)  # stale ids past its pages
            row[: len(ids)] = ids
            idle = np.flatnonzero(qry == 0)
            where = draw(st.sampled_from(["append", "insert", "idle"]))
            if where == "idle" and idle.size:  # it takes a padding row's place
                at = int(idle[draw(st.integers(0, idle.size - 1))])
                table[at], seq[at], qry[at] = row, seq_len, query
            else:
                at = rows if where == "append" else draw(st.integers(0, rows))
                table = np.insert(table, at, row, axis=0)
                seq, qry = np.insert(seq, at, seq_len), np.insert(qry, at, query)
        elif action in ("finish", "condense") and rows > 1:
            freed.extend(row_pages(batch, r))
            last = rows - 1
            if action == "condense" and r != last:  # vLLM moves the last row into the hole
                pages = len(row_pages(batch, last))
                table[r, :pages], seq[r], qry[r] = table[last, :pages], seq[last], qry[last]
                r = last
            table, seq, qry = np.delete(table, r, 0), np.delete(seq, r), np.delete(qry, r)
        elif action == "swap":
            other = draw(st.integers(0, rows - 1))
            order = np.arange(rows)
            order[[r, other]] = order[[other, r]]
            table, seq, qry = table[order], seq[order], qry[order]
        elif action == "permute":
            order = np.array(draw(st.permutations(range(rows))))
            table, seq, qry = table[order], seq[order], qry[order]
        elif action == "preempt" and seq[r] > 0:  # loses pages, then recomputes a part
            seq[r] = draw(st.integers(1, int(seq[r])))
            qry[r] = draw(st.integers(1, int(seq[r])))
            if draw(st.booleans()):  # its freed pages go back to the pool
                kept = -(-int(seq[r]) // page)
                freed.extend(table[r, kept:].tolist())
                table[r, kept:] = 0
        elif action == "reuse":  # an id (freed, the null block, or another row's) put elsewhere
            c = draw(st.integers(0, width - 1))
            table[r, c] = draw(st.sampled_from([new_id(), 0, *table.ravel()[:8].tolist()]))
        elif action == "idle":
            qry[r] = 0
        elif action == "chunk":
            qry[r] = draw(st.integers(min(1, int(seq[r])), int(seq[r])))
        elif action == "widen":  # a wider block table (with stale ids past the rows' pages)
            extra = draw(st.integers(1, 8))
            table = np.pad(table, ((0, 0), (0, extra)), constant_values=draw(st.integers(0, 5)))
            width += extra
        if draw(st.booleans()):  # the table as a strided view of a wider one, not contiguous
            table = np.pad(table, ((0, 0), (0, 1)))[:, :width]
        steps.append(with_rows(batch, table, seq, qry))
    return steps


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=churn_steps(), limits=limits)
def test_planner_under_churn_always_equals_a_fresh_plan(steps, limits):
    planner = CascadePlanner(**limits)
    for batch in steps:
        plan_and_check(planner, batch, **limits)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=churn_steps(), limits=limits)
def test_rows_sort_alike_when_their_keys_do_not_fit_one_integer(steps, limits):
    """Sorting by one key per level (for batches too large to pack every level's key into one
    int64) orders the rows as the packed key does."""
    expected = [batch.plan(**limits) for batch in steps]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trie_module.PrefixTrie, "sort_weights", lambda self, num_rows: None)
        planner = CascadePlanner(**limits)
        for batch, plan in zip(steps, expected, strict=True):
            assert_same_plan(plan, batch.plan(**limits))
            assert_same_plan(plan, planner.plan(batch.block_table, batch.seq_lens,
                                                batch.query_lens, batch.page_size))


class Serving:
    """Rows of ``groups`` prefixes of ``shared`` pages each, decoding, where requests come and go
    as in online serving; ids come from a pool, so freed ones come back."""

    def __init__(self, groups: int, rows: int, shared: int, page_size: int = 4, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.page = page_size
        self.pool = itertools.count(1)
        self.freed: list[int] = []
        self.prefixes = [self.take(shared) for _ in range(groups)]
        self.width = shared + 64
        self.table = np.zeros((0, self.width), np.int32)
        self.seq_lens = np.zeros(0, np.int64)
        self.query_lens = np.zeros(0, np.int64)
        for r in range(rows):
            self.arrive(r % groups, at=r)
        self.query_lens[:] = 1

    def take(self, count: int) -> list[int]:
        return [self.freed.pop() if self.freed else next(self.pool) for _ in range(count)]

    @property
    def batch(self) -> Batch:
        return Batch(self.table.copy(), self.seq_lens.copy(), self.query_lens.copy(), self.page)

    def arrive(self, group: int, at: int) -> None:
        """A request with prefix ``group`` (and a prompt of its own) takes row ``at``."""
        own = int(self.rng.integers(1, 3 * self.page))
        row = np.zeros(self.width, np.int32)
        ids = self.prefixes[group] + self.take(-(-own // self.page))
        row[: len(ids)] = ids
        seq_len = len(self.prefixes[group]) * self.page + own
        if at == len(self.seq_lens):
            self.table = np.vstack((self.table, row[None]))
            self.seq_lens = np.append(self.seq_lens, seq_len)
            self.query_lens = np.append(self.query_lens, own)
        else:
            self.table[at], self.seq_lens[at], self.query_lens[at] = row, seq_len, own

    def finish(self, row: int) -> None:
        shared = len(self.prefixes[0])
        self.freed += self.table[row, shared : -(-self.seq_lens[row] // self.page)].tolist()

    def decode(self) -> None:
        entering = np.flatnonzero(self.seq_lens % self.page == 0)
        self.table[entering, self.seq_lens[entering] // self.page] = self.take(entering.size)
        self.seq_lens += 1
        self.query_lens[:] = 1

    def replace(self, row: int, group: int) -> None:
        """Request ``row`` finishes; a new one takes its row."""
        self.decode()
        self.finish(row)
        self.arrive(group, at=row)

    def condense(self, row: int, group: int) -> None:
        """Request ``row`` finishes, the last row moves into its place, a new one is appended."""
        self.decode()
        self.finish(row)
        last = len(self.seq_lens) - 1
        for name in ("table", "seq_lens", "query_lens"):
            values = getattr(self, name)
            values[row] = values[last]
            setattr(self, name, values[:last])
        self.arrive(group, at=last)


def test_planner_keeps_groups_when_one_request_is_replaced(monkeypatch):
    serving = Serving(groups=4, rows=16, shared=6)
    planner = CascadePlanner()
    plan_and_check(planner, serving.batch)
    builds = count_builds(monkeypatch)
    serving.replace(row=5, group=2)  # row 5 was in group 1
    plan = plan_and_check(planner, serving.batch, builds)
    assert builds.count == 0
    assert plan.stats.group_sizes == (4, 3, 5, 4) and plan.stats.shared_pages == (6,) * 4


def test_planner_follows_the_batch_as_vllm_condenses_it(monkeypatch):
    serving = Serving(groups=4, rows=16, shared=6)
    planner = CascadePlanner()
    plan_and_check(planner, serving.batch)
    builds = count_builds(monkeypatch)
    serving.condense(row=2, group=0)  # the last row (group 3) moves to row 2
    plan = plan_and_check(planner, serving.batch, builds)
    assert builds.count == 0
    assert plan.levels[0].rows[: plan.stats.group_sizes[0]].tolist() == [0, 4, 8, 12, 15]


def test_planner_under_churn_plans_from_scratch_only_once(monkeypatch):
    """Requests finish and arrive every step, decoding in between: the trie stays, so after the
    first step the planner never sorts the rows again (the churn speedup relies on it)."""
    serving = Serving(groups=4, rows=32, shared=5, seed=1)
    planner = CascadePlanner()
    builds = count_builds(monkeypatch)
    for step in range(60):
        row, group = (int(x) for x in serving.rng.integers(0, (32, 4)))
        (serving.replace if step % 2 else serving.condense)(row, group)
        plan_and_check(planner, serving.batch, builds)
    assert builds.count == 1


def test_planner_takes_in_and_lets_go_requests_of_known_prefixes(monkeypatch):
    serving = Serving(groups=2, rows=6, shared=3)
    planner = CascadePlanner()
    plan_and_check(planner, serving.batch)
    builds = count_builds(monkeypatch)
    serving.arrive(1, at=6)  # a new request of group 1, appended
    assert plan_and_check(planner, serving.batch, builds).stats.group_sizes == (3, 4)
    batch = serving.batch
    gone = np.arange(7) != 0  # request 0 (group 0) finishes; vLLM removes its row
    batch = with_rows(batch, batch.block_table[gone], batch.seq_lens[gone], batch.query_lens[gone])
    assert plan_and_check(planner, batch, builds).stats.group_sizes == (4, 2)  # group 1 first
    assert builds.count == 0


def test_planner_plans_from_scratch_when_a_new_request_shares_part_of_a_prefix(monkeypatch):
    serving = Serving(groups=2, rows=6, shared=4)
    planner = CascadePlanner()
    plan_and_check(planner, serving.batch)
    builds = count_builds(monkeypatch)
    batch = serving.batch
    table = batch.block_table.copy()
    table[3, 2:6] = [901, 902, 903, 904]  # row 3 now shares only 2 of group 1's 4 pages
    plan = plan_and_check(planner, replace(batch, block_table=table), builds)
    assert builds.count == 1
    # Group 1 splits: rows 1, 3, 5 share 2 pages, rows 1 and 5 two more on the next level.
    assert plan.stats.group_sizes == (3, 3, 2) and plan.stats.shared_pages == (4, 2, 2)


def test_planner_plans_from_scratch_when_a_group_loses_its_last_partner(monkeypatch):
    serving = Serving(groups=2, rows=4, shared=4)
    planner = CascadePlanner()
    plan_and_check(planner, serving.batch)
    builds = count_builds(monkeypatch)
    batch = serving.batch
    query_lens = batch.query_lens.copy()
    query_lens[1] = 0  # rows 1 and 3 were group 1: row 3 has no partner left
    plan = plan_and_check(planner, replace(batch, query_lens=query_lens), builds)
    assert builds.count == 1 and plan.stats.group_sizes == (2,)


def test_planner_checks_every_id_of_a_moved_row_against_the_trie(monkeypatch):
    # Rows 1 and 3 (group 1) change places, and a block of row 3's prefix was freed and its id
    # reused for another block: its first id still says "group 1", its fourth does not.
    serving = Serving(groups=2, rows=4, shared=4)
    planner = CascadePlanner()
    plan_and_check(planner, serving.batch)
    builds = count_builds(monkeypatch)
    batch = serving.batch
    order = [0, 3, 2, 1]
    table = batch.block_table[order]
    table[1, 3] = 999
    moved = with_rows(batch, table, batch.seq_lens[order], batch.query_lens[order])
    plan = plan_and_check(planner, moved, builds)
    assert builds.count == 1 and plan.stats.shared_pages == (4, 3)


def test_planner_follows_a_preempted_request_that_recomputes_its_prompt(monkeypatch):
    serving = Serving(groups=2, rows=6, shared=4)
    planner = CascadePlanner()
    plan_and_check(planner, serving.batch)
    builds = count_builds(monkeypatch)
    batch = serving.batch
    seq_lens, query_lens = batch.seq_lens.copy(), batch.query_lens.copy()
    seq_lens[2] = 3 * batch.page_size + 1  # row 2 (group 0) lost pages and recomputes from page 1
    query_lens[2] = seq_lens[2] - batch.page_size
    preempted = with_rows(batch, batch.block_table, seq_lens, query_lens)
    plan = plan_and_check(planner, preempted, builds)
    assert builds.count == 1  # its one shared page splits group 0
    assert sorted(plan.stats.shared_pages) == [1, 3, 4]


def test_planner_widens_its_snapshot_for_a_row_that_grows_long(monkeypatch):
    # A wide block table, short rows: the planner copies only the leading columns it checks.
    batch = make_batch([[1, 2, 10], [1, 2, 11], [3, 12]], [9, 9, 5], [1, 1, 1], 4, width=200)
    planner = CascadePlanner()
    plan_and_check(planner, batch)
    builds = count_builds(monkeypatch)
    table = batch.block_table.copy()
    table[2, :46] = [3, *range(300, 345)]  # row 2 prefilled a long prompt of its own
    seq_lens = np.array([10, 10, 4 * 45 + 1])
    grown = with_rows(batch, table, seq_lens, np.ones(3))
    plan_and_check(planner, grown, builds)
    table = table.copy()
    table[2, 30] = 777  # an id past the first snapshot's columns changes: it is checked
    table[:2, 3] = [20, 21]
    plan_and_check(planner, with_rows(batch, table, seq_lens + 1, np.ones(3)), builds)
    assert builds.count == 0


def test_planner_plans_from_scratch_when_most_rows_moved(monkeypatch):
    serving = Serving(groups=4, rows=32, shared=5)
    planner = CascadePlanner()
    plan_and_check(planner, serving.batch)
    builds = count_builds(monkeypatch)
    batch = serving.batch
    order = serving.rng.permutation(32)  # looking every row up anew would cost more
    shuffled = with_rows(batch, batch.block_table[order], batch.seq_lens[order],
                         batch.query_lens[order])
    plan_and_check(planner, shuffled, builds)
    assert builds.count == 1
    swapped = order.copy()
    swapped[[3, 17]] = swapped[[17, 3]]  # two rows trade places, as vLLM reorders them
    plan_and_check(planner, with_rows(batch, batch.block_table[swapped],
                                      batch.seq_lens[swapped], batch.query_lens[swapped]), builds)
    assert builds.count == 1


def test_planner_plans_from_scratch_for_another_page_size_or_a_narrower_table(monkeypatch):
    serving = Serving(groups=2, rows=4, shared=3)
    planner = CascadePlanner()
    plan_and_check(planner, serving.batch)
    builds = count_builds(monkeypatch)
    batch = serving.batch
    plan_and_check(planner, replace(batch, page_size=2 * batch.page_size,
                                    seq_lens=batch.seq_lens * 2 - 1), builds)
    plan_and_check(planner, replace(batch, block_table=batch.block_table[:, :20]), builds)
    assert builds.count == 2


def test_planner_without_anything_to_share_copies_no_columns():
    planner = CascadePlanner()
    for rows in (2, 3, 1):
        batch = make_batch([[0]] * rows, [0] * rows, [0] * rows, 4)
        batch = replace(batch, block_table=batch.block_table[:, :0])
        assert plan_and_check(planner, batch).num_levels == 0


def test_a_trie_gives_the_same_level_pages_after_its_cache_fills():
    pages = [[g, 100 + g, 200 + r] for g in range(1, 7) for r in range(2)]
    batch = make_batch(pages, [10] * len(pages), [1] * len(pages), 4)
    trie, _, _ = trie_module.build_trie(batch.block_table, np.full(len(pages), 2), 3, 1)
    sequences = list(itertools.permutations(range(6)))[: 3 * trie_module.MAX_CACHED]
    for groups in [*sequences, *sequences]:
        indptr, ids, sizes = trie.level_pages(list(groups))
        assert sizes == (2,) * 6 and indptr.tolist() == list(range(0, 13, 2))
        assert ids.tolist() == [i for g in groups for i in (g + 1, g + 101)]


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
    """Run this interpreter in a subprocess that imports the package and the benchmarks
    (``-m benchmarks.<subject>.<module>``) from this checkout."""
    path = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO),
                                         os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    return done.stdout


def test_planner_bench_quick_writes_rows(tmp_path):
    run_python("-m", "benchmarks.host.planner", "--quick", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "planner.json").read_text())
    assert rows and all(
        set(row) == {"case", "requests", "pages", "steady_median_us", "steady_keyed_median_us",
                     "steady_keyed_speedup", "churn_median_us", "churn_keyed_median_us",
                     "churn_keyed_p99_us", "churn_keyed_speedup",
                     "cold_median_us", "precheck_median_us", "planner_skipped"}
        for row in rows
    )
    # The pre-check lets the hooks skip the planner on the batch without sharing, and only there.
    assert {row["case"]: row["planner_skipped"] for row in rows} == {
        "1x32K": False, "8 groups": False, "16 groups": False, "no sharing": True,
        "4x8K": False, "4x8K, 64 rows": False}
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
