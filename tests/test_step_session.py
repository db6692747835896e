"""One planning state per builder: what each builder registers, which settings a step is planned
with, and when a builder may run the step's plan (numpy only; the real builders are in
test_integration_cpu)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from test_integration_cpu import batch
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.planning.cost import AttentionShape, cost_model_for
from vllm_cascade_plugin.step import BuilderSettings, StepSession

CONFIG = CascadeConfig(enabled=True, policy="always")
SHAPE = AttentionShape(8, 2, 128, 2, num_layers=2)
FULL = BuilderSettings(CONFIG, SHAPE, 16, None, page_bytes=1000)
WINDOW = dataclasses.replace(FULL, unsupported="sliding-window attention", page_bytes=3000)


def planned(session: StepSession):
    table, seq, q = batch()
    step = session.plan_step(table, seq, q)
    assert step is not None and step.decision.use_cascade
    return step, step.query_start_loc, int(step.query_start_loc[-1]), seq


@pytest.fixture(autouse=True)
def counters():
    saved = stats.page_bytes()
    stats.reset()
    yield
    stats.set_page_bytes(saved)


@pytest.fixture
def plugin_log():
    """The plugin's log lines, caught at its own logger (vLLM's, its parent, keeps records from
    the root logger's handlers once vLLM is imported)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.cascade_plugin")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize("window_first", [False, True], ids=["full-first", "window-first"])
def test_steps_are_planned_for_the_first_builder_that_can_run_cascade(window_first):
    session = StepSession()
    order = [("w0", "w1"), ("f0", "f1")] if window_first else [("f0", "f1"), ("w0", "w1")]
    for names in order:
        session.register(names, WINDOW if names[0] == "w0" else FULL)
    assert session.active and session.disabled_reason is None
    assert (session.shape, session.page_size) == (SHAPE, 16)
    assert stats.page_bytes() == 1000  # the layers a cascade step serves, not the window's
    step, qsl, tokens, seq = planned(session)
    assert session.step_for(FULL, qsl, tokens, seq) is step
    assert session.step_for(WINDOW, qsl, tokens, seq) is None


def test_planning_time_is_counted_on_planned_steps_and_on_planner_errors(monkeypatch):
    session = StepSession()
    session.register(("f0",), FULL)
    planned(session)
    after_one = stats.snapshot().planning_s
    assert after_one > 0.0
    monkeypatch.setattr(session._planner, "plan", lambda *a: 1 / 0)
    assert session.plan_step(*batch()) is None  # the step runs flat, its time still counted
    assert stats.snapshot().planning_s > after_one
    assert stats.snapshot().fallbacks["planner error"] == 1


def test_with_no_builder_that_can_run_cascade_nothing_is_planned(plugin_log):
    """Each builder's flat layers are named once (Gemma 3 has a sliding-window KV-cache group,
    and so a builder, per few layers), also when vLLM makes the builders again."""
    session = StepSession()
    for _ in range(2):  # vLLM makes its builders again after profiling
        session.register(("w0",), WINDOW)
        session.register(("w1",), WINDOW)
    assert not session.active and session.disabled_reason == "sliding-window attention"
    assert [line for line in plugin_log if "sliding-window attention" in line] == [
        f"vllm-cascade-plugin: cascade attention is off for 1 attention layer(s) ({name}): "
        "sliding-window attention; they run vLLM's flat FLASHINFER attention."
        for name in ("w0", "w1")]
    assert session.plan_step(*batch()) is None


def test_a_builder_made_again_for_the_same_layers_replaces_the_old_one():
    """vLLM makes its builders again after profiling: the old builder's settings are gone,
    also when the new ones group the layers differently."""
    session = StepSession()
    session.register(("a", "b"), FULL)
    eager = dataclasses.replace(FULL, cost_model=cost_model_for("fa3", decode_graphs=False))
    session.register(("b",), eager)
    assert session.cost_model == eager.cost_model
    session.register(("a", "b"), WINDOW)
    assert not session.active


def test_a_builder_runs_a_plan_only_if_the_plan_was_made_for_its_page_size_and_shape(
        plugin_log):
    session = StepSession()
    session.register(("f0",), FULL)
    other_heads = dataclasses.replace(FULL, shape=dataclasses.replace(SHAPE, num_qo_heads=16))
    other_pages = dataclasses.replace(FULL, page_size=32)
    session.register(("g0",), other_heads)
    session.register(("h0",), other_pages)
    step, qsl, tokens, seq = planned(session)
    assert session.step_for(FULL, qsl, tokens, seq) is step
    assert session.step_for(other_heads, qsl, tokens, seq) is None
    assert session.step_for(other_pages, qsl, tokens, seq) is None
    session.step_for(other_pages, qsl, tokens, seq)
    # A standing configuration: logged once per kind of layer, not counted as a fallback.
    assert sum("steps are planned for other layers" in line for line in plugin_log) == 2
    assert not stats.snapshot().fallbacks


def test_a_plan_runs_only_on_the_sequence_lengths_it_was_made_for():
    session = StepSession()
    session.register(("f0",), FULL)
    step, qsl, tokens, seq = planned(session)
    assert np.array_equal(step.seq_lens, seq)
    for row in (0, len(seq) - 1):
        longer = seq.copy()
        longer[row] += 1
        assert session.step_for(FULL, qsl, tokens, longer) is None
    assert session.step_for(FULL, qsl, tokens, seq[:-1]) is None  # a row short
    assert stats.snapshot().fallbacks["plan does not match the batch"] == 3
    # vLLM's padded rows (no tokens, any length) do not matter; the planned rows still run.
    padded_qsl = np.concatenate([qsl, [tokens, tokens]]).astype(np.int32)
    padded_seq = np.concatenate([seq, [0, 7]]).astype(np.int32)
    assert session.step_for(FULL, padded_qsl, tokens, padded_seq) is step


def test_a_batch_without_host_sequence_lengths_runs_flat_and_is_counted():
    session = StepSession()
    session.register(("f0",), FULL)
    _step, qsl, tokens, _seq = planned(session)
    assert session.step_for(FULL, qsl, tokens, None) is None
    assert stats.snapshot().fallbacks["batch sequence lengths unknown"] == 1
