"""What the soak reads inside the engine's worker process, through ``collective_rpc``: the
plugin's counters and device memory.

vLLM sends these functions with cloudpickle (``VLLM_ALLOW_INSECURE_SERIALIZATION``); the drive
registers this module to be pickled by value (``soak_drive.worker_functions_by_value``), so the
engine's processes need not import it from ``benchmarks/``, as for a function of ``__main__``.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def plugin_counters(worker: object) -> dict[str, Any]:
    from vllm_cascade_plugin import stats

    return stats.plain(stats.snapshot())


def device_memory(worker: object) -> dict[str, Any]:
    """Device memory in use, after the torch allocator returned its cache of freed blocks.

    Read between engine steps, with no request in flight: what remains is what lives (weights,
    KV cache, CUDA graphs, workspaces), so growth between two readings is a leak, not the
    allocator's high-water mark. ``used_raw_mib`` is the reading before emptying the cache.
    """
    import torch

    torch.cuda.synchronize()
    raw, _ = process_used_mib()
    torch.cuda.empty_cache()
    used, source = process_used_mib()
    return {"used_mib": used, "used_raw_mib": raw, "used_source": source,
            "total_mib": torch.cuda.mem_get_info()[1] / 2**20,
            "allocated_mib": torch.cuda.memory_allocated() / 2**20,
            "reserved_mib": torch.cuda.memory_reserved() / 2**20,
            "plugin_mib": plugin_mib(), "gpu": torch.cuda.get_device_name(),
            "executors": executors(), "graphs": graphs()}


def process_used_mib() -> tuple[float, str]:
    """This (engine) process's device memory, whatever else runs on the GPU: the driver's
    per-process figure (NVML: the CUDA context, every allocation, CUDA graphs) where it lists
    this process (it does not where the process ids are a container's own), else what torch's
    allocator holds (tensors and CUDA-graph pools). Returns (MiB, which of the two)."""
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return proc.usedGpuMemory / 2**20, "nvml process"
    except Exception:  # no NVML here: the allocator's figure below
        pass
    return torch.cuda.memory_reserved() / 2**20, "torch reserved"


def graphs() -> dict[str, int] | None:
    """The FA3 executor's per-layer CUDA graphs and the whole-step graphs of decode steps
    (held now: their pools are not in plugin_mib)."""
    kernels = sys.modules.get("vllm_cascade_plugin.execution.kernels")
    fullgraph = sys.modules.get("vllm_cascade_plugin.graphs.fullgraph")
    if kernels is None and fullgraph is None:
        return None
    return {**({} if kernels is None else kernels.graph_stats()),
            **({} if fullgraph is None else fullgraph.graph_stats())}


def executors() -> list[str]:
    """Which cascade executor ran (CASCADE_KERNEL): FlashInfer's or FA3."""
    kernels = sys.modules.get("vllm_cascade_plugin.execution.kernels")
    return [] if kernels is None else sorted({e.kernel for e in list(kernels.EXECUTORS)})


def plugin_mib() -> float | None:
    """The plugin's GPU buffers in this (engine) process; None where cascade cannot run."""
    kernels = sys.modules.get("vllm_cascade_plugin.execution.kernels")  # imported only where it can
    return None if kernels is None else kernels.device_bytes() / 2**20


def memory_sample(worker: object) -> dict[str, Any]:
    """Live torch allocations and the plugin's buffers, read under load (no sync, no emptying).

    Taken with every progress line: a leak grows steadily through the run, one-time growth
    (a buffer sized by the largest step so far) levels off.
    """
    import torch

    return {"allocated_mib": torch.cuda.memory_allocated() / 2**20, "plugin_mib": plugin_mib()}

