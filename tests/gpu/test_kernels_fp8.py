"""The cascade executors on an FP8 (e4m3) KV cache with per-layer scales, against an fp32
reference on the dequantised cache, with vLLM's flat FP8 FlashAttention 3 path as the yardstick.

vLLM's flat FP8 path (``FlashAttentionImpl.forward``, 0.26-0.33): the cache viewed as e4m3, the
query quantised to e4m3 by the Attention layer with ``_q_scale``, FA3 called with
``q/k/v_descale = layer._{q,k,v}_scale.expand(num_seqs, num_kv_heads)`` and a bf16 output.

FA3's FP8 forward runs both matrix products in FP8: it rounds the softmax weights P to e4m3
(3 mantissa bits) before P @ V, each relative to the running maximum of the keys that call sees.
A cascade level sees only its own keys, so its P is scaled and rounded differently from flat's:
the two differ at FP8's resolution, not bf16's, and neither is the exact answer. The fp32
reference (the very e4m3 values times their scales, softmax in fp32) decides: the cascade must be
within ``REFERENCE_TOL`` of it and no further from it than ``RELATIVE`` times flat FP8 FA3 is
(plus bf16's ``TOL`` for the output's own rounding). Each case's three deviations are written to
``kernel_correctness_fp8.json`` in ``CASCADE_RESULTS_DIR``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpu.test_kernels import (
    PAGE,
    TOL,
    Shape,
    four_interleaved_groups,
    one_shared_prefix,
    plan_for,
    sampling_siblings,
    two_level_tree,
)
from vllm_cascade_plugin.execution import vllm_kernels as compat
from vllm_cascade_plugin.execution.common import KvScales
from vllm_cascade_plugin.execution.kernels import fa3_unsupported_reason, make_executor

FP8 = torch.float8_e4m3fn
DEVICE = torch.device("cuda")
REFERENCE_TOL = 3e-2  # e4m3's relative step 2^-4 on weights that average >= 256 keys
RELATIVE = 1.5  # the cascade's deviation from the reference, against flat FP8 FA3's
MEASURED: list[dict] = []
SCENARIOS = {"one_shared_prefix": one_shared_prefix, "four_interleaved_groups":
             four_interleaved_groups, "two_level_tree": two_level_tree,
             "sampling_siblings": sampling_siblings}


def scales() -> KvScales:
    values = (0.02, 0.011, 0.009)
    t = [torch.tensor(v, dtype=torch.float32, device=DEVICE) for v in values]
    return KvScales(*t, *values)


def fp8_layer(batch, shape: Shape, s: KvScales, seed: int):
    """(q as FP8 and bf16, K and V e4m3 halves of one packed cache)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    hq, hkv, d = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    q = torch.randn(batch.num_tokens, hq, d, generator=gen, device=DEVICE)
    packed = torch.randn(batch.num_blocks, PAGE, hkv, 2 * d, generator=gen, device=DEVICE)
    packed[..., :d] /= s.k_float
    packed[..., d:] /= s.v_float
    k, v = packed.clamp(-448, 448).to(FP8).split(d, dim=-1)
    q8 = (q / s.q_float).clamp(-448, 448).to(FP8)
    return q8, (q8.float() * s.q_float).to(torch.bfloat16), k, v


def flat_fa3_fp8(batch, q8, k, v, shape: Shape, s: KvScales) -> torch.Tensor:
    """vLLM's flat FP8 FlashAttention call, as its FlashAttentionImpl.forward makes it."""
    attention, _ = compat.fa3_kernels()
    cu_q = torch.from_numpy(np.concatenate([[0], np.cumsum(batch.query_lens)]).astype(np.int32))
    shape2 = (len(batch.seq_lens), shape.num_kv_heads)
    out = torch.empty(q8.shape, dtype=torch.bfloat16, device=DEVICE)
    attention(q=q8, k=k, v=v, out=out, cu_seqlens_q=cu_q.to(DEVICE),
              max_seqlen_q=int(batch.query_lens.max()),
              seqused_k=torch.from_numpy(batch.seq_lens).to(DEVICE),
              max_seqlen_k=int(batch.seq_lens.max()), softmax_scale=shape.sm_scale, causal=True,
              block_table=torch.from_numpy(batch.block_table).to(DEVICE),
              q_descale=s.q.expand(shape2), k_descale=s.k.expand(shape2),
              v_descale=s.v.expand(shape2), fa_version=3)
    return out


