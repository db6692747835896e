"""Steady decode that the cost model keeps flat: the runner hooks' verdict on each step that
continues the last one (every row one token longer, the same keys), where the session keeps the
last step's flat verdict without planning (``StepSession.continued_flat``), against a fresh plan
of the same rows and ``decide()`` (the reference) on every step, up to and past the step where
cascade starts to win."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_cascade_plugin import stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.integration import hooks_dispatch
from vllm_cascade_plugin.planning.cost import (
    AttentionShape,
    cost_model_for,
    decide,
    flash_attn_flat,
)
from vllm_cascade_plugin.planning.planner import CascadePlanner, plan_cascade
from vllm_cascade_plugin.step import session

PAGE = 16
LLAMA3_8B = AttentionShape(num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                           num_layers=32)
EAGER = flash_attn_flat(cost_model_for("fa3", decode_graphs=False))
GRAPHED = flash_attn_flat(cost_model_for("fa3"))
STEPS = 400


class SteadyDecode:
    """``rows`` requests behind one prefix of ``shared`` pages, each with 20 to 69 pages of its
    own; every step each row gains a token, and a new page (a fresh block id) where it starts
    one. Keys: one per request, the same every step."""

    def __init__(self, rows: int, shared: int) -> None:
        own = 20 + (37 * np.arange(rows)) % 50
        self.seq = ((shared + own) * PAGE - 5).astype(np.int32)
        self.table = np.zeros((rows, shared + own.max() + 64), np.int32)
        self.table[:, :shared] = np.arange(1, shared + 1)
        self.next_id = 10_000
        for row in range(rows):
            self._fill(row, shared, shared + own[row])
        self.query = np.ones(rows, np.int32)
        self.keys = np.arange(1, rows + 1, dtype=np.int64)
        self.new_page = False  # whether a row of the current step started a page

    def _fill(self, row: int, start: int, end: int) -> None:
        self.table[row, start:end] = np.arange(self.next_id, self.next_id + end - start)
        self.next_id += end - start

    def step(self) -> None:
        self.seq += 1
        started = ((self.seq - 1) % PAGE == 0).nonzero()[0]
        self.new_page = bool(started.size)
        for row in started:
            page = (int(self.seq[row]) - 1) // PAGE
            self._fill(int(row), page, page + 1)

    def hooks_verdict(self) -> bool:
        """What the runner hooks decide for the current step (then the step ends)."""
        table = self.table
        cascade = hooks_dispatch.plan_rows(table[:, 0], table,
                                           np.full(len(self.seq), table.shape[1]),
                                           self.seq, self.query, lambda: self.keys)
        session.end_step()
        return cascade

    def reference(self, model) -> bool:
        """``decide()`` on a fresh plan of the current step's rows."""
        plan = plan_cascade(self.table, self.seq, self.query, PAGE)
        return decide(plan, LLAMA3_8B, model).use_cascade


def near_the_turn(model, rows: int = 24, steps: int = STEPS) -> int:
    """Shared pages behind which the reference keeps the first step flat and runs the last of
    ``steps`` as cascade (the flat verdict must be dropped on the way): the most that keep the
    first step flat (more sharing only helps cascade)."""
    shared = 16
    while not SteadyDecode(rows, shared + 1).reference(model):
        shared += 1
    last = SteadyDecode(rows, shared)
    for _ in range(steps):
        last.step()
    assert last.reference(model), "the verdict does not turn within the steps"
    return shared


@pytest.fixture(autouse=True)
def counters():
    stats.reset()
    yield
    stats.reset()


@pytest.fixture
def planner_calls(monkeypatch):
    """How many steps the planner planned (``CascadePlanner.plan`` calls)."""
    calls = []
    plan = CascadePlanner.plan

    def counted(self, *args, **kwargs):
        calls.append(1)
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(CascadePlanner, "plan", counted)
    return calls


