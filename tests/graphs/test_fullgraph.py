"""Whole-step graphs (``fullgraph.StepGraphs``) on a CPU: when a step is eligible, what keys it,
when it is captured, replayed, discarded or given up. The capture is a stand-in whose replay
returns the captured output without running the model, as a CUDA graph replay does; the real
capture needs a GPU (``tests/gpu/test_engine.py`` compares whole engines with and without it)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode

from vllm_cascade_plugin import stats
from vllm_cascade_plugin.graphs import fullgraph
from vllm_cascade_plugin.step import session

LAYERS = 2


class Model:
    """The runner's model call: every layer runs the executor (``layers_run`` of them)."""

    def __init__(self, ctx, executor):
        self.ctx, self.executor, self.calls, self.modes = ctx, executor, 0, []
        self.layers_run = LAYERS

    def __call__(self):
        self.calls += 1
        self.modes.append(self.ctx.cudagraph_runtime_mode)
        self.executor.runs += self.layers_run
        return torch.full((4, 8), float(self.calls))


def capture_stand_in(forward):
    output = forward()
    return (lambda: output), output


@pytest.fixture
def step(monkeypatch):
    stats.reset()
    executor = SimpleNamespace(_step=SimpleNamespace(graph_key=("levels",)), runs=0)
    md = SimpleNamespace(cascade=executor, cascade_max_page=5, num_actual_tokens=4,
                         cascade_rows=4)
    layer = SimpleNamespace(kv_cache=torch.zeros(10, 16, 2, 8),
                            impl=SimpleNamespace(_cascade_kv_views=(None, torch.zeros(10, 16, 1, 8),
                                                                    None)))
    ctx = SimpleNamespace(attn_metadata={f"l{i}": md for i in range(LAYERS)},
                          no_compile_layers={"l0": layer},
                          slot_mapping={f"l{i}": torch.zeros(4) for i in range(LAYERS)},
                          batch_descriptor=("desc", 4),
                          cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE)
    monkeypatch.setattr(session, "current", SimpleNamespace(
        decision=SimpleNamespace(use_cascade=True), decode=True))
    monkeypatch.setattr(session, "steady_cost_model", session.steady_cost_model)  # restored
    inputs = {"input_ids": torch.zeros(4, dtype=torch.long), "positions": torch.zeros(4)}
    return SimpleNamespace(ctx=ctx, md=md, executor=executor, inputs=inputs,
                           model=Model(ctx, executor), first_input_ids=inputs["input_ids"])


def run(graphs, s, sizes=(1, 1, 1)):
    return graphs.run(s.model, s.ctx, s.inputs, sizes, "v2")


def test_captured_on_the_second_step_then_replayed_without_running_the_model(step):
    """The first eager step warms up what runs lazily; the next captures, later ones replay
    (and count as graphed decode steps)."""
    graphs = fullgraph.StepGraphs(CUDAGraphMode.NONE, capture=capture_stand_in)
    outs = [run(graphs, step) for _ in range(5)]
    assert step.model.calls == 2  # one eager step, one capture; then replays
    assert (graphs.captures, graphs.replays) == (1, 3)
    assert stats.snapshot().decode_steps_graphed == 3
    assert step.model.modes == [CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE]
    assert step.ctx.cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE  # restored
    assert outs[2] is outs[1] and outs[4] is outs[1]


def test_a_step_with_other_rows_of_the_same_padded_size_replays_the_same_graph(step):
    """The key holds the rows the executor runs (vLLM's padded count), not the step's tokens:
    a request that finished leaves the graph usable."""
    graphs = fullgraph.StepGraphs(CUDAGraphMode.NONE, capture=capture_stand_in)
    run(graphs, step)
    run(graphs, step)
    step.md.num_actual_tokens = 3
    run(graphs, step)
    assert (graphs.captures, graphs.replays) == (1, 1)


def test_another_input_address_or_executor_key_is_another_graph(step):
    graphs = fullgraph.StepGraphs(CUDAGraphMode.NONE, capture=capture_stand_in, capture_after=1)
    run(graphs, step)  # the warm-up run
    run(graphs, step)
    step.inputs["input_ids"] = torch.zeros(4, dtype=torch.long)  # new buffer, same shape
    run(graphs, step)
    step.executor._step = SimpleNamespace(graph_key=("other levels",))
    run(graphs, step)
    assert graphs.captures == 3 and graphs.replays == 0


