"""Every merge of attention states the executors run, on rows where one level or both saw no
key: FlashInfer 0.7+ writes such a row as output 0 and LSE -inf (before, a finite sentinel near
-5e4); FlashAttention writes LSE +inf. Each merge must give what plain softmax attention over
the union of the keys gives (fp32, torch), and 0 with LSE -inf where both are empty.

The FlashInfer release is whatever the GPU machine carries (0.6.14 beside vLLM 0.26.0); the
inputs are written in 0.7's convention, which is what matters to the merge."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.flashinfer

N, H, D = 6, 4, 128
SPLITS = {"first level empty": 0, "second level empty": 24, "both non-empty": 10}


def softmax_state(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention over ``scores`` ``[N, H, keys]``: output ``[N, H, D]`` and natural-log
    LSE ``[N, H]``; an empty key set gives output 0 and LSE -inf."""
    if scores.shape[-1] == 0:
        return torch.zeros(N, H, D, device=v.device), torch.full((N, H), -math.inf,
                                                                  device=v.device)
    p = torch.softmax(scores, -1)
    return torch.einsum("nhk,khd->nhd", p, v).contiguous(), torch.logsumexp(scores, -1)


def inputs(split: int):
    g = torch.Generator(device="cuda").manual_seed(split)
    scores = torch.randn(N, H, 24, generator=g, device="cuda") * 3
    v = torch.randn(24, H, D, generator=g, device="cuda")
    return softmax_state(scores[..., :split], v[:split]), softmax_state(
        scores[..., split:], v[split:]), softmax_state(scores, v)


def check(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor):
    # bf16 states: a few bf16 roundings of values up to ~3 (the merge itself is fp32).
    torch.testing.assert_close(out.float(), ref_out, atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("case", list(SPLITS))
def test_flashinfer_merge_state_in_place_with_an_empty_level(case):
    from flashinfer import merge_state_in_place

    (oa, la), (ob, lb), (ref, rlse) = inputs(SPLITS[case])
    log2e = 1 / math.log(2)  # FlashInfer's LSE is base 2
    v, s = oa.to(torch.bfloat16).contiguous(), (la * log2e).contiguous()
    merge_state_in_place(v, s, ob.to(torch.bfloat16).contiguous(), (lb * log2e).contiguous())
    check(v, s / log2e, ref, rlse)


@pytest.mark.parametrize("case", list(SPLITS))
@pytest.mark.parametrize("empty_lse", [-math.inf, math.inf], ids=["-inf", "+inf"])
def test_vllms_merge_attn_states_with_an_empty_level(case, empty_lse):
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    (oa, la), (ob, lb), (ref, rlse) = inputs(SPLITS[case])
    la, lb = (torch.where(torch.isneginf(x), empty_lse, x) for x in (la, lb))
    out = torch.full((N, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    out_lse = torch.empty(H, N, device="cuda")
    merge_attn_states(out, oa.to(torch.bfloat16), la.T.contiguous(), ob.to(torch.bfloat16),
                      lb.T.contiguous(), out_lse)
    check(out, out_lse.T, ref, rlse)


@pytest.mark.parametrize("merge", ["flashinfer", "vllm"])
def test_two_empty_levels_merge_to_zero_with_lse_minus_inf(merge):
    zeros = torch.zeros(N, H, D, dtype=torch.bfloat16, device="cuda")
    empty = torch.full((N, H), -math.inf, device="cuda")
    if merge == "flashinfer":
        import flashinfer
        from flashinfer import merge_state_in_place
        from packaging.version import Version

        if Version(flashinfer.__version__) < Version("0.7.0"):
            # Seen on 0.6.14 (H100): NaN output. Upstream #4401 made it 0 and -inf in 0.7. The
            # executors never merge two empty states: the per-request level, the state every
            # shared level merges into, holds each query's own token.
            pytest.skip(f"FlashInfer {flashinfer.__version__} merges two empty states to NaN")

        v, s = zeros.clone(), empty.clone()
        merge_state_in_place(v, s, zeros.clone(), empty.clone())
        out, lse = v, s
    else:
        from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

        out = torch.full_like(zeros, float("nan"))
        lse = torch.empty(H, N, device="cuda")
        merge_attn_states(out, zeros, empty.T.contiguous(), zeros.clone(), empty.T.contiguous(),
                          lse)
        lse = lse.T
    assert torch.equal(out, zeros) and bool(torch.isneginf(lse).all())
