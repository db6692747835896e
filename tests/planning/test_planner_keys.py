"""The planner told which rows changed (row keys) instead of comparing the block table.

Every keyed plan must be the fresh plan of the same step (``plan_cascade``, which knows nothing
of keys), and a key that breaks its promise must show in ``plan_violations``.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from test_planner import (
    Batch,
    assert_same_plan,
    batches,
    churn_steps,
    count_builds,
    interleaved_decode_batch,
    limits,
    make_batch,
    row_pages,
)
from vllm_cascade_plugin.planning import memory as memory_module
from vllm_cascade_plugin.planning.invariants import plan_violations
from vllm_cascade_plugin.planning.planner import CascadePlanner


def keys_of(steps: list[Batch], draw_new: list[bool]) -> list[np.ndarray]:
    """Row keys that keep their promise: a row keeps its key where the row at its place in the
    step before held the same ids in every page it had then (so in every column a plan of that
    step read); any other row gets a key never used. ``draw_new[i]``: give step i's rows new
    keys even where they could keep theirs (a caller may always say more rows changed)."""
    serial = itertools.count(1)
    keys = [np.fromiter(itertools.islice(serial, len(steps[0].seq_lens)), np.int64)]
    for before, step, fresh in zip(steps, steps[1:], draw_new[1:], strict=False):
        row_keys = np.empty(len(step.seq_lens), np.int64)
        for r in range(len(step.seq_lens)):
            held = r < len(before.seq_lens) and not fresh
            if held:
                pages = row_pages(before, r)
                held = step.block_table.shape[1] >= len(pages) and (
                    step.block_table[r, : len(pages)].tolist() == pages)
            row_keys[r] = keys[-1][r] if held else next(serial)
        keys.append(row_keys)
    return keys


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=churn_steps(), limits=limits, data=st.data())
def test_keyed_planner_under_churn_always_equals_a_fresh_plan(steps, limits, data):
    fresh = data.draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
    planner = CascadePlanner(**limits)
    for batch, keys in zip(steps, keys_of(steps, fresh), strict=True):
        plan = planner.plan(batch.block_table, batch.seq_lens, batch.query_lens,
                            batch.page_size, row_keys=keys)
        assert_same_plan(plan, batch.plan(**limits))
        assert plan_violations(plan, batch.block_table, batch.seq_lens, batch.query_lens) == []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=churn_steps(), limits=limits, data=st.data())
def test_planner_switching_between_keys_and_none_equals_a_fresh_plan(steps, limits, data):
    keyed = data.draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
    planner = CascadePlanner(**limits)
    keys = keys_of(steps, [False] * len(steps))
    for batch, row_keys, use in zip(steps, keys, keyed, strict=True):
        plan = planner.plan(batch.block_table, batch.seq_lens, batch.query_lens,
                            batch.page_size, row_keys=row_keys if use else None)
        assert_same_plan(plan, batch.plan(**limits))


def planned_with_keys(batch: Batch) -> tuple[CascadePlanner, np.ndarray]:
    """A planner that planned ``batch`` told its rows' keys (0, 1, ...), and those keys."""
    keys = np.arange(len(batch.seq_lens), dtype=np.int64)
    planner = CascadePlanner()
    planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size,
                 row_keys=keys)
    return planner, keys


def watch_place(monkeypatch) -> list[int]:
    """The rows the planner looks up in its prefix trie from now on."""
    from vllm_cascade_plugin.planning.trie import PrefixTrie

    placed: list[int] = []
    original = PrefixTrie.place
    monkeypatch.setattr(PrefixTrie, "place",
                        lambda self, table, row, *a: placed.append(row) or original(
                            self, table, row, *a))
    return placed


def reordered(batch: Batch, order: list[int]) -> Batch:
    """``batch`` with its rows in ``order`` (row i of the result is ``batch``'s row order[i])."""
    return Batch(batch.block_table[order], batch.seq_lens[order], batch.query_lens[order],
                 batch.page_size)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=churn_steps(), limits=limits, data=st.data())
