"""Both runners' hooks honour a held flat verdict (``PreChecks.held_flat``) before they read a
step's rows: vLLM 0.26 serves some models (gpt-oss among them) on the V1 runner, where every
decode step was pre-checked from its rows before."""

from __future__ import annotations

import numpy as np
import pytest

from test_cost import H200_LAYER
from test_hooks import v1_runner
from test_step_reasons import EAGER, GRAPHED, chat_rows
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.integration import hooks_dispatch
from vllm_cascade_plugin.integration.hooks_step import PendingStep
from vllm_cascade_plugin.planning.cost import decide
from vllm_cascade_plugin.planning.planner import plan_cascade
from vllm_cascade_plugin.stats import counters as c
from vllm_cascade_plugin.step import session


@pytest.fixture
def fa3_global_session():
    """The hooks' session, set up as the FA3 executor with per-layer graphs sets it up."""
    saved = dict(vars(session))
    session.configure(CascadeConfig(enabled=True), H200_LAYER, 16, None, cost_model=EAGER,
                      steady_cost_model=GRAPHED, capture_sizes=(32, 64, 128))
    session.capture_cost_us = 0.0
    stats.reset()
    yield session
    stats.reset()
    vars(session).update(saved)


def test_v1_decode_steps_under_a_held_flat_verdict_are_counted_without_their_rows(
        fa3_global_session):
    rows = 24
    table, seq = chat_rows(rows, prefix_pages=4)  # 64 shared tokens: flat wins
    q = np.ones(rows, np.int32)
    assert not decide(plan_cascade(table, seq, q, 16), H200_LAYER, GRAPHED).use_cascade
    runner, so = v1_runner(table, seq, q)
    assert hooks_dispatch.v1_plan(PendingStep(runner, so)) is False  # kept flat: the verdict
    session.end_step()
    runner.input_batch.block_table = None  # read it and the hook raises
    runner.input_batch.num_computed_tokens_cpu = None
    for _ in range(2):
        assert hooks_dispatch.v1_plan(PendingStep(runner, so)) is False
        session.end_step()
    counted = stats.snapshot()
    assert counted.planning_paths[c.PATH_HELD] == 2
    assert counted.decode_steps_planned == 3 and counted.steps_cascade == 0
    # A mixed step is read and planned (the hold stays for the decode steps after it).
    mixed = dict(so.num_scheduled_tokens, new=170)
    with pytest.raises(TypeError):
        hooks_dispatch.v1_plan(PendingStep(runner, type(so)(num_scheduled_tokens=mixed)))
