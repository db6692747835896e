"""The per-process counters, the periodic log line (on a fake clock) and the Prometheus metrics."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_cascade_plugin import stats
from vllm_cascade_plugin.stats.prometheus import PrometheusCounters

PAGE_BYTES = 2 * 16 * 8 * 128 * 2 * 32  # K+V, 16 tokens, 8 kv heads, d=128, bf16, 32 layers


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(stats, "_clock", fake)
    monkeypatch.setenv("CASCADE_LOG_INTERVAL", "60")
    monkeypatch.setattr(stats, "_page_bytes", 0)
    stats.reset()
    yield fake
    stats.reset()


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "vllm.cascade_plugin" and "last" in r.getMessage()]


def cascade_step(decode: bool = True) -> None:
    stats.record_planned(decode)
    stats.record_cascade(pages_flat=1000, pages_cascade=100, decode=decode)


def test_no_line_before_the_interval_then_one_line_with_the_interval_numbers(clock, caplog):
    caplog.set_level(logging.INFO, logger="vllm.cascade_plugin")
    stats.set_page_bytes(PAGE_BYTES)
    for i in range(3):
        cascade_step()
        if i:  # two of the three replayed a CUDA graph
            stats.record_graphed_step()
        clock.now += 10
    stats.record_planned(decode=False)  # a mixed step that ran flat, planned from scratch
    stats.plan_path(stats.counters.PATH_SCRATCH)
    stats.record_fallback("kernel error", level=logging.DEBUG)
    stats.record_capture(0.5)
    stats.record_capture(0.25)
    stats.record_planning(0.0011, 0.00044)  # this step's: the 1 ms - 1.5 ms bucket, 40% on a CPU
    # A quarter staging (a tenth in launches), 80% on a CPU.
    stats.record_builder(0.0006, 0.00015, 0.00048, 0.00006)
    assert lines(caplog) == []
    clock.now += 31  # 61 s after the first planned step
    stats.record_planned(decode=True)
    [line] = lines(caplog)
    # Planning per step: three steps of 0 s, one of 1.1 ms: the median in the first bucket
    # (0-5 us, interpolated at 2/3 of it), p99 in the 1-1.5 ms one (96% of the way up).
    # Host time: planning, builders and captures, over the 4 steps; the builders' over the 3
    # cascade steps.
    assert ("last 61 s: 4 steps, 75.0% ran cascade (decode steps: 100.0%, 66.7% of them from "
            "CUDA graphs; 2 graphs captured in 0.75 s; planning 0.00 s (40.0% of it on a CPU), "
            "per step p50 3 us, p99 1480 us, by path: other 75.0% (0 us), from scratch 25.0% "
            "(1100 us); host time 187925 us per step, metadata 200 us per cascade step (25.0% "
            "of it staging uploads, 10.0% launches, 80.0% on a CPU))") in line
    assert "flat steps: kernel error 1; fallbacks: kernel error 1" in line
    assert "300 instead of 3,000 flat" in line
    saved = 2700 * PAGE_BYTES / 1e9
    assert f"{saved:.2f} GB saved ({saved:.2f} GB since start)" in line


def test_second_line_counts_only_its_own_interval(clock, caplog):
    caplog.set_level(logging.INFO, logger="vllm.cascade_plugin")
    stats.set_page_bytes(PAGE_BYTES)
    cascade_step()
    clock.now += 60
    stats.record_planned(decode=True)  # first line: the cascade step before this one
    clock.now += 59
    stats.record_planned(decode=True)
    assert len(lines(caplog)) == 1
    clock.now += 1
    stats.record_planned(decode=True)  # second line: the 2 flat steps since the first
    first, second = lines(caplog)
    assert "last 60 s: 1 steps, 100.0% ran cascade" in first
    assert "last 60 s: 2 steps, 0.0% ran cascade" in second and "fallbacks: none" in second
    assert f"flat steps: {stats.counters.UNUSED} 2;" in second  # nothing said why
    assert "0 instead of 0 flat, 0 B saved (" in second


def test_an_idle_worker_logs_nothing_and_resumes_on_the_next_step(clock, caplog):
    caplog.set_level(logging.INFO, logger="vllm.cascade_plugin")
    cascade_step()
    clock.now += 3600  # idle: no step, no line
    assert lines(caplog) == []
    cascade_step()
    [line] = lines(caplog)
    assert "last 3600 s: 1 steps" in line and "bytes unknown" in line


def test_interval_zero_turns_the_line_off(clock, caplog, monkeypatch):
    monkeypatch.setenv("CASCADE_LOG_INTERVAL", "0")
    stats.reset()
    caplog.set_level(logging.INFO, logger="vllm.cascade_plugin")
    for _ in range(5):
        cascade_step()
        clock.now += 1e6
    assert lines(caplog) == []
    assert stats.snapshot().steps_cascade == 5


def test_interval_is_read_once(clock, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="vllm.cascade_plugin")
    cascade_step()
    monkeypatch.setenv("CASCADE_LOG_INTERVAL", "5")  # too late: read on the first step
    clock.now += 30
    cascade_step()
    assert lines(caplog) == []


def test_snapshot_is_a_copy(clock):
    stats.record_fallback("x", level=logging.DEBUG)
    snap = stats.snapshot()
    snap.fallbacks["x"] += 10
    assert stats.snapshot().fallbacks["x"] == 1


def test_prometheus_counters_publish_what_was_counted():
    from collections import Counter

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    counters = PrometheusCounters(registry, tp_rank="0")
    counters.publish(stats.Counters(
        steps_planned=2, decode_steps_planned=1, steps_cascade=1, decode_steps_cascade=1,
        pages_flat=1000, pages_cascade=100, fallbacks=Counter({"kernel error": 1}),
        decode_steps_graphed=1, graph_capture_failures=1, graph_captures=2,
        graph_capture_s=0.75, planning_s=0.125, planning_cpu_s=0.0625, graph_pool_bytes=4096),
        page_bytes=10)
    counters.publish(stats.Counters(steps_planned=1, graph_pool_bytes=8192), page_bytes=10)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"vllm_cascade_{name}_total", {"tp_rank": "0", **labels})

    assert value("steps_planned") == 3 and value("decode_steps_planned") == 1
    assert value("steps_cascade") == 1 and value("decode_steps_cascade") == 1
    assert value("kv_pages_flat") == 1000 and value("kv_pages_cascade") == 100
    assert value("kv_bytes_saved") == 9000
    assert value("fallbacks", reason="kernel error") == 1
    assert value("decode_steps_graphed") == 1 and value("graph_capture_failures") == 1
    assert value("graph_captures") == 2 and value("graph_capture_seconds") == 0.75
    assert value("planning_seconds") == 0.125 and value("planning_cpu_seconds") == 0.0625
    assert registry.get_sample_value("vllm_cascade_graph_pool_bytes", {"tp_rank": "0"}) == 8192


WORKER = """
from vllm_cascade_plugin import stats
stats.set_page_bytes(10)
stats.record_planned(True)
stats.record_cascade(1000, 100, True)
stats.record_fallback("kernel error")
stats.record_planned(True)
stats.plan_path(stats.counters.PATH_CONTINUED)
stats.flat_decision("cost model", 1.5)
stats.end_step()
"""

API_SERVER = """
from prometheus_client import generate_latest
from vllm.v1.metrics.prometheus import get_prometheus_registry
print(generate_latest(get_prometheus_registry()).decode())
"""


def test_worker_counters_reach_vllms_metrics_registry_in_multiprocess_mode(tmp_path):
    """A worker process counts; vLLM's /metrics registry, in another process, shows the sums."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASCADE_")}
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    for _ in range(2):  # two worker processes (e.g. two data-parallel engines) add up
        subprocess.run([sys.executable, "-c", textwrap.dedent(WORKER)], env=env, check=True,
                       capture_output=True, timeout=120)
    served = subprocess.run([sys.executable, "-c", textwrap.dedent(API_SERVER)], env=env,
                            check=True, capture_output=True, text=True, timeout=300).stdout
    assert 'vllm_cascade_steps_cascade_total{tp_rank="0"} 2.0' in served
    assert 'vllm_cascade_kv_bytes_saved_total{tp_rank="0"} 18000.0' in served
    assert 'vllm_cascade_fallbacks_total{reason="kernel error",tp_rank="0"} 2.0' in served
    assert 'vllm_cascade_flat_steps_total{reason="cost model",tp_rank="0"} 2.0' in served
    assert 'vllm_cascade_flat_cost_ratio_total{reason="cost model",tp_rank="0"} 3.0' in served
    assert 'vllm_cascade_step_planning_seconds_count{tp_rank="0"} 4.0' in served
    assert 'vllm_cascade_planning_path_steps_total{path="continued",tp_rank="0"} 2.0' in served
    assert 'vllm_cascade_planning_path_steps_total{path="other",tp_rank="0"} 2.0' in served