def test_keyed_planner_with_rows_reordered_every_step_equals_a_fresh_plan(steps, limits, data):
    """Model Runner V2 orders its rows anew every step (a finished request moves the rows
    after it; prefill rows go behind decode rows): rows that move keep their keys, and every
    plan is still the fresh plan of its step."""
    keys = keys_of(steps, [False] * len(steps))
    planner = CascadePlanner(**limits)
    for batch, row_keys in zip(steps, keys, strict=True):
        order = data.draw(st.permutations(range(len(batch.seq_lens))))
        moved = reordered(batch, order)
        plan = planner.plan(moved.block_table, moved.seq_lens, moved.query_lens,
                            moved.page_size, row_keys=row_keys[order])
        assert_same_plan(plan, moved.plan(**limits))
        assert plan_violations(plan, moved.block_table, moved.seq_lens, moved.query_lens) == []


def test_rows_that_move_keep_their_place_in_the_trie_without_a_new_plan(monkeypatch):
    """A request that finishes moves every row after it one place up (V2's batch order): the
    planner follows them by their keys and builds no new trie, nor reads a row again."""
    builds = count_builds(monkeypatch)
    batch = interleaved_decode_batch(groups=3, per_group=5, shared=6)
    planner, keys = planned_with_keys(batch)
    placed = watch_place(monkeypatch)
    rest = [r for r in range(len(keys)) if r != 2]  # row 2's request finished
    step = reordered(batch, rest)
    plan = planner.plan(step.block_table, step.seq_lens, step.query_lens, step.page_size,
                        row_keys=keys[rest])
    builds.counting = False
    assert_same_plan(plan, step.plan())
    assert placed == [] and builds.count == 1


@pytest.mark.parametrize("moved_rows", [2, 10])
def test_repeated_keys_are_trusted_only_at_their_place(monkeypatch, moved_rows):
    """A key two rows share (a caller that drew none for them) holds ids by place only: a row
    that moved under it is read again, rows that moved under keys of their own are followed,
    and the plan is the fresh one. With a few moved rows each key is looked up alone, with
    many all at once: both ways alike."""
    batch = interleaved_decode_batch(groups=3, per_group=4, shared=5)
    keys = np.arange(1, len(batch.seq_lens) + 1, dtype=np.int64)
    keys[0] = keys[-1] = 99  # rows 0 and 11 share a key
    planner = CascadePlanner()
    planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size,
                 row_keys=keys)
    placed = watch_place(monkeypatch)
    # Row 0 moves behind the next ``moved_rows - 1`` rows; row 11 stays where it was.
    order = [*range(1, moved_rows), 0, *range(moved_rows, len(keys))]
    step = reordered(batch, order)
    plan = planner.plan(step.block_table, step.seq_lens, step.query_lens, step.page_size,
                        row_keys=keys[order])
    assert_same_plan(plan, step.plan())
    assert placed == [moved_rows - 1]