def test_each_continued_step_gets_the_verdict_of_a_fresh_plan(planner_calls):
    """Without graphs every step is charged the eager cost: the hooks' verdict is the
    reference's on every step, flat while it is flat (the planner not asked), then cascade."""
    session.configure(CascadeConfig(enabled=True), LLAMA3_8B, PAGE, None, cost_model=EAGER)
    rows = SteadyDecode(24, near_the_turn(EAGER))
    verdicts, expected, asked, new_page = [], [], [], []
    for _ in range(STEPS):
        before = len(planner_calls)
        verdicts.append(rows.hooks_verdict())
        asked.append(len(planner_calls) > before)
        expected.append(rows.reference(EAGER))
        new_page.append(rows.new_page)
        rows.step()
    assert verdicts == expected
    flat = expected.index(True)
    assert flat > 2 and all(expected[flat:])
    # Planned: the first step, every cascade step, and, this near the turn, a flat step where
    # the rows' new pages outgrow the cascade estimate of the last plan (it is kept then).
    assert asked[0] and all(asked[flat:])
    assert all(new_page[i] for i in range(1, flat) if asked[i])
    assert sum(asked[1:flat]) < flat // 4
    counted = stats.snapshot()
    # every step but the first continued the last: kept flat without a plan, or planned
    assert (counted.planning_paths["continued"] + counted.planning_paths["continued, kept flat"]
            == len(expected) - 1)
    assert counted.planning_paths["continued, kept flat"] == flat - sum(asked[:flat])
    assert counted.decode_flat_reasons["cost model"] == flat  # the others: no builder here


def test_with_graphs_a_step_the_graphed_cost_would_run_is_always_planned(planner_calls):
    """With vLLM's capture sizes a decode step is first charged the graphed cost: a step kept
    flat by it keeps its verdict; one it would run as cascade is planned (and run from its
    layout's second step), never kept flat on the last step's word."""
    session.configure(CascadeConfig(enabled=True), LLAMA3_8B, PAGE, None, cost_model=EAGER,
                      steady_cost_model=GRAPHED, capture_sizes=(8, 16, 32, 64))
    session.capture_cost_us = 0.0  # captures free: a winning layout's second step is steady
    rows = SteadyDecode(24, near_the_turn(GRAPHED))
    verdicts, graphed, new_page = [], [], []
    for _ in range(STEPS):
        before = len(planner_calls)
        verdicts.append((rows.hooks_verdict(), len(planner_calls) > before))
        graphed.append(rows.reference(GRAPHED))
        new_page.append(rows.new_page)
        rows.step()
    turn = graphed.index(True)
    assert turn > 2 and all(graphed[turn:])
    assert not any(cascade for cascade, _ in verdicts[:turn])
    # kept flat without a plan, but where new pages outgrew the last plan's estimate
    assert all(new_page[i] for i in range(1, turn) if verdicts[i][1])
    assert sum(asked for _, asked in verdicts[1:turn]) < turn // 4
    assert all(asked for _, asked in verdicts[turn:])
    assert all(cascade for cascade, _ in verdicts[turn + 1:])  # the layout's graphs replay


def test_far_from_the_turn_new_pages_keep_the_verdict(planner_calls):
    """Where cascade is far from winning, steps whose rows start new pages keep the verdict."""
    session.configure(CascadeConfig(enabled=True), LLAMA3_8B, PAGE, None, cost_model=EAGER)
    rows = SteadyDecode(24, near_the_turn(EAGER) * 3 // 4)
    for _ in range(3 * PAGE):
        assert not rows.hooks_verdict() and not rows.reference(EAGER)
        rows.step()
    assert len(planner_calls) == 1  # the first step: from scratch
    assert stats.snapshot().planning_paths["continued, kept flat"] == 3 * PAGE - 1


def test_a_changed_row_is_planned_again(planner_calls):
    """A row whose key changes (a request rewritten) ends the continuation: planned."""
    session.configure(CascadeConfig(enabled=True), LLAMA3_8B, PAGE, None, cost_model=EAGER)
    shared = near_the_turn(EAGER) * 3 // 4
    rows = SteadyDecode(24, shared)
    for _ in range(3):
        assert not rows.hooks_verdict()
        rows.step()
    asked = len(planner_calls)
    rows.keys = rows.keys.copy()
    rows.keys[3] = 1_000
    rows.table[3, shared:] += 50_000 * (rows.table[3, shared:] > 0)
    assert not rows.hooks_verdict()
    assert len(planner_calls) == asked + 1