def test_planning_time_counts_what_the_thread_ran_on_a_cpu_apart_from_waiting():
    """A planning block that sleeps (as one waiting for the GIL does) is all wall time; one that
    computes is mostly CPU time."""
    import time

    with stats.planning():
        time.sleep(0.02)
    slept = stats.snapshot()
    assert slept.planning_s >= 0.02 and slept.planning_cpu_s < 0.5 * slept.planning_s
    with stats.planning():  # 20 ms on a CPU, however loaded the machine (wall time: more)
        start = time.thread_time()
        while time.thread_time() - start < 0.02:
            pass
    busy = stats.snapshot()
    assert busy.planning_cpu_s - slept.planning_cpu_s >= 0.0199
    # Wall time at least the CPU time, up to the two clocks being read a moment apart (a
    # thread that ran the whole block may show a few µs more CPU than wall time).
    assert busy.planning_s - slept.planning_s >= busy.planning_cpu_s - slept.planning_cpu_s - 1e-3


def test_a_forked_worker_publishes_its_own_counts_not_its_parents_again(tmp_path):
    """A parent that counted and published forks a child that counts one step: the metrics
    of both processes together hold each step once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASCADE_")}
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    script = textwrap.dedent("""
        import os
        from vllm_cascade_plugin import stats
        stats.record_planned(True)
        stats.record_planned(True)
        stats.end_step()
        stats.snapshot()  # published: 2 steps
        pid = os.fork()
        if pid == 0:
            stats.record_planned(False)
            stats.end_step()
            stats.snapshot()
            os._exit(0)
        os.waitpid(pid, 0)
    """)
    subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True,
                   timeout=120)
    served = subprocess.run([sys.executable, "-c", textwrap.dedent(API_SERVER)], env=env,
                            check=True, capture_output=True, text=True, timeout=300).stdout
    assert 'vllm_cascade_steps_planned_total{tp_rank="0"} 3.0' in served
    assert 'vllm_cascade_decode_steps_planned_total{tp_rank="0"} 2.0' in served