def test_steady_keyed_decode_reads_no_column_it_planned(monkeypatch):
    """With every key kept, a decode step never compares the table: only rows that grew a page
    are read (their new columns), and the structure is carried over. Every step after the first
    continues the last one (``continue_decode``): none is followed anew, and the runner hooks'
    pre-checks may be skipped (``continues``) while its rows share."""
    builds = count_builds(monkeypatch)
    batch = interleaved_decode_batch(groups=3, per_group=4, shared=6)
    planner, keys = planned_with_keys(batch)
    compared, followed = [], []
    monkeypatch.setattr(memory_module.PlanMemory, "_refresh",
                        lambda self, *a: compared.append(a) or np.empty(0, np.int64))
    original = memory_module.PlanMemory.follow
    monkeypatch.setattr(memory_module.PlanMemory, "follow",
                        lambda self, *a: followed.append(1) or original(self, *a))
    seq = batch.seq_lens.copy()
    table = batch.block_table.copy()
    fresh = itertools.count(int(table.max()) + 1)
    for _ in range(9):
        for r in range(len(seq)):
            if seq[r] % batch.page_size == 0:
                table[r, seq[r] // batch.page_size] = next(fresh)
        seq += 1
        assert planner.continues(seq, batch.query_lens, keys)
        step = Batch(table.copy(), seq.copy(), batch.query_lens, batch.page_size)
        plan = planner.plan(step.block_table, step.seq_lens, step.query_lens, step.page_size,
                            row_keys=keys)
        builds.counting = False
        assert_same_plan(plan, step.plan())
        builds.counting = True
        assert planner.last_path == "continued"
    assert compared == [] and followed == []
    assert builds.count == 1


def test_a_key_that_hides_a_changed_row_gives_a_plan_the_debug_check_rejects():
    """The promise is the caller's: a row given a new prefix under its old key is planned with
    the ids it had, and ``plan_violations`` (``CASCADE_DEBUG``) names the pages."""
    batch = interleaved_decode_batch(groups=2, per_group=3, shared=5)
    planner, keys = planned_with_keys(batch)
    table = batch.block_table.copy()
    table[0, :5] = table[1, :5]  # row 0 now holds the other group's prefix; its key stays
    plan = planner.plan(table, batch.seq_lens, batch.query_lens, batch.page_size,
                        row_keys=keys)
    assert plan_violations(plan, table, batch.seq_lens, batch.query_lens) != []
    fixed = keys.copy()
    fixed[0] = 100  # told that row 0 changed, the planner reads it again
    plan = planner.plan(table, batch.seq_lens, batch.query_lens, batch.page_size,
                        row_keys=fixed)
    assert plan_violations(plan, table, batch.seq_lens, batch.query_lens) == []
    assert_same_plan(plan, Batch(table, batch.seq_lens, batch.query_lens,
                                 batch.page_size).plan())


def test_row_keys_of_another_shape_are_refused():
    batch = interleaved_decode_batch(groups=2, per_group=2, shared=3)
    try:
        CascadePlanner().plan(batch.block_table, batch.seq_lens, batch.query_lens,
                              batch.page_size, row_keys=np.zeros(1, np.int64))
    except ValueError as exc:
        assert "row_keys" in str(exc)
    else:
        raise AssertionError("row_keys of the wrong shape were accepted")


def in_slots(batch: Batch, slots: list[int], width: int, rng: np.random.Generator,
             ) -> np.ndarray:
    """A table of more rows than ``batch`` (Model Runner V2's request slots, as wide as
    ``width`` pages at least): row ``r`` of the batch in row ``slots[r]``, every other cell a
    block id no row of the batch holds, which a plan that read it would show."""
    table = batch.block_table
    junk = int(table.max(initial=0)) + 1000
    out = rng.integers(junk, 2 * junk, size=(max(slots) + 3, max(width, table.shape[1])),
                       dtype=np.int32)
    out[slots, : table.shape[1]] = table
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=churn_steps(), limits=limits, data=st.data())
def test_planner_reading_rows_through_an_index_equals_a_fresh_plan(steps, limits, data):
    """Model Runner V2's rows live in request slots of the plugin's CPU mirror: the planner
    reads them there through ``row_index`` (rows moved to other slots every step, with keys
    or without) and plans exactly what a fresh plan of the rows gathered finds."""
    keys = keys_of(steps, [False] * len(steps))
    keyed = data.draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    planner = CascadePlanner(**limits)
    for batch, row_keys, use in zip(steps, keys, keyed, strict=True):
        rows = len(batch.seq_lens)
        slots = data.draw(st.lists(st.integers(0, 2 * rows + 2), min_size=rows, max_size=rows,
                                   unique=True))
        table = in_slots(batch, slots, batch.block_table.shape[1] + 3, rng)
        plan = planner.plan(table, batch.seq_lens, batch.query_lens, batch.page_size,
                            row_keys=row_keys if use else None, row_index=np.array(slots))
        assert_same_plan(plan, batch.plan(**limits))
        assert plan_violations(plan, batch.block_table, batch.seq_lens, batch.query_lens) == []


