"""The FA3 executor with an FP8 (e4m3) KV cache and per-layer scales, on the CPU.

FlashAttention 3 is the torch stand-in of tests/execution/test_fa3_executor_cpu.py, which takes
FP8 as FA3 does (q, K and V all e4m3, descales of shape (sequences, KV heads), bf16 output) and
applies the descales; decode steps' per-request level is the plugin's Triton kernel under the
CPU interpreter. The yardstick is independent of both: per-request attention in fp32
(``dense_attention``) on the dequantised cache (stored value x scale) and on the query vLLM's
FlashAttention layers hand the kernels: quantised to e4m3 with the layer's q scale.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_fa3_executor_cpu import (
    CALLS,
    TRITON_ON_CPU,
    fake_flash_attn_varlen_func,
    fake_merge_attn_states,
    replaying_capture,
)
from test_planner import batches, limits, make_batch
from test_reference import TOLERANCE, dense_attention, kv_cache
from vllm_cascade_plugin.execution import vllm_kernels
from vllm_cascade_plugin.execution.common import KvScales
from vllm_cascade_plugin.execution.fa3 import FlashAttnCascadeExecutor
from vllm_cascade_plugin.planning.planner import CascadePlanner

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def fake_fa3(monkeypatch):
    monkeypatch.setattr(vllm_kernels, "fa3_kernels",
                        lambda: (fake_flash_attn_varlen_func, fake_merge_attn_states))
    CALLS.clear()


def quantise(x, scale):
    """vLLM's FP8 quantisation, written out: ``x / scale`` saturated to +-448, rounded."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


def scales(q=0.021, k=0.0043, v=0.0029):
    """A layer's scales, far from 1 so that a scale not applied shows."""
    t = [torch.tensor(x, dtype=torch.float32) for x in (q, k, v)]
    return KvScales(*t, q, k, v)


def fp8_cache(num_blocks, page_size, kv_heads, head_dim, seed, s):
    """(K, V as stored: e4m3 halves of one packed cache; K, V dequantised, fp32)."""
    k, v = kv_cache(num_blocks, page_size, kv_heads, head_dim, torch.float32, seed)
    packed = torch.cat([quantise(k, s.k_float), quantise(v, s.v_float)], dim=-1)
    k8, v8 = packed.split(head_dim, dim=-1)
    return k8, v8, k8.float() * s.k_float, v8.float() * s.v_float


def query(rows, heads, dim, seed, s, arrives_fp8):
    """(the query the executor is given, its value as FA3 reads it: the e4m3 query x q_scale).
    vLLM's FLASH_ATTN layers hand an FP8 query; FLASHINFER's hand a bf16 one."""
    q = torch.randn(rows, heads + 2, dim, generator=torch.Generator().manual_seed(seed)) * 1.5
    q = q[:, :heads]  # strided, like vLLM's view of the fused QKV output
    if arrives_fp8:
        given = quantise(q, s.q_float)
        return given, given.float() * s.q_float
    given = q.to(torch.bfloat16)
    return given, quantise(given, s.q_float).float() * s.q_float


def planned(plan, heads, kv_heads, dim, executor=None, soft_cap=None, fused=True):
    executor = executor or FlashAttnCascadeExecutor("NHD", max_levels=4, fused_decode=fused)
    executor.plan(plan, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                  page_size=plan.page_size, sm_scale=dim**-0.5, logits_soft_cap=soft_cap,
                  q_dtype=torch.bfloat16, kv_dtype=FP8, device=torch.device("cpu"))
    return executor


# Outputs: bf16 (FA3's output dtype for FP8 input), as the bf16 cascade is held to (each level
# and merge rounds to bf16 once; values below 1 in magnitude). The LSE is fp32 throughout and
# the logits are products of the same e4m3 values on both sides.
OUT_TOL, LSE_TOL = TOLERANCE[torch.bfloat16], 1e-4


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_requests=6), limits=limits, group_size=st.sampled_from([1, 4]),
       soft_cap=st.sampled_from([None, 5.0]), decode=st.booleans(), fused=st.booleans(),
       arrives_fp8=st.booleans(), seed=st.integers(0, 2**16))
def test_fp8_cascade_equals_attention_on_the_dequantised_cache(batch, limits, group_size,
                                                               soft_cap, decode, fused,
                                                               arrives_fp8, seed):
    if decode:
        batch = dataclasses.replace(batch, query_lens=np.minimum(batch.query_lens, 1))
    fused = fused and TRITON_ON_CPU
    plan = batch.plan(**{**limits, "max_levels": min(limits["max_levels"], 4)})
    if plan.stats.num_tokens == 0:
        return
    CALLS.clear()
    kv_heads, dim, s = 2, 64, scales()
    heads = group_size * kv_heads
    k8, v8, k_deq, v_deq = fp8_cache(batch.num_blocks, batch.page_size, kv_heads, dim, seed, s)
    q, q_deq = query(plan.stats.num_tokens, heads, dim, seed + 1, s, arrives_fp8)
    executor = planned(plan, heads, kv_heads, dim, soft_cap=soft_cap, fused=fused)
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16)
    executor.run(q, k8, v8, out, s)
    want, want_lse = dense_attention(batch, q_deq, k_deq, v_deq, dim**-0.5, soft_cap)
    torch.testing.assert_close(out.float(), want, atol=OUT_TOL, rtol=OUT_TOL)
    torch.testing.assert_close(executor.lse, want_lse, atol=LSE_TOL, rtol=LSE_TOL)
    assert CALLS and all(c["fp8"] for c in CALLS)  # every FA3 level read FP8 q, K and V