@pytest.mark.parametrize("change", ["not decode", "flat", "tp2", "eager executor", "page range",
                                    "embeds", "microbatches"])
def test_ineligible_steps_run_the_model(step, monkeypatch, change):
    sizes = (1, 1, 1)
    if change == "not decode":
        session.current.decode = False
    elif change == "flat":
        session.current.decision.use_cascade = False
    elif change == "tp2":
        sizes = (2, 1, 1)
    elif change == "eager executor":
        step.executor._step.graph_key = None
    elif change == "page range":
        step.md.cascade_max_page = 10
    elif change == "embeds":
        step.inputs["inputs_embeds"] = torch.zeros(4, 8)
    else:
        step.ctx.attn_metadata = [step.ctx.attn_metadata]
    graphs = fullgraph.StepGraphs(CUDAGraphMode.NONE, capture=capture_stand_in, capture_after=1)
    for _ in range(3):
        run(graphs, step, sizes)
    assert step.model.calls == 3 and graphs.captures == 0


def test_a_graph_in_which_a_layer_fell_back_is_discarded(step):
    graphs = fullgraph.StepGraphs(CUDAGraphMode.NONE, capture=capture_stand_in, capture_after=1)
    run(graphs, step)  # the warm-up run
    step.model.layers_run = LAYERS - 1  # one layer ran flat attention while capturing
    out = run(graphs, step)
    assert out is not None and graphs.captures == 0 and len(graphs) == 0
    assert stats.snapshot().fallbacks["full graph discarded"] == 1


def test_a_failed_capture_runs_the_model_once_and_turns_the_feature_off(step, caplog):
    def broken(forward):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = fullgraph.StepGraphs(CUDAGraphMode.NONE, capture=broken, capture_after=1)
    with caplog.at_level(logging.WARNING, logger="vllm.cascade_plugin"):
        run(graphs, step)  # the warm-up run
        out = run(graphs, step)
        run(graphs, step)
    assert step.model.calls == 3 and graphs.failed and out is not None
    assert stats.snapshot().graph_capture_failures == 1
    assert sum("whole cascade decode step" in r.getMessage() for r in caplog.records) == 1
    assert step.ctx.cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE


def test_full_graphs_knob_is_on_by_default_and_parses():
    from vllm_cascade_plugin.config import ConfigError, load_config

    assert load_config({}).full_graphs is True
    assert load_config({"CASCADE_FULL_GRAPHS": "0"}).full_graphs is False
    with pytest.raises(ConfigError, match="CASCADE_FULL_GRAPHS"):
        load_config({"CASCADE_FULL_GRAPHS": "sometimes"})


def make_runner(tp=1, lora=None, kv_transfer=None):
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                               data_parallel_size=1)
    return SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel,
                                                       lora_config=lora,
                                                       kv_transfer_config=kv_transfer))


@pytest.fixture
def configured():
    from vllm_cascade_plugin.config import CascadeConfig
    from vllm_cascade_plugin.planning.cost import AttentionShape

    saved = dict(vars(session))
    session.configure(CascadeConfig(enabled=True), AttentionShape(8, 2, 128, 2), 16, None)
    yield
    vars(session).update(saved)


def test_whole_step_graphs_are_kept_per_runner_and_refused_where_unsupported(configured, caplog):
    from vllm.model_executor.offloader import base as offloader
    from vllm.model_executor.offloader.uva import UVAOffloader

    from vllm_cascade_plugin.integration import hooks_graphs

    plain = make_runner()
    graphs = hooks_graphs.full_graphs(plain)
    assert isinstance(graphs, fullgraph.StepGraphs) and hooks_graphs.full_graphs(plain) is graphs
    hybrid = make_runner()  # a hybrid model's sliding-window and full-attention groups
    hybrid.kv_cache_config = SimpleNamespace(kv_cache_groups=[object(), object()])
    saved = offloader.get_offloader()
    with caplog.at_level(logging.INFO, logger="vllm.cascade_plugin"):
        for refused, why in ((make_runner(tp=2), "parallel size"),
                            (make_runner(lora=object()), "LoRA"),
                            (hybrid, "several KV-cache groups")):
            assert hooks_graphs.full_graphs(refused) is None
            assert hooks_graphs.full_graphs(refused) is None
            assert sum(why in r.getMessage() for r in caplog.records) == 1  # logged once
        try:
            offloader.set_offloader(UVAOffloader(cpu_offload_max_bytes=1 << 30))
            assert hooks_graphs.full_graphs(make_runner()) is None
        finally:
            offloader.set_offloader(saved)
    assert any("offloads weights" in r.getMessage() for r in caplog.records)
    assert hooks_graphs.full_graphs(make_runner()) is not None  # the no-op offloader is back
    session.config = dataclasses.replace(session.config, full_graphs=False)
    assert hooks_graphs.full_graphs(make_runner()) is None


