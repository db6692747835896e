"""The fused per-request decode kernel (``decode_level``) against plain softmax attention.

Runs under Triton's CPU interpreter (tests/conftest.py) in fp32 and fp16; bf16 on the GPU in
tests/gpu/test_kernels.py (the interpreter's bf16 dot is wrong). The reference is written here
from the definition: softmax over the request's own keys, then the two-state merge
``o = (o_own e^lse_own + o_prev e^lse_prev) / (e^lse_own + e^lse_prev)``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from vllm_cascade_plugin.execution import decode_level

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or decode_level.unsupported_reason(4, 1, 64),
    reason="needs Triton's CPU interpreter (set by tests/conftest.py without a GPU)")


def reference(q, k, v, table, lens, state, state_lse, sm_scale, softcap):
    """float64 ``(out, lse)``; ``lse`` natural log ``[heads, R]``."""
    rows, heads, dim = q.shape
    kv_heads, page = k.shape[2], k.shape[1]
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    lse = torch.empty(heads, rows, dtype=torch.float64)
    for r in range(rows):
        n = int(lens[r])
        pages = table[r, : -(-n // page)].long()
        keys = k[pages].reshape(-1, kv_heads, dim)[:n].double()
        values = v[pages].reshape(-1, kv_heads, dim)[:n].double()
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            s = keys[:, kvh] @ q[r, h].double() * sm_scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            none = torch.tensor(-math.inf, dtype=torch.float64)
            own_lse = torch.logsumexp(s, 0) if n else none
            own = torch.softmax(s, 0) @ values[:, kvh] if n else torch.zeros(dim).double()
            prev_lse = float(state_lse[h, r])
            prev_lse = -math.inf if prev_lse == math.inf else prev_lse
            total = torch.logaddexp(own_lse, torch.tensor(prev_lse, dtype=torch.float64))
            if total == -math.inf:
                out[r, h], lse[h, r] = 0.0, -math.inf
                continue
            out[r, h] = own * torch.exp(own_lse - total)
            if prev_lse > -math.inf:  # else the state has no weight (it may hold anything)
                out[r, h] += state[r, h].double() * math.exp(prev_lse - total)
            lse[h, r] = total
    return out, lse


def case(rows, heads, kv_heads, dim, page, lens, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // page) for n in lens)
    num_pages = rows * width + 3
    packed = torch.rand(num_pages, page, kv_heads, 2 * dim, generator=g) * 2 - 1
    k, v = packed.to(dtype).split(dim, dim=-1)  # strided halves, as vLLM's packed cache
    ids = torch.randperm(num_pages - 1, generator=g)[: rows * width] + 1
    table = ids.view(rows, width).to(torch.int32)
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    q = qkv[:, :heads]  # strided, like vLLM's view of the fused QKV output
    state = (torch.rand(rows, heads, dim, generator=g) * 2 - 1).to(dtype)
    state_lse = torch.randn(heads, rows, generator=g) * 3
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32), state, state_lse


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "page", "lens"), [
    (4, 1, 64, 16, [1, 16, 17, 150]),   # one page, page edge, several 64-key blocks
    (8, 2, 128, 16, [40, 3]),           # Llama-3-8B's grouping (4 query heads per KV head)
    (8, 8, 64, 4, [9, 64]),             # no grouping: 1 live row of the 16 the dot needs
    (32, 2, 64, 16, [70]),              # 16 query heads per KV head: no padding rows
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_decode_level_equals_softmax_then_merge(heads, kv_heads, dim, page, lens, dtype,
                                                softcap):
    q, k, v, table, kv_lens, state, state_lse = case(len(lens), heads, kv_heads, dim, page,
                                                     lens, dtype, seed=len(lens) + heads)
    state_lse[0, 0] = -math.inf  # nothing shared yet for this row and head
    state_lse[-1, -1] = math.inf  # FA2's empty row: read as -inf, as merge_attn_states does
    state[0, 0] = math.nan  # a state with weight 0 must not leak into the output
    out = torch.full_like(state, math.nan)
    out_lse = torch.full_like(state_lse, math.nan)
    scale = dim ** -0.5
    decode_level.decode_level(q, k, v, table, kv_lens, state, state_lse, out, out_lse,
                              sm_scale=scale, softcap=softcap)
    want, want_lse = reference(q, k, v, table, kv_lens, state, state_lse, scale, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(out_lse.double(), want_lse, atol=tol, rtol=tol)


def test_in_place_on_the_state():
    """``out`` may be ``state`` and ``out_lse`` may be ``state_lse`` (the executor does this)."""
    q, k, v, table, kv_lens, state, state_lse = case(3, 8, 2, 64, 16, [5, 33, 80],
                                                     torch.float32, seed=7)
    want, want_lse = reference(q, k, v, table, kv_lens, state, state_lse, 0.125, 0.0)
    decode_level.decode_level(q, k, v, table, kv_lens, state, state_lse, state, state_lse,
                              sm_scale=0.125)
    torch.testing.assert_close(state.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state_lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_shapes_it_cannot_run_are_named():
    assert "power of two" in decode_level.unsupported_reason(32, 8, 96)
    assert "multiple" in decode_level.unsupported_reason(32, 6, 128)
    assert decode_level.unsupported_reason(32, 8, 128) is None
    q, k, v, table, kv_lens, state, state_lse = case(2, 4, 1, 64, 16, [3, 4], torch.float32, 1)
    with pytest.raises(ValueError, match="contiguous"):
        decode_level.decode_level(q, k.transpose(-1, -2), v, table, kv_lens, state, state_lse,
                                  state, state_lse, sm_scale=0.125)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_warm_up_runs_the_kernel_on_a_tiny_input(softcap):
    """The builder's startup compilation: one zero key and value, no state: output 0 and LSE
    log(e^0) = 0 (the NaN-free path through an empty state)."""
    out, lse = decode_level.warm_up(8, 2, 64, 16, torch.float16, torch.device("cpu"),
                                    softcap=softcap)
    assert out.shape == (1, 8, 64) and lse.shape == (8, 1)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, torch.zeros_like(lse))


def fp8_case(rows, heads, kv_heads, dim, page, lens, q_dtype, seed):
    """``case`` with the cache quantised to e4m3 as vLLM writes it (``x / scale``, saturated
    to the format's range) under per-layer scales far from 1, and the query quantised too when
    ``q_dtype`` is FP8 (vLLM's FlashAttention path). Returns the kernel's inputs, the scales
    and the dequantised q, K and V the reference reads."""
    q, k, v, table, kv_lens, state, state_lse = case(rows, heads, kv_heads, dim, page, lens,
                                                     torch.float32, seed)
    fp8 = torch.float8_e4m3fn
    scales = tuple(torch.tensor(s, dtype=torch.float32) for s in (0.011, 0.0031, 0.0027))
    q = q * 1.5  # logits of a few units: a softmax that is neither flat nor one-hot

    def quantise(x, scale):
        return (x / scale).clamp(-448.0, 448.0).to(fp8)

    packed = torch.cat([quantise(k, scales[1]), quantise(v, scales[2])], dim=-1)
    k8, v8 = packed.split(dim, dim=-1)  # strided halves, as vLLM's packed cache
    if q_dtype == fp8:
        q_in = quantise(q, scales[0])
        q_deq = q_in.float() * scales[0]
    else:
        q_in = q.to(q_dtype)
        q_deq = q_in.float()
    return (q_in, k8, v8, table, kv_lens, state, state_lse, scales, q_deq,
            k8.float() * scales[1], v8.float() * scales[2])


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "page", "lens"), [
    (4, 1, 64, 16, [1, 16, 17, 150]),
    (8, 2, 128, 16, [40, 3]),
    (32, 2, 64, 16, [70]),
])
@pytest.mark.parametrize(("q_dtype", "out_dtype"), [
    (torch.float8_e4m3fn, torch.bfloat16),  # vLLM's FlashAttention path: FP8 query, bf16 out
    (torch.float8_e4m3fn, torch.float16),
    (torch.float16, torch.float16),  # a 16-bit query against the FP8 cache
])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_fp8_cache_equals_softmax_on_the_dequantised_values(heads, kv_heads, dim, page, lens,
                                                            q_dtype, out_dtype, softcap):
    """The kernel on e4m3 K/V (and query) with per-layer scales against the float64 reference
    on the dequantised values. The kernel's products are exact (e4m3 values are exact in
    fp16, and accumulate in fp32), so what differs is one rounding of the probabilities to
    fp16 before P @ V (relative 2**-11) and of the output to its dtype: outputs are convex
    mixes of values below 1 in magnitude, so fp16 is held to 2e-3 as in the test above and
    bf16 (ulp 2**-8 below 1) to 1e-2; the LSE is fp32 throughout (1e-4)."""
    (q, k, v, table, kv_lens, state, state_lse, scales, q_deq, k_deq,
     v_deq) = fp8_case(len(lens), heads, kv_heads, dim, page, lens, q_dtype, seed=len(lens))
    state = state.to(out_dtype)
    state_lse[0, 0] = -math.inf
    out = torch.full_like(state, math.nan)
    out_lse = torch.full_like(state_lse, math.nan)
    scale = dim ** -0.5
    decode_level.decode_level(q, k, v, table, kv_lens, state, state_lse, out, out_lse,
                              sm_scale=scale, softcap=softcap, scales=scales)
    want, want_lse = reference(q_deq, k_deq, v_deq, table, kv_lens, state, state_lse, scale,
                               softcap)
    tol = 2e-3 if out_dtype == torch.float16 else 1e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(out_lse.double(), want_lse, atol=1e-4, rtol=1e-4)
    if softcap:  # unit scales make logits of thousands, whose tanh overflows in numpy
        return
    # The scales matter: the same bytes read as unit-scale values give another answer.
    unscaled = torch.empty_like(out)
    ones = tuple(torch.ones((), dtype=torch.float32) for _ in range(3))
    decode_level.decode_level(q, k, v, table, kv_lens, state, state_lse, unscaled,
                              torch.empty_like(out_lse), sm_scale=scale, softcap=softcap,
                              scales=ones)
    assert (unscaled.double() - want).abs().max() > 10 * tol


def test_an_fp8_cache_without_scales_or_a_mixed_one_is_refused():
    q, k, v, table, kv_lens, state, state_lse, scales, *_ = fp8_case(
        2, 4, 1, 64, 16, [3, 4], torch.float8_e4m3fn, 1)
    state = state.to(torch.bfloat16)
    with pytest.raises(ValueError, match="needs its scales"):
        decode_level.decode_level(q, k, v, table, kv_lens, state, state_lse, state, state_lse,
                                  sm_scale=0.125)
    with pytest.raises(ValueError, match="FP8 together"):
        decode_level.decode_level(q, k, v.to(torch.bfloat16), table, kv_lens, state,
                                  state_lse, state, state_lse, sm_scale=0.125, scales=scales)
    per_head = (scales[0], torch.full((1,), 0.1).expand(2), scales[2])
    with pytest.raises(ValueError, match="per-layer"):
        decode_level.decode_level(q, k, v, table, kv_lens, state, state_lse, state, state_lse,
                                  sm_scale=0.125, scales=per_head)


def test_warm_up_compiles_the_fp8_variant():
    out, lse = decode_level.warm_up(8, 2, 64, 16, torch.bfloat16, torch.device("cpu"),
                                    kv_dtype=torch.float8_e4m3fn)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, torch.zeros_like(lse))
