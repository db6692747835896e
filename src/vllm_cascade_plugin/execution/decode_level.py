"""The per-request level of a decode step, fused with the final merge: one Triton kernel.

In a decode step every request has one query token and, below its shared prefix levels, a few
hundred tokens of its own. FlashAttention 3 runs that level as ``B`` one-token sequences: 74 µs
for 256 requests x 128 own tokens on an H200, plus 8 µs for the merge
(``benchmarks/results/gpu/fa3_levels.json``), for 134 MB of KV (31 µs at 4.3 TB/s). Here one
program is one (request, KV head): its ``q_heads / kv_heads`` query heads against the request's
own pages, an online softmax in base 2, and then the merge with the state the shared levels left
(output and natural-log LSE, vLLM's ``merge_attn_states`` convention), written to ``out``: 50 µs
for the same step, one launch instead of two.

A program reads its request's state rows before it writes the same rows of ``out``, and no
other program touches them, so ``state`` may be ``out`` and ``state_lse`` may be ``out_lse``.

Runs under ``TRITON_INTERPRET=1`` on CPU tensors (the CPU tests); Triton is imported lazily, so
this module imports where Triton is missing (:func:`unsupported_reason` says so).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# Launch configuration (``benchmarks/kernels/fa3_levels.py --sweep`` times the alternatives).
BLOCK_N = 64  # key tokens per inner iteration
NUM_WARPS = 4
NUM_STAGES = 2
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows: a KV head's query heads are padded to this
# The FP8 format vLLM's fp8/fp8_e4m3 KV cache holds (fp8_e5m2 runs flat: integration/support.py).
FP8_DTYPES = (torch.float8_e4m3fn,)


def unsupported_reason(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why :func:`decode_level` cannot run this shape, or None."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
        return f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    return _triton_missing()


@functools.cache
def _triton_missing() -> str | None:
    """Asked once per process (the executor asks every step)."""
    try:
        _kernel()
    except ImportError as exc:
        return f"Triton cannot be imported ({exc})"
    return None


tl: Any = None  # triton.language, bound by _kernel(): a module global, where Triton's
# interpreter looks for the language module it swaps in


@functools.cache
def _kernel() -> Any:
    global tl
    import triton
    import triton.language

    tl = triton.language

    # Not specialized on the arguments that vary by step (rows, widest block-table row), so one
    # compilation (warm_up) serves every step of a model.
    @triton.jit(do_not_specialize=["stride_bt", "stride_slh", "stride_olh"])
    def decode_level_kernel(
        q, k, v, block_table, kv_lens, state, state_lse, out, out_lse,
        q_scale, k_scale, v_scale,
        sm_scale, softcap,
        stride_qt, stride_qh,
        stride_kb, stride_kp, stride_kh,
        stride_vb, stride_vp, stride_vh,
        stride_bt,
        stride_st, stride_sh, stride_slh,
        stride_ot, stride_oh, stride_olh,
        GQA: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP8_Q: tl.constexpr,
        FP8_KV: tl.constexpr,
    ):
        r = tl.program_id(0)  # the request, also its query row (one query per request)
        kvh = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HEAD_DIM)
        live = g < GQA
        heads = kvh * GQA + g
        row = r.to(tl.int64)
        n_keys = tl.load(kv_lens + r)
        qv = tl.load(q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                     mask=live[:, None], other=0.0)
        # FP8 operands are widened before the dots: e4m3 values are exact in fp16 (and in a
        # 16-bit query's dtype), so the products are those of the dequantised values up to
        # the scales, applied in fp32: q_scale * k_scale on the logits, v_scale on the output.
        qk_scale = sm_scale
        if FP8_Q:
            qv = qv.to(tl.float16)
            qk_scale = qk_scale * tl.load(q_scale)
        out_scale = 1.0
        if FP8_KV:
            qk_scale = qk_scale * tl.load(k_scale)
            out_scale = tl.load(v_scale)
        # The state is read up front: its loads overlap the keys' (nothing depends on them).
        prev_lse = tl.load(state_lse + heads * stride_slh + row, mask=live, other=float("-inf"))
        prev = tl.load(state + row * stride_st + heads[:, None] * stride_sh + d[None, :],
                       mask=live[:, None], other=0.0).to(tl.float32)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
        for start in range(0, n_keys, BLOCK):
            n = start + tl.arange(0, BLOCK)
            valid = n < n_keys
            page = tl.load(block_table + row * stride_bt + n // PAGE, mask=valid, other=0)
            page = page.to(tl.int64)
            slot = n % PAGE
            kt = tl.load(k + page[:, None] * stride_kb + slot[:, None] * stride_kp
                         + kvh * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
            vt = tl.load(v + page[:, None] * stride_vb + slot[:, None] * stride_vp
                         + kvh * stride_vh + d[None, :], mask=valid[:, None], other=0.0)
            if FP8_KV:
                kt = kt.to(qv.dtype)
                vt = vt.to(qv.dtype)
            s = tl.dot(qv, tl.trans(kt)) * qk_scale  # float32 [G_PAD, BLOCK], natural units
            if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh through exp (no libdevice)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            s = tl.where(valid[None, :], s * 1.4426950408889634, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m = m_new
        has_keys = total > 0
        own_lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, total, 1.0)),
                           float("-inf"))  # base 2
        own = acc * (out_scale / tl.where(has_keys, total, 1.0))[:, None]
        # The shared levels' state: natural-log LSE (+inf, FA2's empty row, read as -inf).
        prev_lse = tl.where(prev_lse == float("inf"), float("-inf"), prev_lse)
        prev_lse = prev_lse * 1.4426950408889634
        top = tl.maximum(own_lse, prev_lse)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_own = tl.exp2(own_lse - top)
        w_prev = tl.exp2(prev_lse - top)
        weight = w_own + w_prev
        prev = tl.where(w_prev[:, None] > 0, prev, 0.0)  # never 0 * (inf or nan)
        merged = (own * w_own[:, None] + prev * w_prev[:, None]) / tl.where(
            weight > 0, weight, 1.0)[:, None]
        lse2 = top + tl.log2(tl.where(weight > 0, weight, 1.0))
        lse = tl.where(weight > 0, lse2 * 0.6931471805599453, float("-inf"))  # natural log
        tl.store(out + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 merged.to(out.dtype.element_ty), mask=live[:, None])
        tl.store(out_lse + heads * stride_olh + row, lse, mask=live)

    return decode_level_kernel


def decode_level(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, kv_lens: torch.Tensor, state: torch.Tensor,
                 state_lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor, *,
                 sm_scale: float, softcap: float = 0.0,
                 scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                 num_stages: int = NUM_STAGES) -> None:
    """Attend request ``r``'s query (row ``r`` of ``q``) to its own pages and merge the result
    with ``state``/``state_lse``, into ``out``/``out_lse``.

    Parameters
    ----------
    q : ``[R, num_qo_heads, head_dim]`` fp16/bf16, one query per request (may be strided).
    k_cache, v_cache : ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD), may be strided
        views; the last dimension contiguous.
    block_table : int32 ``[R, max_pages]``: request ``r``'s own pages.
    kv_lens : int32 ``[R]``: its own KV tokens (the last page partly).
    state, state_lse : what the shared levels computed for row ``r``: ``[R, heads, head_dim]``
        and float32 ``[heads, R]``, natural log (``-inf``: nothing yet).
    out, out_lse : written, same shapes; may be ``state``/``state_lse`` themselves.
    scales : ``(q_scale, k_scale, v_scale)``, float32 one-element tensors on the device
        (vLLM's per-layer ``_q_scale``, ``_k_scale``, ``_v_scale``): required with an FP8
        (e4m3) cache, whose values are ``k_cache * k_scale`` and ``v_cache * v_scale``; an
        FP8 ``q`` (vLLM's FlashAttention path quantises it) is ``q * q_scale``. Read on the
        device when the kernel runs, so a CUDA graph replays with the layer's current scales.
    """
    num_rows, num_qo_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("state", state),
                    ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    if state_lse.stride(1) != 1 or out_lse.stride(1) != 1:
        raise ValueError("state_lse and out_lse must be contiguous along the rows")
    fp8_q, fp8_kv = q.dtype in FP8_DTYPES, k_cache.dtype in FP8_DTYPES
    if fp8_kv != (v_cache.dtype in FP8_DTYPES) or (fp8_q and not fp8_kv):
        raise ValueError(f"q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}: "
                         "an FP8 query needs an FP8 cache, and K and V are FP8 together")
    if fp8_kv and scales is None:
        raise ValueError("an FP8 KV cache needs its scales (q_scale, k_scale, v_scale)")
    if scales is not None and any(t.numel() != 1 for t in scales):
        raise ValueError("the scales must be per-layer (one element each)")
    if num_rows == 0:
        return
    q_scale, k_scale, v_scale = scales if scales is not None else (kv_lens, kv_lens, kv_lens)
    gqa = num_qo_heads // num_kv_heads
    _kernel()[(num_rows, num_kv_heads)](
        q, k_cache, v_cache, block_table, kv_lens, state, state_lse, out, out_lse,
        q_scale, k_scale, v_scale,
        float(sm_scale), float(softcap or 1.0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        state.stride(0), state.stride(1), state_lse.stride(0),
        out.stride(0), out.stride(1), out_lse.stride(0),
        GQA=gqa, G_PAD=max(MIN_DOT_ROWS, 1 << (gqa - 1).bit_length()), HEAD_DIM=head_dim,
        PAGE=page, BLOCK=block_n, HAS_SOFTCAP=bool(softcap), FP8_Q=fp8_q, FP8_KV=fp8_kv,
        num_warps=num_warps, num_stages=num_stages)


def warm_up(num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
            dtype: torch.dtype, device: torch.device, softcap: float = 0.0,
            kv_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Compile the kernel for this model before serving: one request with one key, laid out as
    vLLM lays out the real arguments (the query a view of the fused QKV output, K and V halves
    of one packed cache), so the real calls find the same compiled variant. Returns the output
    and LSE: all zeros (one zero key, zero values, no state). ``dtype``: the output's (the
    model's); ``kv_dtype``: an FP8 cache's, whose steps get an FP8 query too (unit scales)."""
    kv_dtype = kv_dtype or dtype
    q_dtype = kv_dtype if kv_dtype in FP8_DTYPES else dtype
    qkv = torch.zeros(1, num_qo_heads + 2 * num_kv_heads, head_dim, dtype=q_dtype,
                      device=device)
    cache = torch.zeros(2, page_size, num_kv_heads, 2 * head_dim, dtype=kv_dtype,
                        device=device)
    k, v = cache.split(head_dim, dim=-1)
    scales = None
    if kv_dtype in FP8_DTYPES:
        one = torch.ones((), dtype=torch.float32, device=device)
        scales = (one, one, one)
    table = torch.ones(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    out = torch.zeros(1, num_qo_heads, head_dim, dtype=dtype, device=device)
    lse = torch.full((num_qo_heads, 1), float("-inf"), dtype=torch.float32, device=device)
    decode_level(qkv[:, :num_qo_heads], k, v, table, lens, out, lse, out, lse,
                 sm_scale=head_dim ** -0.5, softcap=softcap, scales=scales)
    return out, lse