def test_whole_step_graphs_are_refused_while_a_kv_connector_is_active(configured, caplog,
                                                                       tmp_path):
    """A KV connector's per-layer hooks run around each attention op inside the model call:
    a replayed graph of the whole call would skip them (vLLM itself keeps such engines off
    FULL graphs). vLLM's own KVTransferConfig: a connector with a role is active, the empty
    config (what vLLM makes before it knows of any) is not."""
    from vllm.config import KVTransferConfig

    import vllm_cpu
    from vllm_cascade_plugin.integration import hooks_graphs

    active = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with caplog.at_level(logging.INFO, logger="vllm.cascade_plugin"):
        assert hooks_graphs.full_graphs(make_runner(kv_transfer=active)) is None
    assert sum("KV connector is active" in r.getMessage() for r in caplog.records) == 1
    assert hooks_graphs.full_graphs(make_runner(kv_transfer=KVTransferConfig())) is not None
    assert hooks_graphs.full_graphs(make_runner()) is not None
    # The attribute the check reads is the one vLLM's engine configuration has.
    config = vllm_cpu.engine_config(str(tmp_path))
    assert config.kv_transfer_config is None
    assert hooks_graphs.full_graphs_reason(config) is None
    connected = copy.copy(config)
    object.__setattr__(connected, "kv_transfer_config", active)
    assert "KV connector" in (hooks_graphs.full_graphs_reason(connected) or "")


def test_graph_stats_count_every_live_runners_graphs():
    before = fullgraph.graph_stats()
    graphs = fullgraph.StepGraphs(CUDAGraphMode.NONE)
    graphs.captures, graphs.replays = 2, 5
    after = fullgraph.graph_stats()
    assert after["full_graph_captures"] == before["full_graph_captures"] + 2
    assert after["full_graph_replays"] == before["full_graph_replays"] + 5


class Recorder:
    """Stands in for a runner's StepGraphs: records what the wrapper hands it, runs forward."""

    def __init__(self):
        self.calls = []

    def run(self, forward, ctx, inputs, sizes, tag):
        self.calls.append((ctx, inputs, sizes, tag))
        return ("graphs", forward())


@pytest.fixture
def wrappers(monkeypatch):
    """hooks' two whole-step wrappers around stand-in originals with vLLM's real signatures."""
    import inspect

    from vllm_cascade_plugin.integration import compat, hooks_graphs, hooks_step

    def original(*args, **kwargs):
        original.calls.append((args, kwargs))
        return "original"

    original.calls = []
    if compat.v1_model_runner():
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        # V1's wrapper binds the call to the original's signature (functools.wraps: vLLM's own).
        original.__signature__ = inspect.signature(  # type: ignore[attr-defined]
            GPUModelRunner._model_forward)
    recorder = Recorder()
    monkeypatch.setattr(hooks_graphs, "full_graphs", lambda runner: recorder)
    monkeypatch.setattr("vllm.forward_context.get_forward_context", lambda: "ctx")
    runner = SimpleNamespace(vllm_config=make_runner().vllm_config,
                             cudagraph_manager=SimpleNamespace())
    step = hooks_step.PendingStep(runner, None)
    step.cascade = True
    monkeypatch.setattr(hooks_step, "pending", step)
    return SimpleNamespace(hooks_step=hooks_step, original=original, recorder=recorder,
                           runner=runner, step=step,
                           v1=compat.v1_model_runner() and hooks_graphs.v1_model_forward(original),
                           v2=hooks_graphs.v2_run_pw_graph(original))


