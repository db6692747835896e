"""Attention sinks (gpt-oss) through every executor on the GPU: the sink enters each row's
softmax exactly once, whichever levels its keys were split into.

A sink is one logit per query head that every row sees, with a zero value: vLLM's
FlashAttention takes it as ``s_aux``. The executors apply it to the merged output
(``execution.common.apply_sinks``); a mixed step run split passes it to its flat call as vLLM
does. Two independent yardsticks: softmax attention with the sink's column in fp32 on the CPU,
from the very bf16 values the kernels read, and vLLM's FlashAttention 3 run flat with ``s_aux``
(where FA3 runs). Sinks are drawn around the rows' log-sum-exps, where they move outputs by
tens of percent: a sink applied twice, or to one level only, fails by far more than the
tolerance (``test_a_sink_applied_twice_fails_the_comparison``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch

from gpu.test_kernels import (  # noqa: F401  (kernel, workspace, results: fixtures)
    DTYPE,
    PAGE,
    SCENARIOS,
    TOL,
    Batch,
    Shape,
    check_close_ulp,
    kernel,
    plan_for,
    planned_executor,
    random_layer,
    results,
    workspace,
)
from gpu.test_kernels_split import mixed_batch, split_executor_step
from vllm_cascade_plugin.execution import vllm_kernels
from vllm_cascade_plugin.execution.common import apply_sinks
from vllm_cascade_plugin.execution.kernels import FlashAttnCascadeExecutor, fa3_unsupported_reason
from vllm_cascade_plugin.planning.planner import CascadePlanner

DEVICE = torch.device("cuda")


def softmax_with_sinks(batch: Batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       sm_scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Per-request causal attention in fp32 on the CPU, each head's softmax over its keys and
    the sink's logit (a column whose value is zero); no plan."""
    q, k, v, sinks = q.float().cpu(), k.float().cpu(), v.float().cpu(), sinks.float().cpu()
    group = q.shape[1] // k.shape[2]
    outs, start = [], 0
    for row, seq_len, n in zip(batch.block_table, batch.seq_lens, batch.query_lens, strict=True):
        seq_len, n = int(seq_len), int(n)
        pages = torch.from_numpy(row[: -(-seq_len // PAGE)].astype(np.int64))
        keys = k[pages].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
        values = v[pages].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + n], keys) * sm_scale
        future = torch.arange(seq_len)[None, :] > torch.arange(seq_len - n, seq_len)[:, None]
        scores = scores.masked_fill(future, -math.inf)
        with_sink = torch.cat([scores, sinks[:, None, None].expand(-1, n, 1)], dim=-1)
        probs = torch.softmax(with_sink, dim=-1)[..., :-1]
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
        start += n
    return torch.cat(outs)


def fa3_flat(batch: Batch, layer: Any, shape: Shape, sinks: torch.Tensor) -> torch.Tensor:
    """vLLM's FlashAttention 3 over the whole batch, flat, with ``s_aux`` as vLLM passes it."""
    attention, _ = vllm_kernels.fa3_kernels()
    qsl = np.concatenate([[0], np.cumsum(batch.query_lens)]).astype(np.int32)
    out = torch.empty(layer.q.shape, dtype=DTYPE, device=DEVICE)
    attention(q=layer.q, k=layer.k, v=layer.v, out=out,
              cu_seqlens_q=torch.from_numpy(qsl).to(DEVICE),
              max_seqlen_q=int(batch.query_lens.max()),
              seqused_k=torch.from_numpy(batch.seq_lens).to(DEVICE),
              max_seqlen_k=int(batch.seq_lens.max()), softmax_scale=shape.sm_scale,
              causal=True, window_size=[-1, -1],
              block_table=torch.from_numpy(batch.block_table).to(DEVICE), softcap=0.0,
              return_softmax_lse=True, fa_version=3, s_aux=sinks)
    return out


def sinks_for(shape: Shape, seed: int) -> torch.Tensor:
    """One logit per query head in [2, 8), around these rows' log-sum-exps (a few hundred keys
    of unit-variance logits); bf16, as gpt-oss's parameter is."""
    gen = torch.Generator().manual_seed(seed)
    return (2 + 6 * torch.rand(shape.num_qo_heads, generator=gen)).to(DTYPE).to(DEVICE)


def check_both(results: list[dict[str, Any]],  # noqa: F811
               name: str, got: torch.Tensor, batch: Batch, layer: Any, shape: Shape,
               sinks: torch.Tensor) -> None:
    want = softmax_with_sinks(batch, layer.q, layer.k, layer.v, shape.sm_scale, sinks)
    check_close_ulp(results, f"{name}/fp32-reference", got, want, TOL)
    if fa3_unsupported_reason("NHD") is None:
        check_close_ulp(results, f"{name}/fa3-flat-s_aux", got,
                        fa3_flat(batch, layer, shape, sinks), TOL)


@pytest.mark.parametrize("scenario", ["two_level_tree", "sampling_siblings",
                                      "prefill_chunks_and_decodes"])
def test_sinks_enter_every_rows_softmax_once(
    scenario: str, kernel: str, workspace: torch.Tensor,  # noqa: F811
    results: list[dict[str, Any]], request: pytest.FixtureRequest,  # noqa: F811
) -> None:
    shape = Shape(8, 2, 128)
    batch = SCENARIOS[scenario][0](np.random.default_rng(3))
    plan = plan_for(batch)
    assert plan.num_levels >= 2, "the planner found no sharing: nothing to split the keys"
    executor = planned_executor(workspace, plan, shape, kernel)
    for seed in range(2):  # one plan, two layers with their own sinks
        layer = random_layer(batch, shape, seed=20 + seed)
        sinks = sinks_for(shape, seed)
        out = torch.full(layer.q.shape, math.nan, dtype=DTYPE, device=DEVICE)
        executor.run(layer.q, layer.k, layer.v, out, sinks=sinks)
        check_both(results, f"{request.node.name}/layer{seed}", out, batch, layer, shape, sinks)


@pytest.mark.parametrize("mode", ["fused", "graphed"])
def test_sinks_in_mixed_steps_run_split(
    mode: str, workspace: torch.Tensor, results: list[dict[str, Any]],  # noqa: F811
    request: pytest.FixtureRequest,
) -> None:
    """A mixed step split: the prefill rows take the sink in the flat FA3 call (``s_aux``), the
    decode rows after their cascade's merge, eagerly or from the layer's CUDA graph."""
    if reason := fa3_unsupported_reason("NHD"):
        pytest.skip(reason)
    shape = Shape(8, 2, 128)
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=mode == "graphed")
    planner = CascadePlanner()
    rng = np.random.default_rng(9)
    batches = [mixed_batch(rng, s, decode_rows=12) for s in range(3)]
    cache = random_layer(max(batches, key=lambda b: b.num_blocks), shape, seed=5)
    sinks = sinks_for(shape, 1)
    for s, batch in enumerate(batches):
        split_executor_step(executor, planner, batch, shape, padded_rows=16)
        layer = dataclasses.replace(cache, q=random_layer(batch, shape, seed=30 + s).q)
        out = torch.full(layer.q.shape, math.nan, dtype=DTYPE, device=DEVICE)
        executor.run(layer.q, layer.k, layer.v, out, sinks=sinks)
        check_both(results, f"{request.node.name}/step{s}", out, batch, layer, shape, sinks)
    if mode == "graphed":
        assert executor.graphs is not None and executor.graphs.replays > 0


def test_a_sink_applied_twice_fails_the_comparison(
    workspace: torch.Tensor, results: list[dict[str, Any]],  # noqa: F811
) -> None:
    """The comparison has teeth: the sink entered twice (once more on the merged output) moves
    outputs far beyond the tolerance."""
    shape = Shape(8, 2, 128)
    batch = SCENARIOS["two_level_tree"][0](np.random.default_rng(3))
    executor = planned_executor(workspace, plan_for(batch), shape, "flashinfer")
    layer = random_layer(batch, shape, seed=20)
    sinks = sinks_for(shape, 0)
    out = torch.empty(layer.q.shape, dtype=DTYPE, device=DEVICE)
    executor.run(layer.q, layer.k, layer.v, out, sinks=sinks)
    apply_sinks(out, executor.lse / 1.4426950408889634, sinks)
    with pytest.raises(AssertionError):
        check_both(results, "sink-twice", out, batch, layer, shape, sinks)
    results[-1]["outcome"] = "fail, as it must"
