"""The plugin never costs a step its answer: every failure falls back to flat attention.

Faults are injected at each stage of a step (runner hooks, planner, cost model, FlashInfer
planning, the kernel call) through vLLM's real classes on CPU; unsupported model and engine
configurations are detected and reported once.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import numpy as np
import pytest
import torch

from test_integration_cpu import (  # noqa: F401  (engine is a fixture)
    DIM,
    HEADS,
    ReferenceExecutor,
    batch,
    common_metadata,
    dense_attention,
    engine,
    packed_cache,
)
from vllm_cascade_plugin import hooks, stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.cost import AttentionShape
from vllm_cascade_plugin.planner import CascadePlanner, plan_cascade, plan_violations
from vllm_cascade_plugin.step import StepSession


def fresh_session(**config) -> StepSession:
    session = StepSession()
    session.configure(CascadeConfig(enabled=True, policy="always", **config),
                      AttentionShape(8, 2, 128, 2), 16, None)
    return session


def fail(*args, **kwargs):
    raise RuntimeError("injected")


def test_planner_failure_runs_the_step_flat_and_the_next_step_recovers(monkeypatch, caplog):
    stats.reset()
    session = fresh_session()
    table, seq, q = batch()
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, "vllm.cascade_plugin"):
        patch.setattr(CascadePlanner, "plan", fail)
        assert session.plan_step(table, seq, q) is None
        assert session.plan_step(table, seq, q) is None
    assert stats.snapshot().fallbacks["planner error"] == 2
    assert sum("planner error" in r.getMessage() for r in caplog.records) == 1
    step = session.plan_step(table, seq, q)
    assert step is not None and step.decision.use_cascade


def test_cost_model_failure_runs_the_step_flat(monkeypatch):
    stats.reset()
    session = fresh_session()
    session.config = CascadeConfig(enabled=True, policy="auto")
    monkeypatch.setattr("vllm_cascade_plugin.step.decide", fail)
    assert session.plan_step(*batch()) is None
    assert stats.snapshot().fallbacks["planner error"] == 1


def shift_shared_pages(plan):
    levels = tuple(level if level.causal else dataclasses.replace(
        level, kv_page_indices=level.kv_page_indices + 1) for level in plan.levels)
    return dataclasses.replace(plan, levels=levels)


def test_debug_mode_catches_a_plan_that_breaks_its_invariants(monkeypatch):
    stats.reset()
    real = CascadePlanner.plan
    monkeypatch.setattr(CascadePlanner, "plan",
                        lambda self, *a: shift_shared_pages(real(self, *a)))
    assert fresh_session(debug=False).plan_step(*batch()) is not None  # unchecked: trusted
    assert fresh_session(debug=True).plan_step(*batch()) is None
    assert stats.snapshot().fallbacks["plan invariant violated"] == 1


def test_plan_violations_names_each_broken_rule():
    table, seq, q = batch()
    plan = plan_cascade(table, seq, q, 16)
    assert plan_violations(plan, table, seq, q) == []
    shared, own = plan.levels
    zero = dataclasses.replace(shared, kv_page_indices=np.zeros_like(shared.kv_page_indices))
    assert any("shares block 0" in p for p in
               plan_violations(dataclasses.replace(plan, levels=(zero, own)), table, seq, q))
    twice = dataclasses.replace(plan, levels=(shared, shared, own))
    assert any("not each read once" in p for p in plan_violations(twice, table, seq, q))
    empty = dataclasses.replace(shared, qo_indptr=np.zeros_like(shared.qo_indptr))
    assert any("empty segment" in p for p in
               plan_violations(dataclasses.replace(plan, levels=(empty, own)), table, seq, q))
    wrong_rows = dataclasses.replace(own, q_index=own.q_index[::-1].copy())
    assert any("queries are not its rows' tokens" in p for p in
               plan_violations(dataclasses.replace(plan, levels=(shared, wrong_rows)),
                               table, seq, q))


def test_flashinfer_planning_error_builds_plain_vllm_metadata(engine):  # noqa: F811
    _, builder, _ = engine
    stats.reset()
    executor = ReferenceExecutor()
    executor.plan = fail
    builder._cascade_executor = executor
    table, seq, q = batch()
    from vllm_cascade_plugin.step import session

    session.plan_step(table, seq, q)
    metadata = builder.build(0, common_metadata(table, seq, q))
    assert getattr(metadata, "cascade", None) is None
    assert stats.snapshot().fallbacks["kernel planning error"] == 1


def test_out_of_range_block_id_is_caught_before_any_kernel_runs(engine, monkeypatch):  # noqa: F811
    from vllm.v1.attention.backends.flashinfer import FlashInferImpl

    from vllm_cascade_plugin.step import session

    _, builder, layers = engine
    stats.reset()
    executor = ReferenceExecutor()
    runs = []
    executor.run = lambda *a: runs.append(a)
    builder._cascade_executor = executor
    table, seq, q = batch()
    table[table == 15] = 10_000  # a shared page beyond the 64-block cache
    session.plan_step(table, seq, q)
    metadata = builder.build(0, common_metadata(table, seq, q))
    assert metadata.cascade is executor and metadata.cascade_max_page == 10_000
    flat = []
    monkeypatch.setattr(FlashInferImpl, "forward", lambda self, *a, **k: flat.append(a))
    _, kv_cache = packed_cache(torch.Generator().manual_seed(3))
    query = torch.zeros(int(q.sum()), HEADS, DIM)
    layers[0].impl.forward(layers[0], query, None, None, kv_cache, metadata, query.clone())
    assert runs == [] and len(flat) == 1
    assert stats.snapshot().fallbacks["block id out of range"] == 1


def test_steps_after_a_kernel_failure_run_cascade_again(engine):  # noqa: F811
    from vllm_cascade_plugin.step import session

    _, builder, layers = engine
    stats.reset()
    table, seq, q = batch()
    g = torch.Generator().manual_seed(4)
    memory, kv_cache = packed_cache(g)
    query = torch.randn(int(q.sum()), HEADS, DIM, generator=g)
    for failing in (True, False):
        builder._cascade_executor = ReferenceExecutor(fail=failing)
        session.plan_step(table, seq, q)
        metadata = builder.build(0, common_metadata(table, seq, q))
        if failing:
            continue  # the parent's flat forward needs a GPU: covered in test_integration_cpu
        output = torch.empty_like(query)
        layers[0].impl.forward(layers[0], query, None, None, kv_cache, metadata, output)
        torch.testing.assert_close(output, dense_attention(query, memory, table, seq, q),
                                   atol=1e-5, rtol=1e-5)
    assert stats.snapshot().steps_cascade == 2


class BrokenRunner:
    """A runner whose state the hook cannot read (as if vLLM had changed under us)."""

    kv_cache_config = None


def test_v1_runner_hook_failure_keeps_vllms_own_graph_choice():
    stats.reset()
    calls = []
    wrapped = hooks._v1_determine_batch_execution(lambda self, *a: calls.append(a) or "vllm's")
    runner = BrokenRunner()
    hooks._pending = step = hooks._PendingStep(runner, None)
    try:
        assert wrapped(runner, 4, 2) == "vllm's"
    finally:
        hooks._pending = None
    assert calls == [(4, 2)] and step.cascade is False
    assert stats.snapshot().fallbacks["runner hook error"] == 1


def test_v2_dispatch_failure_keeps_vllms_own_graph_choice():
    stats.reset()

    class Runner:
        cudagraph_manager = object()
        block_tables = None  # planning reads it and fails

    calls = []
    wrapped = hooks._v2_dispatch(lambda self, *a: calls.append(a) or "vllm's choice")
    hooks._pending = hooks._PendingStep(Runner(), None)
    try:
        assert wrapped(Runner.cudagraph_manager, 4, 4, 1, 0) == "vllm's choice"
    finally:
        hooks._pending = None
    assert calls == [(4, 4, 1, 0)]
    assert stats.snapshot().fallbacks["runner hook error"] == 1


# ---------------------------------------------------------------- unsupported configurations

def impl(config, **kwargs):
    from vllm.config import set_current_vllm_config

    from vllm_cascade_plugin.backend import CascadeFlashInferImpl

    args = {"num_heads": 8, "head_size": 128, "scale": 0.1, "num_kv_heads": 2,
            "alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto", **kwargs}
    with set_current_vllm_config(config):
        return CascadeFlashInferImpl(**args)


def spec(dtype=torch.bfloat16):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=dtype)


def engine_with(config, path, value):
    changed = copy.deepcopy(config)
    owner = changed
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    object.__setattr__(owner, name, value)
    return changed


@pytest.mark.parametrize(("change", "reason"), [
    ({"kv_cache_dtype": "fp8"}, "quantised KV cache"),
    ({"sliding_window": 128}, "sliding-window attention"),
    ({"alibi_slopes": [0.5] * 8}, "ALiBi"),
])
def test_unsupported_layer_is_detected(engine, change, reason):  # noqa: F811
    from vllm_cascade_plugin.backend import unsupported_reason

    config = engine[0]
    assert unsupported_reason(config, spec(), [impl(config)]) is None
    assert unsupported_reason(config, spec(), [impl(config), impl(config, **change)]) == reason


@pytest.mark.parametrize(("path", "value", "reason"), [
    ("speculative_config", object(), "speculative decoding"),
    ("parallel_config.decode_context_parallel_size", 2, "decode context parallelism"),
    ("parallel_config.pipeline_parallel_size", 2, "pipeline parallelism"),
    ("model_config.is_encoder_decoder", True, "encoder-decoder model"),
])
def test_unsupported_engine_configuration_is_detected(engine, path, value, reason):  # noqa: F811
    from vllm_cascade_plugin.backend import unsupported_reason

    config = engine[0]
    changed = engine_with(config, path, value)
    assert unsupported_reason(changed, spec(), [impl(config)]) == reason


def test_fp8_kv_cache_spec_is_detected(engine):  # noqa: F811
    from vllm_cascade_plugin.backend import unsupported_reason

    config = engine[0]
    assert unsupported_reason(config, spec(torch.float8_e4m3fn), [impl(config)]).startswith(
        "quantised KV cache")


def test_unsupported_configuration_is_reported_once_at_info(caplog):
    stats.reset()
    with caplog.at_level(logging.INFO, "vllm.cascade_plugin"):
        for _ in range(3):  # one builder per KV cache group, and again after profiling
            StepSession().configure(CascadeConfig(enabled=True), AttentionShape(8, 2, 128, 2),
                                    16, "sliding-window attention")
    lines = [r for r in caplog.records if "sliding-window attention" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    session = StepSession()
    session.configure(CascadeConfig(enabled=True), AttentionShape(8, 2, 128, 2), 16, "ALiBi")
    assert session.plan_step(*batch()) is None and not session.active


def test_device_bytes_counts_the_executors_scratch_and_forgets_dead_executors():
    """The soak attributes memory growth with kernels.device_bytes(): it must add up exactly."""
    import gc

    import torch

    from vllm_cascade_plugin import kernels

    # Executors of earlier tests that only a reference cycle keeps (the graph tests' stand-in
    # replays hold the closure that refers back to their executor) go first, or they would leave
    # the baseline below mid-test.
    gc.collect()
    baseline = kernels.device_bytes()
    executor = kernels.FlashInferCascadeExecutor(torch.empty(1024, dtype=torch.uint8))
    executor._scratch.take("lse", (100, 8), torch.float32, torch.device("cpu"))
    executor._scratch.take("level_out", (100, 8, 64), torch.bfloat16, torch.device("cpu"))
    assert kernels.device_bytes() - baseline == 100 * 8 * 4 + 100 * 8 * 64 * 2
    # A smaller request reuses the buffer: nothing grows.
    executor._scratch.take("lse", (10, 8), torch.float32, torch.device("cpu"))
    assert kernels.device_bytes() - baseline == 100 * 8 * 4 + 100 * 8 * 64 * 2
    del executor
    gc.collect()
    assert kernels.device_bytes() == baseline