@pytest.mark.v1_runner
def test_v1_wrapper_hands_a_cascade_steps_model_call_to_the_graphs(wrappers):
    w, ids, pos = wrappers, torch.zeros(4, dtype=torch.long), torch.arange(4)
    assert w.v1(w.runner, ids, positions=pos) == ("graphs", "original")
    ((ctx, inputs, sizes, tag),) = w.recorder.calls
    assert ctx == "ctx" and tag == "v1" and sizes == (1, 1, 1)
    assert inputs["input_ids"] is ids and inputs["positions"] is pos
    assert inputs["intermediate_tensors"] is None and inputs["inputs_embeds"] is None
    assert w.original.calls == [((w.runner, ids), {"positions": pos})]  # the call as made


@pytest.mark.v1_runner
@pytest.mark.parametrize("case", ["no step", "other runner", "flat step", "model kwargs"])
def test_v1_wrapper_leaves_every_other_model_call_alone(wrappers, monkeypatch, case):
    w = wrappers
    kwargs = {"input_ids": torch.zeros(4, dtype=torch.long)}
    if case == "no step":
        monkeypatch.setattr(w.hooks_step, "pending", None)
    elif case == "other runner":
        w.step.runner = SimpleNamespace()
    elif case == "flat step":
        w.step.cascade = False
    else:
        kwargs["pixel_values"] = torch.zeros(1)  # multimodal inputs: not in the graph's key
    assert w.v1(w.runner, **kwargs) == "original"
    assert w.recorder.calls == [] and len(w.original.calls) == 1


@pytest.mark.parametrize("case", ["cascade", "other manager", "breakable graphs", "flat step"])
def test_v2_wrapper_hands_only_its_runners_cascade_steps_to_the_graphs(wrappers, case):
    w = wrappers
    manager, inputs = w.runner.cudagraph_manager, {"input_ids": torch.zeros(4)}
    if case == "other manager":
        manager = SimpleNamespace()
    elif case == "breakable graphs":
        manager.use_breakable_cg = True
    elif case == "flat step":
        w.step.cascade = False
    out = w.v2(manager, "model", inputs)
    if case == "cascade":
        assert out == ("graphs", "original")
        ((_, handed, _, tag),) = w.recorder.calls
        assert tag == "v2" and handed == inputs and handed is not inputs  # a copy
    else:
        assert out == "original" and w.recorder.calls == []
    assert w.original.calls == [((manager, "model", inputs), {})]


def test_each_capture_is_counted_with_what_changed_in_its_key(step):
    """A new padded size, a new layout of the levels at a size seen before, the same size and
    layout at another address, and a graph evicted then needed again."""
    graphs = fullgraph.StepGraphs(CUDAGraphMode.NONE, capture=capture_stand_in, capture_after=1,
                                  max_graphs=3)
    step.executor._step = SimpleNamespace(graph_key=("levels", 1), layout_key=("levels",))
    run(graphs, step)  # the warm-up run
    run(graphs, step)  # captured: the first graph of this padded size
    run(graphs, step)  # replayed
    step.inputs["input_ids"] = torch.zeros(4, dtype=torch.long)  # vLLM's buffer moved
    run(graphs, step)
    step.executor._step = SimpleNamespace(graph_key=("other levels", 1),
                                          layout_key=("other levels",))
    run(graphs, step)
    step.ctx.batch_descriptor = ("desc", 8)
    run(graphs, step)  # a fourth graph: the first one (least recently replayed) is evicted
    step.ctx.batch_descriptor = ("desc", 4)
    step.executor._step = SimpleNamespace(graph_key=("levels", 1), layout_key=("levels",))
    step.inputs["input_ids"] = step.first_input_ids
    run(graphs, step)
    assert graphs.captures == 5 and graphs.replays == 1 and graphs.evictions >= 1
    assert stats.snapshot().full_graph_capture_causes == {
        fullgraph.NEW_SIZE: 2, fullgraph.NEW_ADDRESSES: 1, fullgraph.NEW_LAYOUT: 1,
        fullgraph.EVICTED: 1}
