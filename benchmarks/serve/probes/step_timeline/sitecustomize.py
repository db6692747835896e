"""Benchmark only: how long the GPU waits for the host inside served steps, without a profiler.

``serve/bench.py --step-timeline`` puts this folder first on every server's ``PYTHONPATH`` and sets
``CASCADE_BENCH_TIMELINE_FILE``. In the engine process, once vLLM's model runner module is imported
(Model Runner V2's, or the V1 runner's: vLLM 0.26 serves some models, gpt-oss among them, on V1),
three CUDA events are recorded per step on the runner's stream: *begin*, where ``execute_model`` is
entered (the host starts preparing the step), *forward*, where the model's forward is about to be
launched (``set_forward_context``, or V2's ``run_fullgraph``: the inputs and every attention
metadata builder's work, the plugin's planning included, are done), and *sampled*, where
``sample_tokens`` returns. An event completes when the stream reaches it, or when it is recorded if
the stream is idle by then, so ``begin -> forward`` is the time the GPU had nothing of the step to
run while the host prepared it (on the critical path; near zero when the host prepares a step while
the GPU still runs the last one), and ``forward -> sampled`` the forward and sampling's GPU time.
Idle time between steps with no request to run is in neither. Host-clock times per step tell what
a wait is made of: ``host_prep_ms``, from ``execute_model``'s entry to the forward (the host
preparing the step: inputs, metadata builders, the plugin's planning), and ``host_between_ms``, from
the last step's sampling to this step's ``execute_model`` (the engine's loop outside the runner:
scheduling, output processing); a step whose GPU waited long with a short preparation started late.
``host_run_ms``, from the forward to ``sample_tokens``' return, is the host launching the step (with
asynchronous scheduling nothing in it waits for the GPU): near the step's GPU time, the host sets
the step's pace (a step launched layer by layer, outside a CUDA graph), and the next step's
preparation starts with the GPU about to run dry. Each step's size comes from the scheduler's
output: ``tokens`` (scheduled tokens) and ``rows`` (requests), so two servers' GPU ms per step can
be read against the size of their steps; and as a decode step's GPU time follows its requests,
decode steps (one token a request) are also kept by their requests (``decode_by_rows``: kind, then
requests, then ``[steps, GPU ms, wait ms]``), for two servers' decode steps to be compared at equal
batch sizes. Completed steps are read without waiting (``Event.query``); the running totals go to
the file every second as JSON: ``steps``, ``gpu_step_ms``, ``gpu_wait_ms`` (waiting for the host),
``host_prep_ms``, ``host_between_ms``, ``host_run_ms``, ``tokens``, ``rows``, ``waits_over_1ms`` and
``wait_p99_ms`` over the last 4,096 steps, ``decode_by_rows``, ``kinds``: the same steps, GPU
time, wait, host times and sizes by kind of step, read from the plugin's counters between the step's
begin and its sampling (none in a server without the plugin: every step ``flat``): ``capture`` (the
plugin captured a CUDA graph in it), ``cascade`` (it ran as cascade), ``flat``; and ``phases``: the
same by ``decode`` (one token a request) and ``mixed`` steps (a prefill in them), whose launch a
decode step's FULL graph does not hide. ``serve/bench.py`` reads it before and after each run.
Steps completed while the engine then idles are written too (a thread brings the file up to date
once no step was sampled for a quarter second), so a run's last second is in its own reading, not
in the next run's. It shadows any other ``sitecustomize`` module on that server's path."""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
from collections import deque
from typing import Any

_FILE = os.environ.get("CASCADE_BENCH_TIMELINE_FILE", "")
V2 = "vllm.v1.worker.gpu.model_runner"  # Model Runner V2 (0.26 on; the only runner in 0.34)
V1 = "vllm.v1.worker.gpu_model_runner"  # the V1 runner (0.26-0.33)
_TARGETS = (V2, V1)
KINDS = ("flat", "cascade", "capture")
PHASES = ("decode", "mixed")  # one token a request; a prefill in the step
TOTALS = ("gpu_step_ms", "gpu_wait_ms", "host_prep_ms", "host_between_ms", "host_run_ms",
          "tokens", "rows")
IDLE_MS = 100.0  # a longer gap between two steps is the engine idle (nothing to run)
FLUSH_S = 0.25  # the flushing thread's period, and the quiet time after which it writes


