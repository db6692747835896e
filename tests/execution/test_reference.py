"""The torch reference executor: a plan, run level by level and merged, is plain attention."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_planner import Batch, batches, limits, make_batch, row_pages
from vllm_cascade_plugin.execution.reference import merge_states, run_plan

LOG2E = 1 / math.log(2)


def kv_cache(num_blocks: int, page_size: int, kv_heads: int, head_dim: int, dtype, seed: int):
    """K and V as vLLM lays them out: halves of one packed tensor's last dim (strided views).

    Values are uniform in [-1, 1) so every output, a convex mix of V rows, has |x| < 1.
    """
    generator = torch.Generator().manual_seed(seed)
    packed = torch.rand(num_blocks, page_size, kv_heads, 2 * head_dim, generator=generator)
    packed = (2 * packed - 1).to(dtype)
    return packed[..., :head_dim], packed[..., head_dim:]


def dense_attention(batch: Batch, q, k_cache, v_cache, sm_scale: float, soft_cap=None,
                    sinks=None):
    """Per-request causal attention, request by request, with no plan: the yardstick. ``sinks``
    (one logit per head, gpt-oss's): one more column of each head's softmax, whose value is zero;
    the LSE is over the keys alone."""
    num_heads, kv_heads = q.shape[1], k_cache.shape[2]
    kv_head_of = torch.arange(num_heads) // (num_heads // kv_heads)
    outs, lses, start = [], [], 0
    for r in range(len(batch.seq_lens)):
        n, total = int(batch.query_lens[r]), int(batch.seq_lens[r])
        if n == 0:
            continue
        pages = row_pages(batch, r)
        k = torch.cat([k_cache[p] for p in pages])[:total, kv_head_of].float()  # [L, H, D]
        v = torch.cat([v_cache[p] for p in pages])[:total, kv_head_of].float()
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n].float(), k) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        query_position = torch.arange(total - n, total)
        future = torch.arange(total)[None, :] > query_position[:, None]
        scores = scores.masked_fill(future, -math.inf)
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            sink_column = sinks.float()[:, None, None].expand(-1, n, 1)
            probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        lses.append(torch.logsumexp(scores, dim=-1).T * LOG2E)
        start += n
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


# fp32: both sides compute in fp32 and differ only in summation order and the exp2/log2 merge
# (~1e-7 relative). bf16: inputs are the same bf16 values and both compute in fp32, so outputs
# differ by at most one bf16 rounding of values below 1 in magnitude (ulp <= 2**-8); 2e-2 is
# the tolerance a bf16 attention kernel is held to, with room to spare.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=batches(max_requests=6),
    limits=limits,
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    group_size=st.sampled_from([1, 4, 8]),
    kv_heads=st.integers(1, 2),
    head_dim=st.sampled_from([64, 128, 256]),
    soft_cap=st.sampled_from([None, 5.0]),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_plan_run_by_the_reference_equals_per_request_attention(
    batch, limits, dtype, group_size, kv_heads, head_dim, soft_cap, with_sinks, seed
):
    plan = batch.plan(**limits)
    if plan.stats.num_tokens == 0:
        return
    num_heads = group_size * kv_heads
    k_cache, v_cache = kv_cache(batch.num_blocks, batch.page_size, kv_heads, head_dim, dtype, seed)
    q = torch.randn(
        plan.stats.num_tokens,
        num_heads,
        head_dim,
        generator=torch.Generator().manual_seed(seed + 1),
    ).to(dtype)
    sm_scale = head_dim**-0.5
    # Sinks around the rows' own log-sum-exps (|logits| ~ 1 here), so they move outputs a lot.
    sinks = (3 * torch.rand(num_heads, generator=torch.Generator().manual_seed(seed + 2))
             if with_sinks else None)
    out, lse = run_plan(plan, q, k_cache, v_cache, sm_scale=sm_scale, logits_soft_cap=soft_cap,
                        sinks=sinks)
    expected_out, expected_lse = dense_attention(batch, q, k_cache, v_cache, sm_scale, soft_cap,
                                                 sinks)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, expected_lse, atol=tol, rtol=tol)


def softmax_state(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of one query row per head over the keys in ``scores`` ``[n, H, keys]``."""
    return torch.einsum("nhk,khd->nhd", torch.softmax(scores, -1), v), (
        torch.logsumexp(scores, -1) * LOG2E
    )


def test_merge_states_equals_attention_over_the_union_of_keys():
    scores, v = torch.randn(3, 2, 10), torch.randn(10, 2, 8)
    o_a, lse_a = softmax_state(scores[..., :4], v[:4])
    o_b, lse_b = softmax_state(scores[..., 4:], v[4:])
    o, lse = merge_states(o_a, lse_a, o_b, lse_b)
    o_all, lse_all = softmax_state(scores, v)
    torch.testing.assert_close(o, o_all)  # fp32 defaults: a handful of float roundings
    torch.testing.assert_close(lse, lse_all)


def test_merge_states_with_an_empty_state_keeps_the_other():
    o_b, lse_b = torch.randn(2, 3, 4), torch.randn(2, 3)
    empty_o, empty_lse = torch.zeros(2, 3, 4), torch.full((2, 3), -math.inf)
    o, lse = merge_states(empty_o, empty_lse, o_b, lse_b)
    assert torch.equal(o, o_b) and torch.equal(lse, lse_b)
    o, lse = merge_states(empty_o, empty_lse, empty_o, empty_lse)
    assert torch.equal(o, empty_o) and torch.isneginf(lse).all()


def test_lse_is_base_2():
    plan = make_batch([[1]], [1], [1], page_size=1).plan()
    k_cache, v_cache = kv_cache(2, 1, 1, 64, torch.float32, seed=0)
    q = torch.randn(1, 1, 64)
    out, lse = run_plan(plan, q, k_cache, v_cache, sm_scale=0.125)
    score = 0.125 * (q[0, 0] @ k_cache[1, 0, 0])
    torch.testing.assert_close(lse[0, 0], score * LOG2E)  # one key: lse = its logit / ln 2
    torch.testing.assert_close(out[0, 0], v_cache[1, 0, 0])


def test_soft_cap_is_flashinfers_cap_times_tanh_of_scaled_logits():
    plan = make_batch([[1]], [2], [1], page_size=2).plan()
    k_cache, v_cache = kv_cache(2, 2, 1, 64, torch.float32, seed=1)
    q = 4 * torch.randn(1, 1, 64)
    _, lse = run_plan(plan, q, k_cache, v_cache, sm_scale=0.5, logits_soft_cap=3.0)
    logits = 3.0 * torch.tanh(0.5 * (k_cache[1, :, 0] @ q[0, 0]) / 3.0)
    torch.testing.assert_close(lse[0, 0], torch.logsumexp(logits, 0) * LOG2E)


def test_causal_level_is_bottom_right_aligned():
    # Four tokens in cache, the last two are this step's: query 0 sees keys 0..2, query 1 all.
    plan = make_batch([[1]], [4], [2], page_size=4).plan()
    k_cache = torch.zeros(2, 4, 1, 64)  # all logits 0: uniform attention over visible keys
    v_cache = torch.arange(4.0).repeat_interleave(64).reshape(1, 4, 1, 64).expand(2, 4, 1, 64)
    out, _ = run_plan(plan, torch.randn(2, 1, 64), k_cache, v_cache, sm_scale=1.0)
    assert out[:, 0, 0].tolist() == pytest.approx([1.0, 1.5])


def test_gqa_query_heads_read_their_kv_head():
    plan = make_batch([[1]], [1], [1], page_size=1).plan()
    k_cache = torch.zeros(2, 1, 2, 64)
    v_cache = (
        torch.stack([torch.zeros(64), torch.ones(64)]).reshape(1, 1, 2, 64).expand(2, -1, -1, -1)
    )
    out, _ = run_plan(plan, torch.randn(1, 8, 64), k_cache, v_cache, sm_scale=1.0)
    assert out[0, :, 0].tolist() == [0.0] * 4 + [1.0] * 4


def test_empty_step_gives_empty_outputs():
    plan = make_batch([[0]], [0], [0], page_size=4).plan()
    k_cache, v_cache = kv_cache(1, 4, 1, 64, torch.float32, seed=0)
    out, lse = run_plan(plan, torch.zeros(0, 2, 64), k_cache, v_cache, sm_scale=1.0)
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)
    assert np.array_equal(plan.permutation, np.arange(0))


