"""The plugin never costs a step its answer: every failure falls back to flat attention.

Faults are injected at each stage of a step (runner hooks, planner, cost model, FlashInfer
planning, the kernel call) through vLLM's real classes on CPU; unsupported model and engine
configurations are detected and reported once.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from types import SimpleNamespace

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
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.integration import hooks, hooks_dispatch, hooks_graphs, hooks_step, support
from vllm_cascade_plugin.planning.cost import AttentionShape
from vllm_cascade_plugin.planning.invariants import plan_violations
from vllm_cascade_plugin.planning.planner import CascadePlanner, plan_cascade
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


@pytest.mark.flashinfer
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


@pytest.mark.flashinfer
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


@pytest.mark.flashinfer
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
    wrapped = hooks_dispatch.v1_determine_batch_execution(
        lambda self, *a: calls.append(a) or "vllm's")
    runner = BrokenRunner()
    hooks_step.pending = step = hooks_step.PendingStep(runner, None)
    try:
        assert wrapped(runner, 4, 2) == "vllm's"
    finally:
        hooks_step.pending = None
    assert calls == [(4, 2)] and step.cascade is False
    assert stats.snapshot().fallbacks["runner hook error"] == 1


def test_v2_dispatch_failure_keeps_vllms_own_graph_choice():
    stats.reset()

    class Runner:
        cudagraph_manager = object()
        block_tables = None  # planning reads it and fails

    calls = []
    wrapped = hooks_dispatch.v2_dispatch(lambda self, *a: calls.append(a) or "vllm's choice")
    hooks_step.pending = hooks_step.PendingStep(Runner(), None)
    try:
        assert wrapped(Runner.cudagraph_manager, 4, 4, 1, 0) == "vllm's choice"
    finally:
        hooks_step.pending = None
    assert calls == [(4, 4, 1, 0)]
    assert stats.snapshot().fallbacks["runner hook error"] == 1


# ---------------------------------------------------------------- unsupported configurations

def impl(config, **kwargs):
    from vllm.config import set_current_vllm_config

    from vllm_cascade_plugin.integration.flashinfer_backend import CascadeFlashInferImpl

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
    ({"kv_cache_dtype": "fp8"}, support.kv_cache_dtype_reason("fp8")),
    ({"sliding_window": 128}, "sliding-window attention"),
    ({"alibi_slopes": [0.5] * 8}, "ALiBi"),
])
@pytest.mark.flashinfer
def test_unsupported_layer_is_detected(engine, change, reason, monkeypatch):  # noqa: F811
    from vllm_cascade_plugin.integration.flashinfer_backend import unsupported_reason

    monkeypatch.setenv("CASCADE_FP8_KV", "0")  # an FP8 layer runs cascade by default
    config = engine[0]
    assert unsupported_reason(config, spec(), [impl(config)]) is None
    assert unsupported_reason(config, spec(), [impl(config), impl(config, **change)]) == reason


@pytest.mark.flashinfer
def test_attention_sinks_run_flat_unless_unverified_paths_are_on(engine, monkeypatch):  # noqa: F811
    """A layer with sinks (gpt-oss) keeps its builder flat, saying how to turn it on; with
    ``CASCADE_UNVERIFIED=1`` it is served (the sink applied to the merged output)."""
    from vllm_cascade_plugin.integration.flashinfer_backend import unsupported_reason

    config = engine[0]
    with_sinks = impl(config)
    with_sinks.sinks = torch.zeros(8)
    reason = unsupported_reason(config, spec(), [impl(config), with_sinks])
    assert reason is not None and reason.startswith("attention sinks"), reason
    assert "CASCADE_UNVERIFIED=1" in reason
    monkeypatch.setenv("CASCADE_UNVERIFIED", "1")
    assert unsupported_reason(config, spec(), [impl(config), with_sinks]) is None


@pytest.mark.parametrize(("path", "value", "reason"), [
    ("speculative_config", SimpleNamespace(method="eagle"),
     support.speculative_reason("eagle", False)),
    ("cache_config.enable_prefix_caching", False, support.PREFIX_CACHING_OFF),
    ("parallel_config.decode_context_parallel_size", 2, "decode context parallelism"),
    ("parallel_config.pipeline_parallel_size", 2, "pipeline parallelism"),
    ("model_config.is_encoder_decoder", True, "encoder-decoder model"),
])
@pytest.mark.flashinfer
def test_unsupported_engine_configuration_is_detected(engine, path, value, reason):  # noqa: F811
    from vllm_cascade_plugin.integration.flashinfer_backend import unsupported_reason

    config = engine[0]
    changed = engine_with(config, path, value)
    assert unsupported_reason(changed, spec(), [impl(config)]) == reason


@pytest.mark.flashinfer
def test_fp8_kv_cache_spec_is_detected(engine):  # noqa: F811
    from vllm_cascade_plugin.integration.flashinfer_backend import unsupported_reason

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


@pytest.mark.flashinfer
def test_device_bytes_counts_the_executors_scratch_and_forgets_dead_executors():
    """The soak attributes memory growth with kernels.device_bytes(): it must add up exactly."""
    import gc

    import torch

    from vllm_cascade_plugin.execution import kernels

    # Executors of earlier tests that only a reference cycle keeps (the graph tests' stand-in
    # replays hold the closure that refers back to their executor) go first, or they would leave
    # the baseline below mid-test.
    gc.collect()
    baseline = kernels.device_bytes()
    executor = kernels.FlashInferCascadeExecutor(torch.empty(1024, dtype=torch.uint8))
    executor._scratch.take("lse", (100, 8), torch.float32, torch.device("cpu"))
    executor._scratch.take("level_out", (100, 8, 64), torch.bfloat16, torch.device("cpu"))
    # Buffers are allocated in powers of two of elements: 800 -> 1024, 51,200 -> 65,536.
    assert kernels.device_bytes() - baseline == 1024 * 4 + 65536 * 2
    # A smaller request reuses the buffer: nothing grows.
    executor._scratch.take("lse", (10, 8), torch.float32, torch.device("cpu"))
    assert kernels.device_bytes() - baseline == 1024 * 4 + 65536 * 2
    del executor
    gc.collect()
    assert kernels.device_bytes() == baseline


# ------------------------------------------------------------ the runner hooks never raise

# Every wrapper in hooks_*.py runs vLLM's method exactly once and returns its result, whatever its
# own code does; only vLLM's own exception comes out of it, as it was, and never after a retry.

def vllm_method(module_tail, cls, name):
    """The patched vLLM method itself (its signature is the installed release's)."""
    for owner, method, _ in hooks.patch_targets():
        if (owner.__module__.rsplit(".", 1)[1], owner.__name__, method) == (
                module_tail, cls, name):
            fn = getattr(owner, method)
            return getattr(fn, hooks._PATCHED, fn)
    raise LookupError(name)


class VllmMethod:
    """Stands in for a patched vLLM method, with its real signature: records each call's
    arguments, then returns ``result`` or raises ``error``."""

    def __init__(self, like, error=None):
        self.__signature__ = inspect.signature(like)
        self.calls, self.error = [], error
        self.result = SimpleNamespace(what="vLLM's result")

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.error is not None:
            raise self.error
        return self.result


class Graphs:
    """Whole-step graphs that run the step eagerly; their own code fails ``when`` ("before" or
    "after" the step ran), or never."""

    def __init__(self, when=None):
        self.when = when

    def run(self, forward, ctx, inputs, parallel_sizes, tag):
        if self.when == "before":
            raise RuntimeError("injected before the step")
        out = forward()
        if self.when == "after":
            raise RuntimeError("injected after the step")
        return out


class Lines(logging.Handler):
    """The plugin's log lines, caught at its own logger (vLLM's logger, its parent, keeps its
    records from the root logger's handlers once vLLM is imported)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelno, record.getMessage()))


@pytest.fixture
def plugin_log():
    handler, logger = Lines(), logging.getLogger("vllm.cascade_plugin")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def planning(monkeypatch):
    """An active session; no step pending before or after the test."""
    from vllm_cascade_plugin.step import session

    saved = dict(vars(session))
    session.configure(CascadeConfig(enabled=True, policy="always"), AttentionShape(8, 2, 128, 2),
                      16, None)
    stats.reset()
    yield session
    hooks_step.pending = None
    vars(session).update(saved)


def runner():
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                               data_parallel_size=1)
    return SimpleNamespace(cudagraph_dispatcher=object(), cudagraph_manager=object(),
                           vllm_config=SimpleNamespace(parallel_config=parallel))


def pending(owner, cascade):
    """A real step in flight, planned: cascade or not."""
    from vllm_cascade_plugin.step import session

    step = hooks_step.PendingStep(owner, SimpleNamespace(num_scheduled_tokens={}))
    hooks_step.pending = step
    step.cascade = cascade
    session.current = SimpleNamespace(decision=SimpleNamespace(use_cascade=cascade),
                                      decode=True) if cascade is not None else None
    return step


def graphed(monkeypatch, graphs):
    """Whole-step graphs for the runner and a forward context to run them in."""
    import vllm.forward_context

    monkeypatch.setattr(hooks_graphs, "full_graphs", lambda r: graphs)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace())


def execute_model_call(monkeypatch):
    return (runner(), SimpleNamespace(num_scheduled_tokens={})), {}


def determine_call(monkeypatch):
    r = runner()
    # A step without requests: planning it finds nothing to do (and nothing to count).
    r.kv_cache_config = SimpleNamespace(kv_cache_groups=[0])
    r.input_batch = SimpleNamespace(num_reqs=0)
    pending(r, None)
    return (r, 4, 2), {}


def v1_dispatch_call(monkeypatch):
    r = runner()
    pending(r, True)
    return (r.cudagraph_dispatcher, 8), {"uniform_decode": True}


def append_call(monkeypatch):
    tables = SimpleNamespace(num_kv_cache_groups=1,
                             num_blocks=SimpleNamespace(np=np.zeros((1, 4), np.int32)),
                             block_tables=[SimpleNamespace(gpu=np.zeros((4, 8), np.int32))])
    return (tables, 2, ([7, 8],), False), {}


def v2_dispatch_call(monkeypatch):
    r = runner()
    pending(r, True)
    return (r.cudagraph_manager, 4, 4, 1, 0), {}


def v1_forward_call(monkeypatch):
    r = runner()
    pending(r, True)
    graphed(monkeypatch, Graphs())
    tokens = torch.zeros(4, dtype=torch.long)
    return (r,), {"input_ids": tokens, "positions": tokens}


def v2_pw_graph_call(monkeypatch):
    r = runner()
    pending(r, True)
    graphed(monkeypatch, Graphs())
    return (r.cudagraph_manager, object(), {"input_ids": torch.zeros(4, dtype=torch.long)}), {}


HOOKS = {  # wrapper: (the vLLM method, the wrapper factory, a call that runs its code)
    "V1 execute_model": (("gpu_model_runner", "GPUModelRunner", "execute_model"),
                         hooks_step.execute_model, execute_model_call),
    "V2 execute_model": (("model_runner", "GPUModelRunner", "execute_model"),
                         hooks_step.execute_model, execute_model_call),
    "V1 _determine_batch_execution_and_padding": (
        ("gpu_model_runner", "GPUModelRunner", "_determine_batch_execution_and_padding"),
        hooks_dispatch.v1_determine_batch_execution, determine_call),
    "V1 CudagraphDispatcher.dispatch": (("cudagraph_dispatcher", "CudagraphDispatcher",
                                         "dispatch"), hooks_dispatch.v1_dispatch, v1_dispatch_call),
    "V2 BlockTables.append_block_ids": (("block_table", "BlockTables", "append_block_ids"),
                                        hooks_dispatch.v2_append_block_ids, append_call),
    "V2 CudaGraphManager.dispatch": (("cudagraph_utils", "CudaGraphManager", "dispatch"),
                                     hooks_dispatch.v2_dispatch, v2_dispatch_call),
    "V1 _model_forward": (("gpu_model_runner", "GPUModelRunner", "_model_forward"),
                          hooks_graphs.v1_model_forward, v1_forward_call),
    "V2 CudaGraphManager.run_pw_graph": (("cudagraph_utils", "CudaGraphManager",
                                          "run_pw_graph"), hooks_graphs.v2_run_pw_graph,
                                         v2_pw_graph_call),
}


def break_bind(monkeypatch, args):
    monkeypatch.setattr(inspect.Signature, "bind", fail)


def break_end_step(monkeypatch, args):
    from vllm_cascade_plugin.step import session

    monkeypatch.setattr(session, "end_step", fail)


def break_plan_once(monkeypatch, args):
    monkeypatch.setattr(hooks_dispatch, "plan_once", fail)


def break_row_length(monkeypatch, args):
    args[0].num_blocks = None  # the row's length before vLLM's write cannot be read


def break_ids_written(monkeypatch, args):
    from vllm_cascade_plugin.integration import compat

    monkeypatch.setattr(compat, "v2_block_ids_written", fail)


def break_full_graphs(monkeypatch, args):
    monkeypatch.setattr(hooks_graphs, "full_graphs", fail)


def break_forward_context(monkeypatch, args):
    import vllm.forward_context

    monkeypatch.setattr(vllm.forward_context, "get_forward_context", fail)


def break_graphs(when):
    def inject(monkeypatch, args):
        monkeypatch.setattr(hooks_graphs, "full_graphs", lambda r: Graphs(when))
    return inject


MIRROR, HOOK = "block id mirror error", "runner hook error"
# (wrapper, its code that fails, how, the reason it is counted under, whether the step then runs
# flat: a plan that no longer steers the step's CUDA-graph mode must not reach a builder).
GLUE_FAILURES = [
    ("V1 execute_model", "binding its arguments", break_bind, HOOK, False),
    ("V1 execute_model", "ending the step", break_end_step, HOOK, False),
    ("V2 execute_model", "binding its arguments", break_bind, HOOK, False),
    ("V2 execute_model", "ending the step", break_end_step, HOOK, False),
    ("V1 _determine_batch_execution_and_padding", "planning", break_plan_once, HOOK, True),
    ("V1 CudagraphDispatcher.dispatch", "binding its arguments", break_bind, HOOK, True),
    ("V2 BlockTables.append_block_ids", "reading the row length", break_row_length, MIRROR,
     False),
    ("V2 BlockTables.append_block_ids", "mirroring the ids", break_ids_written, MIRROR, False),
    ("V2 CudaGraphManager.dispatch", "binding its arguments", break_bind, HOOK, True),
    ("V1 _model_forward", "finding the graphs", break_full_graphs, HOOK, False),
    ("V1 _model_forward", "binding its arguments", break_bind, HOOK, False),
    ("V1 _model_forward", "the forward context", break_forward_context, HOOK, False),
    ("V1 _model_forward", "the graphs, before the step", break_graphs("before"), HOOK, False),
    ("V1 _model_forward", "the graphs, after the step", break_graphs("after"), HOOK, False),
    ("V2 CudaGraphManager.run_pw_graph", "finding the graphs", break_full_graphs, HOOK, False),
    ("V2 CudaGraphManager.run_pw_graph", "the forward context", break_forward_context, HOOK,
     False),
    ("V2 CudaGraphManager.run_pw_graph", "the graphs, before the step", break_graphs("before"),
     HOOK, False),
    ("V2 CudaGraphManager.run_pw_graph", "the graphs, after the step", break_graphs("after"),
     HOOK, False),
]


def v1_marked(cases: list, hook=lambda case: case) -> list:
    """The cases, Model Runner V1's marked (skipped where vLLM has no V1 runner: 0.34+)."""
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)),
                         marks=pytest.mark.v1_runner if hook(c).startswith("V1 ") else ())
            for c in cases]


