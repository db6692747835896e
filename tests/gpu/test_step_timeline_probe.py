"""The serving benchmark's step-timeline probe (benchmarks/serve/probes/step_timeline/) on real
CUDA events: the thread that writes the steps completed once the engine idles queries the
engine thread's events from its own thread, on the engine's device."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
import types
from pathlib import Path

import torch

PROBE = (Path(__file__).resolve().parents[2] / "benchmarks" / "serve" / "probes" / "step_timeline"
         / "sitecustomize.py")


def test_the_probe_writes_a_runs_last_steps_once_the_engine_idles(tmp_path, monkeypatch):
    """Three steps back to back (matmuls, two requests, one a prefill): the engine thread
    writes once, at the first step (which it may not have counted yet: its events complete
    later), and the rest is the flushing thread's to write once no step was sampled for
    FLUSH_S; their GPU time is the matmuls', and the mixed phase holds them all."""
    monkeypatch.delenv("CASCADE_BENCH_TIMELINE_FILE", raising=False)  # no import hook
    spec = importlib.util.spec_from_file_location("step_timeline_probe_gpu", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    path = tmp_path / "timeline.json"
    timeline = probe._Timeline(str(path))
    a = torch.randn(2048, 2048, device="cuda")
    scheduled = types.SimpleNamespace(total_num_scheduled_tokens=9,
                                      num_scheduled_tokens={"a": 1, "b": 8})
    for _ in range(3):
        timeline.mark_begin(scheduled)
        timeline.mark_forward()
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        timeline.mark_sampled()
    assert json.loads(path.read_text())["steps"] in (0, 1)  # written at the first step only
    assert any(t.name == "step-timeline-flush" and t.daemon for t in threading.enumerate())
    deadline = time.monotonic() + 5.0
    got: dict = {}
    while time.monotonic() < deadline:
        got = json.loads(path.read_text())
        if got["steps"] == 3:
            break
        time.sleep(0.05)
    assert got["steps"] == 3, got
    assert got["gpu_step_ms"] > 0.0 and got["rows"] == 6 and got["tokens"] == 27
    assert got["phases"]["mixed"]["steps"] == 3 and got["phases"]["decode"]["steps"] == 0