def dense_fp32(batch, q, k, v, shape: Shape, s: KvScales) -> torch.Tensor:
    """Per-request causal softmax attention in fp32 on the dequantised values."""
    group = shape.num_qo_heads // shape.num_kv_heads
    outs, start = [], 0
    for r in range(len(batch.seq_lens)):
        n, total = int(batch.query_lens[r]), int(batch.seq_lens[r])
        pages = torch.from_numpy(batch.block_table[r, : -(-total // PAGE)].astype(np.int64))
        keys = (k[pages.to(DEVICE)].float() * s.k_float).reshape(-1, shape.num_kv_heads,
                                                                  shape.head_dim)[:total]
        values = (v[pages.to(DEVICE)].float() * s.v_float).reshape(-1, shape.num_kv_heads,
                                                                    shape.head_dim)[:total]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + n].float(), keys) * shape.sm_scale
        future = torch.arange(total, device=DEVICE)[None, :] > torch.arange(
            total - n, total, device=DEVICE)[:, None]
        scores = scores.masked_fill(future, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values))
        start += n
    return torch.cat(outs)


@pytest.fixture
def workspace() -> torch.Tensor:
    return torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=DEVICE)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kernel", ["fa3", "fa3_unfused", "flashinfer"])
@pytest.mark.parametrize("query_fp8", [True, False], ids=["q_fp8", "q_bf16"])
def test_fp8_cascade_matches_flat_fp8_fa3_and_the_fp32_reference(scenario, kernel, query_fp8,
                                                                 workspace):
    if (reason := fa3_unsupported_reason("NHD")) is not None:
        pytest.skip(reason)  # vLLM's flat FP8 path (the yardstick) is FA3
    if kernel == "flashinfer" and query_fp8:
        pytest.skip("FlashInfer's cascade takes a 16-bit query (the builder refuses FP8 ones)")
    shape, s = Shape(32, 8, 128), scales()
    batch = SCENARIOS[scenario](np.random.default_rng(0))
    plan = plan_for(batch)
    executor = make_executor("fa3" if kernel.startswith("fa3") else kernel, workspace, "NHD",
                             max_levels=4, fused_decode=kernel == "fa3")
    executor.plan(plan, num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
                  head_dim=shape.head_dim, page_size=PAGE, sm_scale=shape.sm_scale,
                  logits_soft_cap=None, q_dtype=torch.bfloat16, kv_dtype=FP8, device=DEVICE)
    q8, q16, k, v = fp8_layer(batch, shape, s, seed=1)
    out = torch.full(q8.shape, math.nan, dtype=torch.bfloat16, device=DEVICE)
    executor.run(q8 if query_fp8 else q16, k, v, out, s)
    flat = flat_fa3_fp8(batch, q8, k, v, shape, s)
    reference = dense_fp32(batch, q8.float() * s.q_float, k, v, shape, s)
    cascade_error = (out.float() - reference).abs().max().item()
    flat_error = (flat.float() - reference).abs().max().item()
    MEASURED.append({"scenario": scenario, "kernel": kernel, "query": "fp8" if query_fp8
                     else "bf16", "cascade_vs_reference": cascade_error,
                     "flat_fa3_vs_reference": flat_error,
                     "cascade_vs_flat_fa3": (out.float() - flat.float()).abs().max().item()})
    assert flat_error <= REFERENCE_TOL  # the yardstick itself
    assert cascade_error <= REFERENCE_TOL
    assert cascade_error <= RELATIVE * flat_error + TOL, MEASURED[-1]


def test_fp8_decode_kernel_matches_the_fp32_reference():
    from vllm_cascade_plugin.execution import decode_level

    shape, s = Shape(32, 8, 128), scales()
    batch = one_shared_prefix(np.random.default_rng(2))
    rows = len(batch.seq_lens)
    q8, _, k, v = fp8_layer(batch, shape, s, seed=3)
    table = torch.from_numpy(batch.block_table).to(DEVICE)
    lens = torch.from_numpy(batch.seq_lens).to(DEVICE)
    state = torch.zeros(rows, shape.num_qo_heads, shape.head_dim, dtype=torch.bfloat16,
                        device=DEVICE)
    lse = torch.full((shape.num_qo_heads, rows), -math.inf, device=DEVICE)
    decode_level.decode_level(q8, k, v, table, lens, state, lse, state, lse,
                              sm_scale=shape.sm_scale, scales=s.tensors())
    want = dense_fp32(batch, q8.float() * s.q_float, k, v, shape, s)
    # The kernel's products are exact (e4m3 in fp16) and P is rounded to fp16: bf16 output.
    assert (state.float() - want).abs().max().item() <= TOL


def teardown_module() -> None:
    from gpu import engines

    engines.write_results("kernel_correctness_fp8", MEASURED)