@pytest.mark.parametrize(("hook", "glue", "inject", "reason", "flat"),
                         v1_marked(GLUE_FAILURES, lambda case: case[0]),
                         ids=[f"{hook}: {glue}" for hook, glue, *_ in GLUE_FAILURES])
def test_a_hook_whose_own_code_fails_runs_vllms_call_once_and_returns_its_result(
        planning, monkeypatch, plugin_log, hook, glue, inject, reason, flat):
    target, make, call = HOOKS[hook]
    original = VllmMethod(vllm_method(*target))
    wrapped = make(original)
    args, kwargs = call(monkeypatch)
    step = hooks_step.pending
    with monkeypatch.context() as m:
        inject(m, args)
        result = wrapped(*args, **kwargs)
    assert result is original.result
    assert original.calls == [(args, kwargs)]  # once, as vLLM called it
    assert stats.snapshot().fallbacks == {reason: 1}
    assert [level for level, line in plugin_log if reason in line] == [logging.WARNING]
    if flat:
        assert step.cascade is False and planning.current is None


@pytest.mark.parametrize("hook", v1_marked(["V1 execute_model", "V2 execute_model"]))
def test_a_hook_failing_again_is_counted_again_and_logged_once(planning, monkeypatch,
                                                              plugin_log, hook):
    target, make, call = HOOKS[hook]
    original = VllmMethod(vllm_method(*target))
    wrapped = make(original)
    monkeypatch.setattr(hooks_step, "PendingStep", fail)
    for _ in range(2):
        args, kwargs = call(monkeypatch)
        assert wrapped(*args, **kwargs) is original.result
    assert len(original.calls) == 2
    assert stats.snapshot().fallbacks["runner hook error"] == 2
    assert sum("runner hook error" in line for _, line in plugin_log) == 1


