"""Where a served step's time goes: vLLM's torch profiler over a few seconds of steady serving,
and a summary of its trace that two configs can be compared by.

``serve/bench.py --profile 110%`` starts every server with vLLM's ``--profiler-config`` (torch
profiler, no Python stacks, no frontend trace) and, after a workload's measured runs, runs that
rate once more (the same prompts; its row is not recorded: writing a trace stalls the engine)
with ``/start_profile`` posted once 40% of its arrivals have been sent and ``/stop_profile``
``--profile-s`` seconds later. :func:`summarize` reads the worker's trace:

- the GPU timeline: span, busy time (union of kernels, copies and memsets), idle time and the
  idle gaps by length, the longest with the host calls that ran inside them;
- the host's CUDA runtime calls by name (count, total, longest), those that wait for the GPU
  (synchronisations, blocking copies, page-locked allocations) apart;
- kernels by name (GPU time, count) and CUDA-graph launches and instantiations (captures).

Usage: ``python3 -m benchmarks.serve.profiler TRACE.json[.gz] [...]`` prints the summaries.
"""

from __future__ import annotations

import bisect
import gzip
import json
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Host calls that wait for the device (or may: a page-locked allocation or free synchronises).
WAITING_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                 "cudaMemcpy", "cudaMemcpy2D", "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost",
                 "cudaHostRegister", "cudaHostUnregister", "cudaFree", "cudaStreamWaitEvent")
GAP_BOUNDS_MS = (0.05, 0.5, 2.0, 10.0)
TOP = 15


def profiler_args(trace_dir: Path) -> list[str]:
    """``vllm serve`` arguments that make ``/start_profile`` and ``/stop_profile`` write a torch
    trace of the worker to ``trace_dir`` (absolute)."""
    config = {"profiler": "torch", "torch_profiler_dir": str(trace_dir.resolve()),
              "torch_profiler_with_stack": False, "ignore_frontend": True,
              "torch_profiler_dump_cuda_time_total": False}
    return ["--profiler-config", json.dumps(config)]


class Window:
    """The poll of a profiled run: ``/start_profile`` once ``start_s`` have passed since the
    first poll, ``/stop_profile`` ``length_s`` later. Failures are printed, never raised."""

    def __init__(self, url: str, start_s: float, length_s: float):
        self.url, self.start_s, self.length_s = url, start_s, length_s
        self.t0: float | None = None
        self.state = "waiting"

    def _post(self, path: str) -> None:
        request = urllib.request.Request(self.url + path, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=300):
                pass
        except OSError as exc:
            print(f"  {path} failed: {type(exc).__name__}: {exc}", file=sys.stderr)

    def __call__(self) -> None:
        now = time.monotonic()
        self.t0 = now if self.t0 is None else self.t0
        if self.state == "waiting" and now - self.t0 >= self.start_s:
            self._post("/start_profile")
            self.state, self.t0 = "profiling", time.monotonic()
        elif self.state == "profiling" and now - self.t0 >= self.length_s:
            self._post("/stop_profile")
            self.state = "done"

    def finish(self) -> None:
        """Stops a profile the run ended inside of."""
        if self.state == "profiling":
            self._post("/stop_profile")
            self.state = "done"


def _load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _by_name(events: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    longest: dict[str, float] = defaultdict(float)
    for e in events:
        name = e.get("name", "?")[:100]
        total[name] += e["dur"]
        count[name] += 1
        longest[name] = max(longest[name], e["dur"])
    ranked = sorted(total, key=total.__getitem__, reverse=True)[:top]
    return [{"name": n, "count": count[n], "total_ms": round(total[n] / 1e3, 3),
             "longest_ms": round(longest[n] / 1e3, 3)} for n in ranked]


def summarize(path: Path) -> dict[str, Any]:
    """The summary of one worker trace (times in ms; see the module docstring)."""
    events = [e for e in _load(path) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    if not gpu:
        return {"trace": path.name, "error": "no GPU events"}
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    span = busy[-1][1] - busy[0][0]
    gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    lengths = [(b - a) / 1e3 for a, b in gaps]
    starts = sorted((e["ts"], i) for i, e in enumerate(runtime))
    keys = [s for s, _ in starts]

    def inside(a: float, b: float) -> list[dict[str, Any]]:
        """The host calls that ran during the gap (a, b), longest first."""
        lo = bisect.bisect_left(keys, a - 50_000)  # calls that began up to 50 ms before
        calls = [runtime[i] for _, i in starts[lo:bisect.bisect_right(keys, b)]
                 if runtime[i]["ts"] + runtime[i]["dur"] > a]
        calls.sort(key=lambda e: -min(e["ts"] + e["dur"], b) + max(e["ts"], a))
        return [{"name": e["name"], "ms_in_gap": round((min(e["ts"] + e["dur"], b)
                                                         - max(e["ts"], a)) / 1e3, 3)}
                for e in calls[:4]]

    longest = sorted(range(len(gaps)), key=lambda i: -lengths[i])[:8]
    waiting = [e for e in runtime if e.get("name") in WAITING_CALLS]
    names = [e.get("name", "") for e in runtime]
    return {
        "trace": path.name,
        "span_ms": round(span / 1e3, 3),
        "gpu_busy_ms": round(sum(b - a for a, b in busy) / 1e3, 3),
        "gpu_idle_fraction": round(1 - sum(b - a for a, b in busy) / span, 4),
        "idle_gaps": {f">{bound}ms": {"count": sum(x > bound for x in lengths),
                                       "total_ms": round(sum(x for x in lengths if x > bound), 3)}
                      for bound in GAP_BOUNDS_MS},
        "longest_gaps": [{"ms": round(lengths[i], 3), "at_ms": round((gaps[i][0] - busy[0][0])
                                                                     / 1e3, 3),
                          "host_calls": inside(*gaps[i])} for i in longest],
        "graph_launches": names.count("cudaGraphLaunch"),
        "graph_instantiations": names.count("cudaGraphInstantiate")
        + names.count("cudaGraphInstantiateWithFlags"),
        "waiting_calls": _by_name(waiting, TOP),
        "runtime_calls": _by_name(runtime, TOP),
        "kernels": _by_name([e for e in gpu if e.get("cat") == "kernel"], TOP),
        "annotations": _by_name([e for e in events if e.get("cat") == "user_annotation"], TOP),
    }


def traces(trace_dir: Path) -> list[Path]:
    """The worker traces a profile wrote (``*.pt.trace.json[.gz]``), oldest first."""
    found = [*trace_dir.glob("**/*.pt.trace.json"), *trace_dir.glob("**/*.pt.trace.json.gz")]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for path in argv:
        print(json.dumps(summarize(Path(path)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