@pytest.mark.parametrize("sink", [-30.0, 0.0, 2.5, 30.0])
def test_a_sink_applied_to_the_merged_output_is_softmax_attention_with_the_sink(sink):
    """``apply_sinks`` (what the GPU executors do after their last merge) on the keys-only
    output and LSE equals softmax attention with the sink's column, from a sink that adds
    nothing to one that takes almost all of the softmax."""
    from vllm_cascade_plugin.execution.common import apply_sinks

    batch = make_batch([[1, 2, 3], [1, 2, 4], [1, 5]], [40, 45, 20], [1, 3, 20], page_size=16)
    k_cache, v_cache = kv_cache(batch.num_blocks, batch.page_size, 2, 64, torch.float32, 3)
    q = torch.randn(24, 8, 64, generator=torch.Generator().manual_seed(4))
    sinks = torch.full((8,), sink) + torch.linspace(-1, 1, 8)
    out, lse = dense_attention(batch, q, k_cache, v_cache, 0.125)
    want, _ = dense_attention(batch, q, k_cache, v_cache, 0.125, sinks=sinks)
    apply_sinks(out, lse / LOG2E, sinks)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    if sink < 0:  # a sink far below every row's LSE changes nothing; far above, it zeroes out
        torch.testing.assert_close(out, dense_attention(batch, q, k_cache, v_cache, 0.125)[0])
    if sink > 10:
        assert out.abs().max() < 1e-6