def test_v2_dispatch_whose_code_fails_after_vllms_choice_keeps_it_and_runs_the_step_flat(
        planning, monkeypatch):
    """vLLM chose a FULL graph for the step's batch; replacing it failed. vLLM already ran:
    its choice stands, and the step runs flat, which is what that graph replays."""
    from vllm.config import CUDAGraphMode

    target, make, call = HOOKS["V2 CudaGraphManager.dispatch"]
    original = VllmMethod(vllm_method(*target))
    original.result = SimpleNamespace(cg_mode=CUDAGraphMode.FULL, num_tokens=8)
    wrapped = make(original)
    args, kwargs = call(monkeypatch)
    step = hooks_step.pending
    with monkeypatch.context() as m:
        m.setattr(dataclasses, "replace", fail)
        assert wrapped(*args, **kwargs) is original.result
    assert len(original.calls) == 1
    assert step.cascade is False and planning.current is None
    assert stats.snapshot().fallbacks == {"runner hook error": 1}


WHOLE_STEP_HOOKS = v1_marked(["V1 _model_forward", "V2 CudaGraphManager.run_pw_graph"])


@pytest.mark.parametrize("hook", WHOLE_STEP_HOOKS)
def test_a_failure_after_a_whole_step_capture_runs_the_step_eagerly(planning, monkeypatch,
                                                                    hook):
    """A run inside a CUDA-graph capture computes nothing until the graph replays: when the
    graphs' code fails after it, the step's result is an eager run's."""
    target, make, call = HOOKS[hook]
    original = VllmMethod(vllm_method(*target))
    wrapped = make(original)
    args, kwargs = call(monkeypatch)
    capturing = iter([True, False])
    monkeypatch.setattr(hooks_graphs, "capturing", lambda: next(capturing))
    monkeypatch.setattr(hooks_graphs, "full_graphs", lambda r: Graphs("after"))
    assert wrapped(*args, **kwargs) is original.result
    assert original.calls == [(args, kwargs)] * 2  # the capture, then the step's one real run
    assert stats.snapshot().fallbacks == {"runner hook error": 1}