def _plugin_marks() -> tuple[int, int]:
    """The plugin's (cascade steps, graph captures) so far in this process; (0, 0) where it is
    not loaded. Its counters read as they are (no lock, no copy: two integer reads)."""
    stats = sys.modules.get("vllm_cascade_plugin.stats")
    counters = getattr(stats, "_counters", None)
    if counters is None:
        return 0, 0
    return int(counters.steps_cascade), int(counters.graph_captures)


class _Timeline:
    def __init__(self, path: str) -> None:
        self.path = path
        # (begin, forward, sampled, kind of step, host ms preparing it, host ms before it,
        #  host ms launching it, tokens, rows)
        self.pending: deque[tuple[Any, Any, Any, str, float, float, float, int, int]] = deque()
        self.begin: Any = None
        self.forward: Any = None
        self.marks = (0, 0)  # the plugin's counters when the step began
        self.kinds = {kind: {"steps": 0, **dict.fromkeys(TOTALS, 0.0)} for kind in KINDS}
        self.phases = {phase: {"steps": 0, **dict.fromkeys(TOTALS, 0.0)} for phase in PHASES}
        self.totals = dict.fromkeys(TOTALS, 0.0)
        # decode steps by kind, then requests: [steps, GPU ms, wait ms]
        self.decode: dict[str, dict[str, list[float]]] = {kind: {} for kind in KINDS}
        self.steps = 0
        self.size = (0, 0)  # this step's scheduled (tokens, rows)
        # host clock (perf_counter, s): this step's begin and forward, the last step's sampling
        self.host_begin = self.host_forward = self.host_sampled = 0.0
        self.host_between = 0.0  # ms from the last step's sampling to this step's begin
        self.long_waits = 0
        self.recent: deque[float] = deque(maxlen=4096)
        self.written = 0.0
        self.unwritten = False  # steps read since the last write
        self.lock = threading.Lock()  # the engine's thread and the flushing one read in turn
        self.flushing = False  # the thread started (or could not be: then never again)

    @staticmethod
    def _event() -> Any:
        import torch

        if torch.cuda.is_current_stream_capturing():  # vLLM capturing its graphs: no event
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark_begin(self, scheduled: Any = None) -> None:
        """A step begins; ``scheduled``: the scheduler's output it runs (its size)."""
        counts = getattr(scheduled, "num_scheduled_tokens", None) or {}
        self.size = (int(getattr(scheduled, "total_num_scheduled_tokens", 0) or 0), len(counts))
        self.host_begin = time.perf_counter()
        # after an idle engine (no step to run) the gap is idle time, not the loop's work
        gap = (self.host_begin - self.host_sampled) * 1e3 if self.host_sampled else 0.0
        self.host_between = gap if gap < IDLE_MS else 0.0
        self.begin, self.forward = self._event(), None  # a step that ran nothing is dropped
        self.marks = _plugin_marks()

    def mark_forward(self) -> None:
        if self.begin is not None and self.forward is None:  # a step's first forward
            self.forward = self._event()
            self.host_forward = time.perf_counter()

    def mark_sampled(self) -> None:
        if self.begin is None or self.forward is None:
            return
        sampled = self._event()
        self.host_sampled = time.perf_counter()
        if sampled is not None:
            cascade, captures = _plugin_marks()
            kind = ("capture" if captures > self.marks[1]
                    else "cascade" if cascade > self.marks[0] else "flat")
            self.pending.append((self.begin, self.forward, sampled, kind,
                                 (self.host_forward - self.host_begin) * 1e3, self.host_between,
                                 (self.host_sampled - self.host_forward) * 1e3, *self.size))
        self.begin = self.forward = None
        if not self.flushing:
            self.flushing = True
            with contextlib.suppress(Exception):  # no thread: the runs' readings as before
                self.start_flushing()
        self.read()

    def read(self, force: bool = False) -> None:
        """Count the completed steps; write the totals once a second (``force``: now, if any
        step was counted since the last write)."""
        with self.lock:
            self._count_completed()
            now = time.monotonic()
            if (force and self.unwritten) or now - self.written >= 1.0:
                self._write(now)

    def _count_completed(self) -> None:
        while self.pending and self.pending[0][2].query():
            begin, forward, sampled, kind, prep, between, launch, tokens, rows = (
                self.pending.popleft())
            wait, run = begin.elapsed_time(forward), forward.elapsed_time(sampled)
            self.steps += 1
            self.unwritten = True
            decode = bool(rows) and tokens == rows
            groups = (self.totals, self.kinds[kind], self.phases[PHASES[not decode]])
            for name, value in zip(TOTALS, (run, wait, prep, between, launch, tokens, rows),
                                   strict=True):
                for group in groups:
                    group[name] += value
            self.kinds[kind]["steps"] += 1
            self.phases[PHASES[not decode]]["steps"] += 1
            if decode:  # kept by its requests
                by_rows = self.decode[kind].setdefault(str(rows), [0, 0.0, 0.0])
                by_rows[0] += 1
                by_rows[1] += run
                by_rows[2] += wait
            self.long_waits += wait > 1.0
            self.recent.append(wait)

    def _write(self, now: float) -> None:
        self.written, self.unwritten = now, False
        recent = sorted(self.recent)
        p99 = recent[int(0.99 * (len(recent) - 1))] if recent else None
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"steps": self.steps, **self.totals, "waits_over_1ms": self.long_waits,
                       "wait_p99_ms": p99, "decode_by_rows": self.decode, "kinds": self.kinds,
                       "phases": self.phases}, f)
        os.replace(tmp, self.path)

    def flush_idle(self) -> None:
        """Write what the engine has not, once no step was sampled for ``FLUSH_S`` (while steps
        run, the engine's own reads write: the thread keeps off its GIL)."""
        if time.perf_counter() - self.host_sampled >= FLUSH_S and (self.pending
                                                                   or self.unwritten):
            self.read(force=True)

    def start_flushing(self) -> None:
        """The thread that writes the steps completed after the engine's last ``read`` (the
        engine idle, or between a run's last step and the next run's first)."""
        import torch

        device = torch.cuda.current_device()  # the engine's: the events' device

        def flush() -> None:
            torch.cuda.set_device(device)
            while True:
                time.sleep(FLUSH_S)
                with contextlib.suppress(Exception):
                    self.flush_idle()

        threading.Thread(target=flush, name="step-timeline-flush", daemon=True).start()


