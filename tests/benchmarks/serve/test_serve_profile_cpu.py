"""What the serving benchmark measures of a served step's time: the torch-profiler trace's summary
(``benchmarks.serve.profiler.summarize``), the step-timeline probe's per-run deltas
(``benchmarks.serve.sm.timeline_deltas``) and a run's offered load."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.serve import metrics as sm
from benchmarks.serve import profiler as serve_profile


def test_trace_summary_finds_the_gpus_idle_gaps_and_the_host_calls_inside_them(tmp_path):
    """Kernels at 0-100 us, 150-250 us and 2,250-2,350 us of a 2.35 ms trace: 2 ms idle in
    one gap, during which the host waited 1.9 ms in a synchronisation."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 150, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 2250, "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 300,
         "dur": 1900},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2200, "dur": 5},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 10},  # not a duration event
    ]
    path = tmp_path / "rank0.1.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = serve_profile.summarize(path)
    assert s["span_ms"] == pytest.approx(2.35) and s["gpu_busy_ms"] == pytest.approx(0.3)
    assert s["gpu_idle_fraction"] == pytest.approx(1 - 0.3 / 2.35, abs=1e-4)
    assert s["idle_gaps"][">0.5ms"] == {"count": 1, "total_ms": 2.0}
    assert s["idle_gaps"][">0.05ms"]["count"] == 1  # the 50 us gap is not above 0.05 ms
    longest = s["longest_gaps"][0]
    assert longest["ms"] == pytest.approx(2.0) and longest["at_ms"] == pytest.approx(0.25)
    assert longest["host_calls"][0] == {"name": "cudaEventSynchronize", "ms_in_gap": 1.9}
    assert s["waiting_calls"] == [{"name": "cudaEventSynchronize", "count": 1,
                                   "total_ms": 1.9, "longest_ms": 1.9}]
    assert s["kernels"][0] == {"name": "k1", "count": 2, "total_ms": 0.2, "longest_ms": 0.1}
    assert serve_profile.traces(tmp_path) == [path]


def test_a_trace_without_gpu_events_says_so(tmp_path):
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]}))
    assert serve_profile.summarize(path)["error"] == "no GPU events"


def test_timeline_deltas_are_per_run_and_per_step(tmp_path):
    before = {"steps": 100, "gpu_step_ms": 2000.0, "gpu_wait_ms": 50.0, "waits_over_1ms": 3}
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps({"steps": 300, "gpu_step_ms": 6000.0, "gpu_wait_ms": 450.0,
                                "waits_over_1ms": 13, "wait_p99_ms": 4.5}))
    got = sm.timeline_deltas(before, sm.read_timeline(path))
    assert got == {"timeline_steps": 200, "gpu_step_ms_per_step": 20.0,
                   "gpu_wait_ms_per_step": 2.0, "gpu_wait_fraction": round(400 / 4400, 4),
                   "gpu_waits_over_1ms": 10, "gpu_wait_p99_ms_recent": 4.5}
    assert sm.read_timeline(tmp_path / "not yet written.json")["steps"] == 0
    assert sm.timeline_deltas(None, None) == {} and sm.read_timeline(None) is None