@pytest.mark.parametrize("hook", v1_marked(list(HOOKS)))
def test_vllms_own_exception_leaves_a_hook_unchanged_and_is_not_retried(planning, monkeypatch,
                                                                        hook):
    target, make, call = HOOKS[hook]
    error = RuntimeError("vLLM's own failure")
    original = VllmMethod(vllm_method(*target), error=error)
    wrapped = make(original)
    args, kwargs = call(monkeypatch)
    with pytest.raises(RuntimeError) as raised:
        wrapped(*args, **kwargs)
    assert raised.value is error
    assert len(original.calls) == 1
    assert stats.snapshot().fallbacks == {}


@pytest.mark.parametrize("hook", WHOLE_STEP_HOOKS)
def test_vllms_own_exception_leaves_the_real_whole_step_graphs_unchanged(planning, monkeypatch,
                                                                         hook):
    """Through fullgraph.StepGraphs, whose eligibility check fails on this stand-in context
    (counted as its own fallback): the model call's exception is still the one that comes out."""
    from vllm_cascade_plugin.graphs import fullgraph

    target, make, call = HOOKS[hook]
    error = RuntimeError("vLLM's own failure")
    original = VllmMethod(vllm_method(*target), error=error)
    wrapped = make(original)
    args, kwargs = call(monkeypatch)
    monkeypatch.setattr(hooks_graphs, "full_graphs", lambda r: fullgraph.StepGraphs(None))
    with pytest.raises(RuntimeError) as raised:
        wrapped(*args, **kwargs)
    assert raised.value is error and len(original.calls) == 1
    assert "runner hook error" not in stats.snapshot().fallbacks
