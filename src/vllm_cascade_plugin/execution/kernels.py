"""GPU executors of a :class:`~vllm_cascade_plugin.planning.planner.CascadePlan`, and which one
runs.

Two executors with one interface (``plan`` once per engine step on the host, ``run`` per layer,
neither reads anything back from the GPU):

- :class:`~vllm_cascade_plugin.execution.flashinfer.FlashInferCascadeExecutor`: one FlashInfer
  batch-prefill wrapper per level. Runs wherever vLLM's FlashInfer backend runs.
- :class:`~vllm_cascade_plugin.execution.fa3.FlashAttnCascadeExecutor`: vLLM's bundled
  FlashAttention 3, one varlen call per level, decode steps fused with the plugin's Triton
  kernel and replayed from CUDA graphs. Hopper only, NHD cache layout.

:func:`make_executor` picks one (``CASCADE_KERNEL``). Only vLLM workers import this module (it
imports torch; FlashInfer only once its executor is asked for, so a FLASH_ATTN engine on FA3
kernels never imports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .common import EXECUTORS, KERNELS, unsupported_reason
from .fa3 import FlashAttnCascadeExecutor
from .vllm_kernels import fa3_unsupported_reason

if TYPE_CHECKING:
    from .flashinfer import FlashInferCascadeExecutor

__all__ = ["EXECUTORS", "KERNELS", "FlashAttnCascadeExecutor", "FlashInferCascadeExecutor",
           "choose_kernel", "device_bytes", "fa3_unsupported_reason", "graph_stats",
           "make_executor", "unsupported_reason"]


def __getattr__(name: str) -> Any:
    if name == "FlashInferCascadeExecutor":  # imports flashinfer
        from .flashinfer import FlashInferCascadeExecutor

        return FlashInferCascadeExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def device_bytes() -> int:
    """GPU memory the plugin holds in this process beyond vLLM's (soak tests attribute growth).

    Scratch buffers plus each FlashInfer wrapper's int workspace; the float workspace is vLLM's
    own FlashInfer buffer, shared, and not counted. The CUDA-graph pools: :func:`graph_stats`.
    """
    return sum(executor.device_bytes() for executor in list(EXECUTORS))


def graph_stats() -> dict[str, int]:
    """The FA3 executors' per-layer CUDA graphs in this process: captured, replayed and evicted
    so far, held now, captures skipped for want of free GPU memory, and the bytes of their
    memory pools."""
    graphs = [g for g in (getattr(e, "graphs", None) for e in list(EXECUTORS)) if g is not None]
    return {"graph_captures": sum(g.captures for g in graphs),
            "graph_replays": sum(g.replays for g in graphs),
            "graph_evictions": sum(g.evictions for g in graphs),
            "graphs_held": sum(len(g) for g in graphs),
            "graph_captures_skipped": sum(g.skipped for g in graphs),
            "graph_pool_bytes": sum(g.pool_bytes() for g in graphs)}


def choose_kernel(requested: str, kv_layout: str) -> tuple[str, str]:
    """The executor kind for ``CASCADE_KERNEL=requested`` and a line saying which and why.

    ``auto`` takes FlashAttention 3 where it runs (Hopper, NHD cache) and FlashInfer otherwise;
    ``fa3`` asked for where it cannot run falls back to FlashInfer, and the line says so.
    """
    if requested not in ("auto", *KERNELS):
        raise ValueError(f"unknown cascade kernel {requested!r}; expected auto, "
                         f"{', '.join(KERNELS)}")
    if requested == "flashinfer":
        return "flashinfer", "cascade kernels: FlashInfer (CASCADE_KERNEL=flashinfer)"
    reason = fa3_unsupported_reason(kv_layout)
    if reason is None:
        return "fa3", f"cascade kernels: FlashAttention 3 (CASCADE_KERNEL={requested})"
    return "flashinfer", (f"cascade kernels: FlashInfer, because FlashAttention 3 cannot run: "
                          f"{reason} (CASCADE_KERNEL={requested})")


def make_executor(kind: str, float_workspace: torch.Tensor, kv_layout: str,
                  max_levels: int, fused_decode: bool = True, cuda_graphs: bool = False) -> Any:
    """A new executor of ``kind`` (from :func:`choose_kernel`); ``fused_decode`` and
    ``cuda_graphs``: the FA3 executor's (``CASCADE_FUSED_DECODE``, ``CASCADE_CUDA_GRAPHS``)."""
    if kind == "fa3":
        return FlashAttnCascadeExecutor(kv_layout, max_levels, fused_decode=fused_decode,
                                        cuda_graphs=cuda_graphs)
    if kind == "flashinfer":
        from .flashinfer import FlashInferCascadeExecutor

        return FlashInferCascadeExecutor(float_workspace, kv_layout, max_levels)
    raise ValueError(f"unknown cascade kernel {kind!r}; expected one of {KERNELS}")
