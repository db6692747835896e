"""A pure-torch executor of a :class:`~vllm_cascade_plugin.planning.planner.CascadePlan`.

Slow and simple on purpose: the yardstick the GPU executor is checked against. Every level is
run group by group on dense, gathered K/V in float32, and the levels are merged exactly as
FlashInfer's ``merge_state`` does. Log-sum-exp values are base 2 throughout, like FlashInfer's.
"""

from __future__ import annotations

import math

import torch

from ..planning.plan import CascadeLevel, CascadePlan

__all__ = ["attend_level", "merge_states", "run_plan"]


def run_plan(
    plan: CascadePlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query token of the step, computed level by level and merged.

    Parameters
    ----------
    plan : the step's plan.
    q : ``[num_tokens, num_qo_heads, head_dim]``, any float dtype, tokens in vLLM's order.
    k_cache, v_cache : ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD), may be strided
        views (vLLM splits one packed K/V tensor along its last dim).
    sm_scale : softmax scale applied to ``q @ k``.
    logits_soft_cap : if set, logits are ``cap * tanh(sm_scale * q @ k / cap)`` (FlashInfer's).
    sinks : ``[num_qo_heads]`` attention sinks (gpt-oss), logits of a key every row sees whose
        value is zero: merged last, as one more state (output 0, LSE the sink).

    Returns
    -------
    out : ``[num_tokens, num_qo_heads, head_dim]`` in ``q.dtype``.
    lse : ``[num_tokens, num_qo_heads]`` float32, base-2 log-sum-exp of each row's logits over
        its keys (the sink not included).
    """
    num_tokens, num_heads, _ = q.shape
    out = q.new_zeros((num_tokens, num_heads, v_cache.shape[-1]), dtype=torch.float32)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float32, device=q.device)
    for level in plan.levels:
        index = torch.as_tensor(level.q_index, dtype=torch.long, device=q.device)
        o_level, lse_level = attend_level(
            level, q[index], k_cache, v_cache, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap
        )
        out[index], lse[index] = merge_states(out[index], lse[index], o_level, lse_level)
    if sinks is not None:
        sink_lse = (sinks.float().to(q.device) / math.log(2.0)).expand(num_tokens, num_heads)
        out, _ = merge_states(out, lse, torch.zeros_like(out), sink_lse)
    return out.to(q.dtype), lse


def attend_level(
    level: CascadeLevel,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One level's attention: every group's queries over the group's pages.

    Parameters
    ----------
    level : the level to run.
    q : ``[len(level.q_index), num_qo_heads, head_dim]``, the level's queries already gathered
        in ``q_index`` order (``q[level.q_index]`` of the step's queries).
    k_cache, v_cache, sm_scale, logits_soft_cap : as in :func:`run_plan`.

    Returns
    -------
    out : ``[len(level.q_index), num_qo_heads, head_dim]`` float32, in ``q_index`` order.
    lse : ``[len(level.q_index), num_qo_heads]`` float32, base 2.
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} kv heads")
    page_size = k_cache.shape[1]
    outs, lses = [], []
    for g in range(level.num_groups):
        pages = torch.as_tensor(
            level.kv_page_indices[level.kv_page_indptr[g] : level.kv_page_indptr[g + 1]],
            dtype=torch.long,
            device=k_cache.device,
        )
        kv_len = (len(pages) - 1) * page_size + int(level.kv_last_page_len[g])
        # [pages, page_size, kv_heads, d] -> [kv_len, q_heads, d]; query head h reads kv head
        # h // (num_heads // num_kv_heads), which is what repeat_interleave lays out.
        k = k_cache[pages].flatten(0, 1)[:kv_len].float()
        v = v_cache[pages].flatten(0, 1)[:kv_len].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        group_q = q[level.qo_indptr[g] : level.qo_indptr[g + 1]].float()
        logits = torch.einsum("qhd,khd->hqk", group_q, k) * sm_scale
        if logits_soft_cap is not None:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        if level.causal:
            # Bottom-right aligned: the segment's last query sees the whole kv range.
            qo_len = group_q.shape[0]
            query_pos = torch.arange(qo_len, device=q.device)[:, None] + (kv_len - qo_len)
            visible = torch.arange(kv_len, device=q.device)[None, :] <= query_pos
            logits = logits.masked_fill(~visible, -math.inf)
        lse_e = torch.logsumexp(logits, dim=-1)  # [heads, queries], natural log
        probs = torch.exp(logits - lse_e[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        lses.append(lse_e.T / math.log(2.0))
    if not outs:
        empty = q.new_zeros((0, num_heads, v_cache.shape[-1]), dtype=torch.float32)
        return empty, empty[:, :, 0]
    return torch.cat(outs), torch.cat(lses)


def merge_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states over disjoint key sets, as FlashInfer's ``merge_state``.

    Parameters
    ----------
    o_a, o_b : ``[n, num_heads, head_dim]`` partial outputs (each softmax-normalised over its keys).
    lse_a, lse_b : ``[n, num_heads]`` their base-2 log-sum-exp; ``-inf`` marks an empty state.

    Returns
    -------
    o : ``[n, num_heads, head_dim]`` in ``o_a.dtype``, computed in float32.
    lse : ``[n, num_heads]`` float32, ``log2(2**lse_a + 2**lse_b)``.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    top = torch.maximum(lse_a, lse_b)
    # Shift by the larger lse for stability; rows empty in both states shift by 0 instead of
    # -inf (which would give NaN) and come out as zero output with lse -inf.
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w_a = torch.exp2(lse_a - top)
    w_b = torch.exp2(lse_b - top)
    total = w_a + w_b
    lse = top + torch.log2(total)
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    o = o_a.float() * (w_a / safe_total)[..., None] + o_b.float() * (w_b / safe_total)[..., None]
    return o.to(o_a.dtype), lse