def test_timeline_deltas_split_the_steps_by_kind_and_phase_where_the_probe_told_them_apart():
    before = {"steps": 10, "gpu_step_ms": 200.0, "gpu_wait_ms": 5.0, "waits_over_1ms": 0,
              "kinds": {"flat": {"steps": 10, "gpu_step_ms": 200.0, "gpu_wait_ms": 5.0},
                        "cascade": {"steps": 0, "gpu_step_ms": 0.0, "gpu_wait_ms": 0.0}},
              "phases": {"decode": {"steps": 6, "gpu_step_ms": 60.0, "gpu_wait_ms": 1.0},
                         "mixed": {"steps": 4, "gpu_step_ms": 140.0, "gpu_wait_ms": 4.0}}}
    after = {"steps": 40, "gpu_step_ms": 900.0, "gpu_wait_ms": 14.0, "waits_over_1ms": 1,
             "kinds": {"flat": {"steps": 30, "gpu_step_ms": 600.0, "gpu_wait_ms": 9.0},
                       "cascade": {"steps": 8, "gpu_step_ms": 200.0, "gpu_wait_ms": 4.0},
                       "capture": {"steps": 2, "gpu_step_ms": 100.0, "gpu_wait_ms": 1.0}},
             "phases": {"decode": {"steps": 31, "gpu_step_ms": 360.0, "gpu_wait_ms": 3.5},
                        "mixed": {"steps": 4, "gpu_step_ms": 140.0, "gpu_wait_ms": 4.0}}}
    got = sm.timeline_deltas(before, after)
    assert got["timeline_steps"] == 30 and got["gpu_step_ms_per_step"] == round(700 / 30, 4)
    assert got["timeline_by_kind"] == {
        "flat": {"steps": 20, "gpu_step_ms_per_step": 20.0, "gpu_wait_ms_per_step": 0.2},
        "cascade": {"steps": 8, "gpu_step_ms_per_step": 25.0, "gpu_wait_ms_per_step": 0.5},
        "capture": {"steps": 2, "gpu_step_ms_per_step": 50.0, "gpu_wait_ms_per_step": 0.5}}
    # no mixed step between the readings: that phase is left out
    assert got["timeline_by_phase"] == {
        "decode": {"steps": 25, "gpu_step_ms_per_step": 12.0, "gpu_wait_ms_per_step": 0.1}}
    zeros = {"steps": 0, "gpu_step_ms": 0.0, "gpu_wait_ms": 0.0, "waits_over_1ms": 0}
    assert not {"timeline_by_kind", "timeline_by_phase"} & set(
        sm.timeline_deltas(zeros, {**zeros, "steps": 3}))


def test_timeline_deltas_give_the_hosts_times_and_the_steps_size_where_the_probe_kept_them():
    """4 steps of 300 tokens and 60 requests, the 2 cascade ones among them of 64 requests."""
    before = {"steps": 10, "gpu_step_ms": 100.0, "gpu_wait_ms": 1.0, "host_prep_ms": 5.0,
              "host_between_ms": 2.0, "tokens": 500.0, "rows": 100.0, "waits_over_1ms": 0,
              "kinds": {"flat": {"steps": 10, "gpu_step_ms": 100.0, "gpu_wait_ms": 1.0,
                                 "host_prep_ms": 5.0, "host_between_ms": 2.0, "tokens": 500.0,
                                 "rows": 100.0}}}
    after = {"steps": 14, "gpu_step_ms": 140.0, "gpu_wait_ms": 9.0, "host_prep_ms": 17.0,
             "host_between_ms": 4.0, "tokens": 1700.0, "rows": 340.0, "waits_over_1ms": 2,
             "kinds": {"flat": {"steps": 12, "gpu_step_ms": 120.0, "gpu_wait_ms": 1.4,
                                "host_prep_ms": 6.0, "host_between_ms": 3.0, "tokens": 1000.0,
                                "rows": 212.0},
                       "cascade": {"steps": 2, "gpu_step_ms": 20.0, "gpu_wait_ms": 7.6,
                                   "host_prep_ms": 11.0, "host_between_ms": 1.0,
                                   "tokens": 700.0, "rows": 128.0}}}
    got = sm.timeline_deltas(before, after)
    assert got["host_prep_ms_per_step"] == 3.0 and got["host_between_ms_per_step"] == 0.5
    assert got["tokens_per_step"] == 300.0 and got["rows_per_step"] == 60.0
    assert got["timeline_by_kind"]["cascade"] == {
        "steps": 2, "gpu_step_ms_per_step": 10.0, "gpu_wait_ms_per_step": 3.8,
        "host_prep_ms_per_step": 5.5, "host_between_ms_per_step": 0.5, "tokens_per_step": 350.0,
        "rows_per_step": 64.0}
    assert got["timeline_by_kind"]["flat"]["host_prep_ms_per_step"] == 0.5
    assert got["timeline_by_kind"]["flat"]["tokens_per_step"] == 250.0
    # a probe that kept no host times nor sizes: none in the row
    zeros = {"steps": 0, "gpu_step_ms": 0.0, "gpu_wait_ms": 0.0, "waits_over_1ms": 0}
    assert not {"host_prep_ms_per_step", "tokens_per_step"} & set(
        sm.timeline_deltas(zeros, {**zeros, "steps": 3}))