_timeline: _Timeline | None = None  # this process's, whichever runner module it patched


def _patch(module: Any, name: str = V2) -> None:
    """Mark ``module``'s runner steps (``name``: which runner module it is)."""
    global _timeline
    if _timeline is None:
        _timeline = _Timeline(_FILE)
    timeline = _timeline
    runner = module.GPUModelRunner
    execute_model, sample_tokens = runner.execute_model, runner.sample_tokens

    @functools.wraps(execute_model)  # the plugin's hook binds its arguments by name
    def execute_model_marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):
            timeline.mark_begin(args[0] if args else kwargs.get("scheduler_output"))
        return execute_model(self, *args, **kwargs)

    forward_context = module.set_forward_context

    @functools.wraps(sample_tokens)
    def sample_tokens_marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = sample_tokens(self, *args, **kwargs)
        with contextlib.suppress(Exception):
            timeline.mark_sampled()
        return result

    @contextlib.contextmanager
    @functools.wraps(forward_context)
    def forward_context_marked(*args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):
            timeline.mark_forward()
        with forward_context(*args, **kwargs):
            yield

    runner.execute_model = execute_model_marked
    runner.sample_tokens = sample_tokens_marked
    module.set_forward_context = forward_context_marked
    if name != V2:  # V1 runs its FULL graphs inside set_forward_context too
        return
    from vllm.v1.worker.gpu import cudagraph_utils

    manager = cudagraph_utils.CudaGraphManager
    run_fullgraph = manager.run_fullgraph

    @functools.wraps(run_fullgraph)
    def run_fullgraph_marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):
            timeline.mark_forward()
        return run_fullgraph(self, *args, **kwargs)

    manager.run_fullgraph = run_fullgraph_marked


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a runner module right after it is imported, in whichever process does."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            try:
                _patch(module, name)
            except Exception as exc:  # the server runs unmeasured rather than not at all
                print(f"step timeline not installed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if _FILE:
    sys.meta_path.insert(0, _Finder())
