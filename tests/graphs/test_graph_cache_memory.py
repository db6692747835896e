"""The CUDA-graph caches leave vLLM its memory: no capture while the GPU is low on free memory.

vLLM sizes its KV cache without the plugin's graphs, whose pools then grow into what is left. A
cache asks how much memory is free (``GraphCache.free_memory``, ``cudaMemGetInfo`` on a GPU)
before each capture; below ``graphs.MIN_FREE_BYTES`` the capture is skipped and that run is
eager, and free memory is read again only after ``graphs.LOW_MEMORY_RECHECK_S``.
"""

from __future__ import annotations

import logging

import torch

from test_fa3_executor_cpu import replaying_capture
from vllm_cascade_plugin.graphs import capture as graphs_module
from vllm_cascade_plugin.graphs.capture import LayerGraphs

GIB = 1 << 30


def _layer(runs: list[str], name: str):
    return lambda: runs.append(name) or torch.full((1,), float(len(runs)))


def test_low_free_memory_skips_captures_runs_eagerly_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(graphs_module, "_warned_low_memory", False)
    clock = [100.0]
    monkeypatch.setattr(graphs_module.time, "monotonic", lambda: clock[0])
    free = [GIB // 2]
    reads = []

    def free_memory():
        reads.append(clock[0])
        return free[0]

    cache = LayerGraphs(capture=replaying_capture, capture_after=1)
    cache.free_memory = free_memory
    runs: list[str] = []
    with caplog.at_level(logging.WARNING, logger="vllm.cascade_plugin"):
        cache.run(("a",), _layer(runs, "a"))  # the cache's first run: eager, nothing asked
        for _ in range(3):  # due each time, skipped each time: eager runs, no graph
            out = cache.run(("b",), _layer(runs, "b"))
            assert out.item() == len(runs)  # this run's own result
    assert runs == ["a", "b", "b", "b"]
    assert (cache.captures, len(cache), cache.skipped) == (0, 0, 3)
    assert reads == [100.0]  # once low, not read again before the recheck time
    warnings = [r.getMessage() for r in caplog.records if "GPU memory free" in r.getMessage()]
    assert len(warnings) == 1 and "0.50 GiB" in warnings[0], warnings
    assert "--gpu-memory-utilization" in warnings[0]

    free[0] = 4 * GIB  # memory freed, but the recheck time has not come: still skipped
    clock[0] += graphs_module.LOW_MEMORY_RECHECK_S / 2
    cache.run(("b",), _layer(runs, "b"))
    assert (cache.captures, cache.skipped, len(reads)) == (0, 4, 1)

    clock[0] += graphs_module.LOW_MEMORY_RECHECK_S  # read again: enough, captured and replayed
    cache.run(("b",), _layer(runs, "b"))
    cache.run(("b",), _layer(runs, "b"))
    assert (cache.captures, cache.replays, cache.skipped, len(reads)) == (1, 1, 4, 2)
    assert len([r for r in caplog.records if "GPU memory free" in r.getMessage()]) == 1


def test_enough_free_memory_captures_as_without_the_check(monkeypatch):
    cache = LayerGraphs(capture=replaying_capture, capture_after=1)
    cache.free_memory = lambda: graphs_module.MIN_FREE_BYTES
    runs: list[str] = []
    for key in ("a", "b", "b"):
        cache.run((key,), _layer(runs, key))
    assert (cache.captures, cache.replays, cache.skipped) == (1, 1, 0)


def test_an_unreadable_free_memory_does_not_stop_captures():
    def broken():
        raise RuntimeError("no CUDA here")

    cache = LayerGraphs(capture=replaying_capture, capture_after=1)
    cache.free_memory = broken
    runs: list[str] = []
    for key in ("a", "b", "b"):
        cache.run((key,), _layer(runs, key))
    assert (cache.captures, cache.replays, cache.skipped) == (1, 1, 0)


def test_the_real_capture_reads_cuda_free_memory_and_a_stand_in_does_not():
    assert LayerGraphs().free_memory is graphs_module.cuda_free_bytes
    assert LayerGraphs(capture=replaying_capture).free_memory is None
