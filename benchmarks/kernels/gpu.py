"""The kernel benchmark's GPU side (``kernels/bench.py``): the kernels every row reuses, the timer
(GPU time per call, free of launch gaps and of a warm L2), host timing and an fp32 reference.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.common import use_checkout
from benchmarks.kernels.grid import HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS, WORKSPACE_BYTES, Layout


class Gpu:
    """The heavy imports and the objects every row reuses (as vLLM keeps its wrappers)."""

    def __init__(self) -> None:
        use_checkout()
        import flashinfer
        import torch
        from vllm.v1.attention.backends.flash_attn import (
            cascade_attention,
            use_cascade_attention,
        )
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        from vllm_cascade_plugin.execution.kernels import (
            FlashInferCascadeExecutor,
            choose_kernel,
            make_executor,
        )

        if not torch.cuda.is_available():
            raise RuntimeError("the kernel benchmark needs a CUDA GPU")
        self.torch, self.flashinfer = torch, flashinfer
        self.flash_attn_varlen_func = flash_attn_varlen_func
        self.get_scheduler_metadata = get_scheduler_metadata
        self.cascade_attention = cascade_attention
        self.use_cascade_attention = use_cascade_attention
        self.device = torch.device("cuda")
        self.dtype = torch.bfloat16
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # One float workspace for every FlashInfer wrapper, as vLLM's builder shares its own.
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=False, use_tensor_cores=True, backend="auto")
        self.fi_cascade = flashinfer.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
        self.executors = {"flashinfer": FlashInferCascadeExecutor(workspace, "NHD", max_levels=3)}
        # What CASCADE_KERNEL=auto runs on this GPU: FA3 on Hopper, else FlashInfer.
        self.kernel, self.kernel_line = choose_kernel("auto", "NHD")
        if self.kernel == "fa3":
            self.executors["fa3"] = make_executor("fa3", workspace, "NHD", 3)

    def pinned(self, array: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(array, np.int32)).pin_memory()

    def on_device(self, array: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(array, np.int32)).to(self.device)


@dataclass(frozen=True)
class Timing:
    ms: float  # median GPU time per call
    ms_min: float
    host_us: float  # median host time to launch one call
    spin_us: float  # GPU spin before each repetition (must exceed host_us)


class Timer:
    """GPU time per call, free of host launch gaps and of a warm L2 (see the module docstring)."""

    def __init__(self, gpu: Gpu, reps: int, warmup: int, flush_mib: int = 256,
                 min_spin_us: float = 200.0) -> None:
        self.torch, self.reps, self.warmup, self.min_spin_us = gpu.torch, reps, warmup, min_spin_us
        self.flush_mib = flush_mib
        self.flush = gpu.torch.empty(max(flush_mib, 1) << 20, dtype=gpu.torch.uint8,
                                     device=gpu.device)
        self.cycles_per_us = self._calibrate()

    def _calibrate(self) -> float:
        torch = self.torch
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # first launch of the kernel
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        return cycles / (start.elapsed_time(end) * 1e3)

    def time(self, fn: Callable[[], Any]) -> Timing:
        torch = self.torch
        host = []
        for _ in range(self.warmup):
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        spin_us = max(self.min_spin_us, 3e6 * statistics.median(host))
        cycles = int(spin_us * self.cycles_per_us)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        host = []
        for start, end in zip(starts, ends, strict=True):
            if self.flush_mib:
                self.flush.zero_()
            torch.cuda._sleep(cycles)
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            end.record()
        torch.cuda.synchronize()
        ms = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
        return Timing(statistics.median(ms), min(ms), 1e6 * statistics.median(host), spin_us)


def host_us(fn: Callable[[], Any], reps: int) -> float:
    """Median host time of ``fn`` in µs (planning: no GPU sync inside)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)



def reference(gpu: Gpu, q: Any, k: Any, v: Any, layout: Layout, rows: Sequence[int],
              sm_scale: float) -> Any:
    """fp32 attention of ``rows`` from the cache, GQA as the kernels do (q head h -> kv h // 4)."""
    torch = gpu.torch
    per_kv = NUM_QO_HEADS // NUM_KV_HEADS
    outs = []
    for r in rows:
        pages = gpu.on_device(layout.block_table[r]).long()
        n = int(layout.seq_lens[r])
        keys = k[pages].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].float()
        values = v[pages].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].float()
        query = q[r].float().view(NUM_KV_HEADS, per_kv, HEAD_DIM)
        probs = torch.softmax(torch.einsum("hgd,nhd->hgn", query, keys) * sm_scale, dim=-1)
        outs.append(torch.einsum("hgn,nhd->hgd", probs, values).reshape(NUM_QO_HEADS, HEAD_DIM))
    return torch.stack(outs)
