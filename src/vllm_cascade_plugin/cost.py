"""When does a cascade plan beat flat attention? A first analytic model, numpy/stdlib only.

Flat FlashInfer decode streams every row's KV pages; a cascade reads a group's shared pages
once but pays a fixed cost per level, a small cost per request, and runs each shared group as one
dense prefill whose KV streaming is limited by how few thread blocks one group keeps busy.
The defaults are fitted to one H200 layer call (bf16, 32 q / 8 kv heads, head_dim 128, page 16,
FlashInfer 0.6.14), decode with one shared prefix P and 128 own tokens per request:

======  =====  ==========  ============  ==========  =============
B       P      flat (ms)   cascade (ms)  model flat  model cascade
======  =====  ==========  ============  ==========  =============
8       512    0.064       0.105         0.042       0.117
64      2048   0.119       0.196         0.103       0.211
256     2048   0.351       0.441         0.294       0.472
128     8192   0.561       0.368         0.525       0.370
256     8192   1.062       0.539         1.009       0.544
64      32768  0.949       0.585         0.998       0.570
256     32768  3.697       0.807         3.873       0.831
======  =====  ==========  ============  ==========  =============

The model picks every measured winner, with the cascade within 11% and flat within 16% (34%
at the smallest point, where fixed costs dominate). Calibration on the device replaces these
numbers later.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .planner import CascadeLevel, CascadePlan

__all__ = ["AttentionShape", "CostModel", "Decision", "decide"]


@dataclass(frozen=True)
class AttentionShape:
    """The attention layer's shape; ``dtype_bytes`` is the KV cache element size."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int


@dataclass(frozen=True)
class CostModel:
    """Knobs of the model; times in microseconds, rates per second.

    flat_fixed_us : launch and split-KV merge of one flat FlashInfer decode call.
    flat_bandwidth : bytes/s a flat call streams KV at; above HBM's 4.8 TB/s because rows
        sharing pages hit in L2.
    level_fixed_us : launch and state merge per cascade level.
    request_us : per request per cascade call (the per-request level runs one-token rows
        through a prefill kernel); fitted: the cascade's intercept grows ~1.3 µs per request.
    flops : FLOP/s of a shared level's dense attention (``4 * head_dim`` FLOPs per query head
        and key token); fitted 400 TFLOP/s (200 overestimates B=256, P=32K by 40%).
    group_bandwidth : bytes/s one shared group streams its pages at: one group keeps only a few
        thread blocks busy, so this is far below HBM; fitted from the cascade's slope in P.
    shared_bandwidth : bytes/s all groups of one level together can reach (HBM).
    margin : the cascade must be faster by this fraction to be chosen (model error, noise).
    """

    flat_fixed_us: float = 40.0
    flat_bandwidth: float = 9e12
    level_fixed_us: float = 50.0
    request_us: float = 1.3
    flops: float = 400e12
    group_bandwidth: float = 0.35e12
    shared_bandwidth: float = 4e12
    margin: float = 0.1


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` chose, its two estimates (µs) and why, for logs."""

    use_cascade: bool
    flat_us: float
    cascade_us: float
    reason: str


def decide(plan: CascadePlan, shape: AttentionShape, model: CostModel = CostModel()) -> Decision:
    """Estimate flat and cascade attention for ``plan`` and pick the cheaper one.

    A plan without a shared level is never run as a cascade: it would be flat attention plus
    the cascade's overheads. Estimates are per layer call, in microseconds.
    """
    own = plan.levels[-1] if plan.levels else None
    if own is None:
        return Decision(False, 0.0, 0.0, "empty step")
    token_bytes = 2 * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes  # K and V
    flop_per_pair = 4 * shape.head_dim * shape.num_qo_heads  # QK^T and PV, all query heads

    def pairs(level: CascadeLevel) -> float:
        """Query-key token pairs of a level (full pages: the model's resolution)."""
        queries = np.diff(level.qo_indptr).astype(np.float64)  # float: int32 products overflow
        keys = np.diff(level.kv_page_indptr).astype(np.float64) * plan.page_size
        return float(queries @ keys)

    def stream_us(pages: int, flop: float, bandwidth: float) -> float:
        return 1e6 * max(pages * plan.page_size * token_bytes / bandwidth, flop / model.flops)

    # Flat reads every row's pages once; its query-key pairs are those of all levels together.
    all_pairs = sum(pairs(level) for level in plan.levels)
    flat_us = model.flat_fixed_us + stream_us(
        plan.stats.pages_flat, all_pairs * flop_per_pair, model.flat_bandwidth
    )
    if plan.num_levels < 2:
        return Decision(False, flat_us, flat_us, "no shared prefix")
    cascade_us = (
        plan.num_levels * model.level_fixed_us
        + plan.stats.num_requests * model.request_us
        + stream_us(len(own.kv_page_indices), pairs(own) * flop_per_pair, model.flat_bandwidth)
    )
    for level in plan.levels[:-1]:
        bandwidth = min(level.num_groups * model.group_bandwidth, model.shared_bandwidth)
        cascade_us += stream_us(len(level.kv_page_indices), pairs(level) * flop_per_pair, bandwidth)
    use_cascade = cascade_us * (1 + model.margin) < flat_us
    verdict = "cascade" if use_cascade else "flat"
    reason = f"{verdict}: cascade {cascade_us:.0f} us vs flat {flat_us:.0f} us"
    return Decision(use_cascade, flat_us, cascade_us, reason)