def test_a_row_index_of_another_shape_or_past_the_table_is_refused():
    batch = interleaved_decode_batch(groups=2, per_group=2, shared=3)
    rows = len(batch.seq_lens)
    for index in (np.zeros(1, np.int64), np.arange(rows) + len(batch.block_table),
                  np.arange(rows) - 1):
        with pytest.raises(ValueError, match="row_index"):
            CascadePlanner().plan(batch.block_table, batch.seq_lens, batch.query_lens,
                                  batch.page_size, row_index=index)


# ---- steady decode continued from the last step ---------------------------------------------


@st.composite
def steady_decode_steps(draw: st.DrawFn) -> list[Batch]:
    """A batch of decode rows (every row one query token), then steps in which every row grows
    by one token; a row entering a new page gets a fresh block there, or the null block (a
    sliding-window layer's page dropped)."""
    drawn = draw(batches())
    live = drawn.seq_lens > 0  # rows with a token (the others would be padding)
    assume(np.count_nonzero(live))
    first = Batch(np.pad(drawn.block_table[live], ((0, 0), (0, 24))), drawn.seq_lens[live],
                  np.ones(int(np.count_nonzero(live)), np.int32), drawn.page_size)
    steps = [first]
    fresh = itertools.count(first.num_blocks + 100)
    for _ in range(draw(st.integers(1, 12))):
        batch = steps[-1]
        table, seq = batch.block_table.copy(), batch.seq_lens.copy()
        for r in range(len(seq)):
            if seq[r] % batch.page_size == 0:
                if seq[r] // batch.page_size >= table.shape[1]:
                    return steps  # a row as long as the table: the sequence ends
                table[r, seq[r] // batch.page_size] = draw(st.sampled_from([next(fresh), 0]))
        steps.append(replace(batch, block_table=table, seq_lens=seq + 1))
    return steps


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=steady_decode_steps(), limits=limits, index=st.booleans())
def test_steady_decode_continued_from_the_last_step_equals_a_fresh_plan(steps, limits, index):
    """Keyed steps that continue the last one are planned from it (``continue_decode``); each
    plan is the fresh plan of its step, rows read directly or through a row index."""
    planner = CascadePlanner(**limits)
    keys = np.arange(len(steps[0].seq_lens), dtype=np.int64) + 7
    for batch in steps:
        table, row_index = batch.block_table, None
        if index:  # the rows in slots of a larger table, as Model Runner V2 keeps them
            row_index = np.arange(len(batch.seq_lens), dtype=np.int64)[::-1] * 2
            table = np.zeros((2 * len(batch.seq_lens), batch.block_table.shape[1]), np.int32)
            table[row_index] = batch.block_table
        plan = planner.plan(table, batch.seq_lens, batch.query_lens, batch.page_size,
                            row_keys=keys, row_index=row_index)
        assert_same_plan(plan, batch.plan(**limits))
        assert plan_violations(plan, batch.block_table, batch.seq_lens, batch.query_lens) == []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=steady_decode_steps(), limits=limits, data=st.data())
def test_steps_advanced_without_a_plan_then_planned_equal_a_fresh_plan(steps, limits, data):
    """Steps carried over without a plan (``advance``: the session's continued steps the cost
    model keeps flat) in between, a page started in one of them or not, leave each plan made
    afterwards the fresh plan of its step."""
    planner = CascadePlanner(**limits)
    keys = np.arange(len(steps[0].seq_lens), dtype=np.int64) + 7
    first = steps[0]
    planner.plan(first.block_table, first.seq_lens, first.query_lens, first.page_size,
                 row_keys=keys)
    for batch in steps[1:]:
        args = (batch.block_table, batch.seq_lens, batch.query_lens, batch.page_size)
        if data.draw(st.booleans()) and planner.advance(*args, row_keys=keys):
            continue
        assert_same_plan(planner.plan(*args, row_keys=keys), batch.plan(**limits))