def two_prefix_decode_step():
    """Six requests, two prefixes (interleaved rows: the shared level gathers its queries)."""
    table = [[1, 2, 3, 10 + r] if r % 2 else [4, 5, 6, 7, 20 + r] for r in range(6)]
    seq_lens = [3 * 16 + 5 + r if r % 2 else 4 * 16 + 9 for r in range(6)]
    return make_batch(table, seq_lens, [1] * 6, page_size=16)


@pytest.mark.parametrize("fused", [False, True])
def test_each_scale_is_applied(fused):
    """Every one of the three scales changes the answer (so the test above would see one
    dropped): the same bytes under a layer's scales with one of them doubled differ from the
    reference by more than the tolerance."""
    if fused and not TRITON_ON_CPU:
        pytest.skip("needs Triton (its CPU interpreter)")
    batch = two_prefix_decode_step()
    plan = CascadePlanner().plan(batch.block_table, batch.seq_lens, batch.query_lens, 16)
    assert plan.num_levels == 2
    heads, kv_heads, dim, s = 8, 2, 64, scales()
    k8, v8, k_deq, v_deq = fp8_cache(32, 16, kv_heads, dim, 3, s)
    q, q_deq = query(6, heads, dim, 4, s, arrives_fp8=True)
    want, _ = dense_attention(batch, q_deq, k_deq, v_deq, dim**-0.5)
    executor = planned(plan, heads, kv_heads, dim, fused=fused)
    assert executor._step.fused_decode is fused
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    executor.run(q, k8, v8, out, s)
    torch.testing.assert_close(out.float(), want, atol=OUT_TOL, rtol=OUT_TOL)
    for field in ("q", "k", "v"):
        changed = dataclasses.replace(s, **{field: getattr(s, field) * 2})
        executor.run(q, k8, v8, out, changed)
        assert (out.float() - want).abs().max() > 5 * OUT_TOL, field


def test_fp8_needs_scales_an_fp8_cache_and_bf16_output():
    batch = two_prefix_decode_step()
    plan = CascadePlanner().plan(batch.block_table, batch.seq_lens, batch.query_lens, 16)
    s = scales()
    k8, v8, *_ = fp8_cache(32, 16, 2, 64, 3, s)
    q, _ = query(6, 8, 64, 4, s, arrives_fp8=True)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    executor = planned(plan, 8, 2, 64)
    with pytest.raises(ValueError, match="no scales"):
        executor.run(q, k8, v8, out)
    with pytest.raises(ValueError, match="FP8 cache"):
        executor.run(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), out, s)
    with pytest.raises(RuntimeError, match="bf16"):
        executor.plan(plan, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                      sm_scale=0.125, logits_soft_cap=None, q_dtype=torch.float16,
                      kv_dtype=FP8, device=torch.device("cpu"))
    executor.plan(plan, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                  sm_scale=0.125, logits_soft_cap=None, q_dtype=torch.bfloat16,
                  kv_dtype=torch.bfloat16, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="16-bit"):  # a 16-bit plan given scales
        executor.run(q.to(torch.bfloat16), k8.to(torch.bfloat16), v8.to(torch.bfloat16),
                     out, s)


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs Triton (its CPU interpreter)")
def test_graphed_fp8_layers_with_their_own_scales_get_their_own_graphs():
    """Two layers reading the very same tensors (vLLM's static graph buffers) under scales of
    their own: a CUDA graph bakes in the scales' addresses, so each layer needs a graph of its
    own (two captures, then replays), and each step equals the reference under its layer's
    scales."""
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=True)
    executor.graphs.capture = replaying_capture
    batch = two_prefix_decode_step()
    plan = CascadePlanner().plan(batch.block_table, batch.seq_lens, batch.query_lens, 16)
    heads, kv_heads, dim = 8, 2, 64
    layer_scales = [scales(), scales(q=0.017, k=0.0061, v=0.0022)]
    k8, v8, _, _ = fp8_cache(32, 16, kv_heads, dim, 3, layer_scales[0])
    q = torch.empty(6, heads, dim, dtype=torch.bfloat16)
    out = torch.empty(6, heads, dim, dtype=torch.bfloat16)
    for step in range(4):  # eager once, then captured, then replayed
        planned(plan, heads, kv_heads, dim, executor)
        assert executor._step.graph_key is not None
        for s in layer_scales:
            given, q_deq = query(6, heads, dim, 4 + step, s, arrives_fp8=False)
            q.copy_(given)
            out.fill_(math.nan)
            executor.run(q, k8, v8, out, s)
            want, _ = dense_attention(batch, q_deq, k8.float() * s.k_float,
                                      v8.float() * s.v_float, dim**-0.5)
            torch.testing.assert_close(out.float(), want, atol=OUT_TOL, rtol=OUT_TOL)
    assert executor.graphs.captures == 2 and executor.graphs.replays > 0
