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

from vllm_cascade_plugin import decode_level

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