def test_a_step_that_does_not_continue_the_last_one_is_planned_anew():
    batch = interleaved_decode_batch(groups=2, per_group=3, shared=4)
    planner, keys = planned_with_keys(batch)
    seq, query = batch.seq_lens + 1, batch.query_lens
    assert planner.continues(seq, query, keys)
    other_keys = keys.copy()
    other_keys[2] = 99  # a new request in row 2
    two_tokens = query.copy()
    two_tokens[0] = 2  # a verification step, or a chunk
    assert not planner.continues(seq, query, other_keys)
    assert not planner.continues(seq + 1, query, keys)  # a step was missed
    assert not planner.continues(seq + two_tokens - 1, two_tokens, keys)
    assert not planner.continues(seq, query, None)
    assert not planner.continues(seq, query, keys, np.arange(len(seq)))  # now through an index
    assert not planner.continues(seq[:-1], query[:-1], keys[:-1])  # a row finished
    # Without a shared level there is nothing to continue: the pre-checks decide.
    lone = make_batch([[1, 2], [3, 4]], [6, 7], [1, 1], 4, width=8)
    planner, keys = planned_with_keys(lone)
    assert not planner.continues(lone.seq_lens + 1, lone.query_lens, keys)


def test_arrays_a_caller_updates_in_place_are_not_trusted_as_the_last_steps():
    """vLLM keeps its arrays and writes each step into them: a planner that kept the caller's
    query lengths or row index (not copies) would compare them with themselves. Here the
    caller's int64 arrays are planned, then changed in place: two query tokens in a row, other
    slots for the rows; each step's plan is still the fresh plan."""
    batch = interleaved_decode_batch(groups=2, per_group=3, shared=4)
    n = len(batch.seq_lens)
    seq = batch.seq_lens.astype(np.int64)
    query = np.ones(n, np.int64)
    index = np.arange(n, dtype=np.int64)
    table = np.zeros((2 * n, batch.block_table.shape[1]), np.int32)
    table[:n] = batch.block_table
    table[n:] = batch.block_table
    keys = np.arange(n, dtype=np.int64)
    planner = CascadePlanner()
    planner.plan(table, seq, query, batch.page_size, row_keys=keys, row_index=index)
    seq += 1
    query[0] = 2  # in place: the same array object, now a two-token row
    assert not planner.continues(seq, query, keys, index)
    plan = planner.plan(table, seq, query, batch.page_size, row_keys=keys, row_index=index)
    assert_same_plan(plan, Batch(batch.block_table, seq.astype(np.int32),
                                 query.astype(np.int32), batch.page_size).plan())
    query[0] = 1
    plan = planner.plan(table, seq + 1, query, batch.page_size, row_keys=keys, row_index=index)
    seq += 1
    index += n  # in place: the rows now read from the table's other copy
    assert not planner.continues(seq + 1, query, keys, index)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=churn_steps(), limits=limits, data=st.data())
def test_the_planners_last_path_names_what_it_did(steps, limits, data):
    """``last_path`` (what the step's counters report per path) against the planner's own
    calls: "from scratch" exactly when it built a trie, "continued" when the last step's
    structure was carried over without looking a row up, "followed" otherwise."""
    fresh = data.draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
    planner = CascadePlanner(**limits)
    seen: set[str] = set()
    with pytest.MonkeyPatch.context() as mp:
        builds = count_builds(mp)
        follows = []
        real_follow = memory_module.PlanMemory.follow
        mp.setattr(memory_module.PlanMemory, "follow",
                   lambda self, *a: follows.append(1) or real_follow(self, *a))
        for batch, keys in zip(steps, keys_of(steps, fresh), strict=True):
            # After a decode step, the same rows one token longer: a step that may continue it.
            steady = [replace(batch, seq_lens=batch.seq_lens + 1)] * bool(
                np.all(batch.query_lens == 1))
            for step in (batch, *steady):
                builds.count, follows[:] = 0, []
                planner.plan(step.block_table, step.seq_lens, step.query_lens, step.page_size,
                             row_keys=keys)
                expected = ("from scratch" if builds.count else
                            "followed" if follows else "continued")
                assert planner.last_path == expected
                seen.add(expected)
    assert "from scratch" in seen  # the first step at least