def test_offered_load_is_the_rate_over_flats_sustainable_rate():
    assert sm.offered_load(27.5, 50.0) == 0.55
    assert sm.offered_load("burst", 50.0) is None and sm.offered_load(10.0, None) is None


def load_timeline_probe(monkeypatch):
    """The step-timeline probe's module, without its import hook (no file set)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "step_timeline_probe", Path(__file__).resolve().parents[3] / "benchmarks"
        / "serve" / "probes" / "step_timeline" / "sitecustomize.py")
    probe = importlib.util.module_from_spec(spec)
    monkeypatch.delenv("CASCADE_BENCH_TIMELINE_FILE", raising=False)  # no finder installed
    spec.loader.exec_module(probe)
    return probe


def test_the_step_timeline_leaves_execute_models_arguments_to_the_plugins_hook(monkeypatch):
    """The plugin's runner hook binds ``execute_model``'s arguments by name
    (``hooks_step.execute_model``): under the probe it still finds the scheduler output (a
    probe that hid it left every step flat: "runner hook error: KeyError")."""
    import contextlib
    import inspect
    import sys
    import types

    probe = load_timeline_probe(monkeypatch)

    class Runner:
        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            return scheduler_output

        def sample_tokens(self, grammar_output):
            return grammar_output

    class Manager:
        def run_fullgraph(self, num_tokens):
            return num_tokens

    @contextlib.contextmanager
    def set_forward_context(attn_metadata, vllm_config):
        yield

    runner_module = types.SimpleNamespace(GPUModelRunner=Runner,
                                          set_forward_context=set_forward_context)
    graphs = types.ModuleType("vllm.v1.worker.gpu.cudagraph_utils")
    graphs.CudaGraphManager = Manager
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.cudagraph_utils", graphs)
    monkeypatch.setattr(probe._Timeline, "_event", staticmethod(lambda: None))
    probe._patch(runner_module)
    so = object()
    bound = inspect.signature(Runner.execute_model).bind(Runner(), so, dummy_run=True)
    assert bound.arguments["scheduler_output"] is so and bound.arguments["dummy_run"]
    assert Runner().execute_model(so) is so and Runner().sample_tokens(3) == 3
    assert "num_tokens" in inspect.signature(Manager.run_fullgraph).parameters
    with runner_module.set_forward_context(None, None):
        pass


def test_the_step_timeline_marks_the_v1_runners_steps_too(tmp_path, monkeypatch):
    """vLLM 0.26 serves some models (gpt-oss) on the V1 runner: the probe marks its steps as it
    marks V2's (its forward is entered through ``set_forward_context`` alone, FULL graphs
    included), and one timeline per process counts the steps of whichever runner ran them."""
    import contextlib
    import types

    probe = load_timeline_probe(monkeypatch)
    monkeypatch.setattr(probe, "_FILE", str(tmp_path / "timeline.json"))
    monkeypatch.setattr(probe, "_timeline", None)
    clock = iter(float(t) for t in range(0, 1000, 5))
    monkeypatch.setattr(probe._Timeline, "_event", staticmethod(lambda: Event(next(clock))))

    class Runner:
        def execute_model(self, scheduler_output):
            with module.set_forward_context(None):
                pass

        def sample_tokens(self, grammar_output):
            return grammar_output

    @contextlib.contextmanager
    def set_forward_context(attn_metadata):
        yield

    module = types.SimpleNamespace(GPUModelRunner=Runner, set_forward_context=set_forward_context)
    probe._patch(module, probe.V1)  # no V2 graph manager is imported for V1
    for _ in range(3):
        Runner().execute_model(None)
        Runner().sample_tokens(None)
    probe._timeline.written = 0.0
    probe._timeline.read()
    got = json.loads((tmp_path / "timeline.json").read_text())
    assert got["steps"] == 3 and got["gpu_step_ms"] == pytest.approx(15.0)


def test_the_step_timeline_targets_the_installed_vllms_runners():
    """What the probe patches exists in the installed vLLM: Model Runner V2 always, the V1
    runner where vLLM still has it (up to 0.33)."""
    import importlib

    probe_path = (Path(__file__).resolve().parents[3] / "benchmarks" / "serve" / "probes"
                  / "step_timeline" / "sitecustomize.py")
    text = probe_path.read_text()
    found = []
    for name in ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner"):
        assert f'"{name}"' in text
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        found.append(name)
        assert callable(module.GPUModelRunner.execute_model)
        assert callable(module.GPUModelRunner.sample_tokens)
        assert callable(module.set_forward_context)
    assert "vllm.v1.worker.gpu.model_runner" in found


class Event:
    """A fake CUDA event at time ``t`` (ms), already reached."""

    def __init__(self, t: float) -> None:
        self.t = t

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Event) -> float:
        return other.t - self.t


def test_step_timeline_counts_the_wait_inside_steps_not_the_idle_time_between_them(tmp_path,
                                                                                   monkeypatch):
    """The probe's bookkeeping on fake CUDA events (times in ms): a step whose forward came
    2 ms after its begin and ran 10 ms, a step that ran nothing (no forward: dropped), then a
    step 5 s later that waited 0.5 ms; the 5 s without a step count nowhere."""
    probe = load_timeline_probe(monkeypatch)

    times = iter([0.0, 2.0, 12.0, 20.0, 5000.0, 5000.5, 5010.5])
    monkeypatch.setattr(probe._Timeline, "_event", staticmethod(lambda: Event(next(times))))
    timeline = probe._Timeline(str(tmp_path / "timeline.json"))
    timeline.mark_begin(), timeline.mark_forward(), timeline.mark_forward(), timeline.mark_sampled()
    timeline.mark_begin()  # a step without a forward: never counted
    timeline.mark_begin(), timeline.mark_forward(), timeline.mark_sampled()
    timeline.written = 0.0
    timeline.read()
    got = json.loads((tmp_path / "timeline.json").read_text())
    assert got["steps"] == 2 and got["gpu_step_ms"] == pytest.approx(20.0)
    assert got["gpu_wait_ms"] == pytest.approx(2.5) and got["waits_over_1ms"] == 1


def test_timeline_deltas_keep_the_runs_decode_steps_by_requests():
    """Per kind and batch size, the steps between the two readings and their mean GPU and
    wait ms; a batch size with no step in between is left out."""
    before = {"steps": 4, "gpu_step_ms": 40.0, "gpu_wait_ms": 0.0, "waits_over_1ms": 0,
              "decode_by_rows": {"flat": {"32": [2, 20.0, 1.0], "40": [2, 24.0, 0.0]}}}
    after = {"steps": 10, "gpu_step_ms": 100.0, "gpu_wait_ms": 2.0, "waits_over_1ms": 0,
             "decode_by_rows": {"flat": {"32": [5, 53.0, 1.6], "40": [2, 24.0, 0.0]},
                                "cascade": {"32": [3, 21.0, 0.3]}}}
    got = sm.timeline_deltas(before, after)["decode_by_rows"]
    assert got == {"flat": {"32": [3, 11.0, 0.2]}, "cascade": {"32": [3, 7.0, 0.1]}}
    zeros = {"steps": 0, "gpu_step_ms": 0.0, "gpu_wait_ms": 0.0, "waits_over_1ms": 0}
    assert "decode_by_rows" not in sm.timeline_deltas(zeros, {**zeros, "steps": 3})


def test_decode_steps_compare_at_equal_batch_sizes_weighted_by_the_fewer_steps():
    """32 requests: 10 steps against 4 (weight 4), 1.2 ms against 1.0; 64: 6 against 6, 2.0
    against 2.0; 16 (one side only) is not compared: (4 x 1.2 + 6 x 2.0) / (4 x 1.0 + 6 x 2.0)."""
    plugin = {"decode_by_rows": {"flat": {"32": [10, 1.2, 0.0], "64": [6, 2.0, 0.0],
                                          "16": [9, 0.5, 0.0]},
                                 "cascade": {"128": [3, 2.5, 0.0]}}}
    flat = {"decode_by_rows": {"flat": {"32": [4, 1.0, 0.0], "64": [6, 2.0, 0.0]}}}
    got = sm.matched_decode(plugin, "flat", flat)
    assert got == {"ratio": round(16.8 / 16.0, 4), "steps": 10, "sizes": 2}
    assert sm.matched_decode(plugin, "cascade", flat) is None  # no batch size in common
    assert sm.matched_decode({}, "flat", flat) is None


def test_step_timeline_counts_each_steps_tokens_and_requests_from_the_scheduler(tmp_path,
                                                                               monkeypatch):
    """A step's size is its scheduler output's: a decode step of 3 requests, a mixed step of
    2 requests and 513 tokens; a step begun without one counts 0 (never an error)."""
    import types

    probe = load_timeline_probe(monkeypatch)
    events = iter(float(t) for t in range(0, 1000, 5))
    monkeypatch.setattr(probe._Timeline, "_event", staticmethod(lambda: Event(next(events))))
    timeline = probe._Timeline(str(tmp_path / "timeline.json"))
    for scheduled in (types.SimpleNamespace(total_num_scheduled_tokens=3,
                                            num_scheduled_tokens={"a": 1, "b": 1, "c": 1}),
                      types.SimpleNamespace(total_num_scheduled_tokens=513,
                                            num_scheduled_tokens={"a": 1, "d": 512}),
                      None):
        timeline.mark_begin(scheduled), timeline.mark_forward(), timeline.mark_sampled()
    timeline.written = 0.0
    timeline.read()
    got = json.loads((tmp_path / "timeline.json").read_text())
    assert got["steps"] == 3 and got["tokens"] == 516 and got["rows"] == 5
    assert got["kinds"]["flat"]["rows"] == 5
    # only the decode step is kept by its requests (events 5 ms apart: 5 ms of GPU, no wait)
    assert got["decode_by_rows"] == {"flat": {"3": [1, 5.0, 5.0]}, "cascade": {},
                                     "capture": {}}


def test_step_timeline_keeps_decode_and_mixed_steps_apart(tmp_path, monkeypatch):
    """A decode step (3 requests, 3 tokens) and two mixed ones (a prefill in them: 513 and 2
    tokens over 2 and 1 requests) are counted by phase as well as in all."""
    import types

    probe = load_timeline_probe(monkeypatch)
    events = iter(float(t) for t in range(0, 1000, 5))
    monkeypatch.setattr(probe._Timeline, "_event", staticmethod(lambda: Event(next(events))))
    timeline = probe._Timeline(str(tmp_path / "timeline.json"))
    for tokens, counts in ((3, {"a": 1, "b": 1, "c": 1}), (513, {"a": 1, "d": 512}),
                           (2, {"e": 2})):
        timeline.mark_begin(types.SimpleNamespace(total_num_scheduled_tokens=tokens,
                                                  num_scheduled_tokens=counts))
        timeline.mark_forward(), timeline.mark_sampled()
    timeline.read(force=True)
    phases = json.loads((tmp_path / "timeline.json").read_text())["phases"]
    assert {p: (v["steps"], v["tokens"], v["rows"]) for p, v in phases.items()} == {
        "decode": (1, 3, 3), "mixed": (2, 515, 3)}
    assert phases["mixed"]["gpu_step_ms"] == pytest.approx(10.0)  # 5 ms each (fake events)


def test_step_timeline_writes_the_steps_completed_once_the_engine_idles(tmp_path, monkeypatch):
    """Steps the engine read within a second of its last write are not in the file until its
    next write; once no step was sampled for FLUSH_S the flushing thread's call writes them
    (the run's last steps in its own reading), and writes nothing again while nothing
    changed. While steps run, the call leaves the file to the engine."""
    import types

    probe = load_timeline_probe(monkeypatch)
    events = iter(float(t) for t in range(0, 1000, 5))
    monkeypatch.setattr(probe._Timeline, "_event", staticmethod(lambda: Event(next(events))))
    clock = {"now": 100.0}
    monkeypatch.setattr(probe, "time", types.SimpleNamespace(
        perf_counter=lambda: clock["now"], monotonic=lambda: clock["now"]))
    path = tmp_path / "timeline.json"
    timeline = probe._Timeline(str(path))
    timeline.mark_begin(), timeline.mark_forward(), timeline.mark_sampled()  # written: 1 step
    assert json.loads(path.read_text())["steps"] == 1
    clock["now"] += 0.1
    timeline.mark_begin(), timeline.mark_forward(), timeline.mark_sampled()  # read, unwritten
    timeline.flush_idle()  # 0 s after the last sampling: the engine's to write
    assert json.loads(path.read_text())["steps"] == 1
    clock["now"] += probe.FLUSH_S
    timeline.flush_idle()
    assert json.loads(path.read_text())["steps"] == 2
    path.unlink()
    timeline.flush_idle()  # nothing new: no write
    assert not path.exists()


def test_step_timeline_times_the_hosts_preparation_and_the_gap_before_each_step(tmp_path,
                                                                                monkeypatch):
    """Host clock (s): a step prepared in 3 ms; the next begun 1 ms after the first was
    sampled and prepared in 0.5 ms; a third after 5 s of an idle engine (its gap is idle time,
    not counted), prepared in 2 ms."""
    probe = load_timeline_probe(monkeypatch)
    events = iter(float(t) for t in range(0, 1000, 5))
    monkeypatch.setattr(probe._Timeline, "_event", staticmethod(lambda: Event(next(events))))
    host = iter([0.0, 0.003, 0.015, 0.016, 0.0165, 0.030, 5.030, 5.032, 5.040])
    import types

    monkeypatch.setattr(probe, "time", types.SimpleNamespace(  # the probe's clock alone
        perf_counter=lambda: next(host), monotonic=lambda: 1e9))
    timeline = probe._Timeline(str(tmp_path / "timeline.json"))
    for _ in range(3):
        timeline.mark_begin(), timeline.mark_forward(), timeline.mark_sampled()
    timeline.written = 0.0
    timeline.read()
    got = json.loads((tmp_path / "timeline.json").read_text())
    assert got["steps"] == 3
    assert got["host_prep_ms"] == pytest.approx(5.5)
    assert got["host_between_ms"] == pytest.approx(1.0)
    assert got["host_run_ms"] == pytest.approx(12.0 + 13.5 + 8.0)  # forward to sampled
    assert got["kinds"]["flat"]["host_prep_ms"] == pytest.approx(5.5)


def test_the_step_timeline_tells_steps_apart_by_the_plugins_counters(tmp_path, monkeypatch):
    """A step in which the plugin counted a graph capture is a capture step, one it counted
    as cascade a cascade step, any other flat (and every step where the plugin is not loaded):
    the counters it reads are the plugin's real ones (``stats.record_cascade``,
    ``stats.record_capture``)."""
    import sys

    from vllm_cascade_plugin import stats

    probe = load_timeline_probe(monkeypatch)

    clock = iter(float(t) for t in range(0, 1000, 5))
    monkeypatch.setattr(probe._Timeline, "_event", staticmethod(lambda: Event(next(clock))))
    timeline = probe._Timeline(str(tmp_path / "timeline.json"))

    def step(*counted):
        timeline.mark_begin(), timeline.mark_forward()
        for record in counted:
            record()
        timeline.mark_sampled()

    stats.reset()
    try:
        step()
        step(lambda: stats.record_cascade(10, 2, True))
        step(lambda: stats.record_capture(0.04), lambda: stats.record_cascade(10, 2, True))
        step(lambda: stats.record_cascade(10, 2, True))
        monkeypatch.delitem(sys.modules, "vllm_cascade_plugin.stats")  # a flat server
        step()
    finally:
        stats.reset()
    timeline.written = 0.0
    timeline.read()
    kinds = json.loads((tmp_path / "timeline.json").read_text())["kinds"]
    assert {k: v["steps"] for k, v in kinds.items()} == {"flat": 2, "cascade": 2, "capture": 1}
    assert kinds["cascade"]["gpu_step_ms"] == pytest.approx(10.0)  # 5 ms each (fake clock)
