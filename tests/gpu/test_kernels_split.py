"""Mixed prefill+decode steps run split by the FA3 executor (``execution.fa3_split``) on the
GPU, against FlashInfer's flat prefill attention of the whole batch (an independent kernel).

The decode rows are planned alone, as the step session plans a mixed step; their cascade runs
eagerly (fused and unfused) and from CUDA graphs over consecutive steps whose prefill rows
change (other requests, lengths and places in the batch) while the decode rows keep their
layout: one capture per layer, replays after. Tolerances are ``test_kernels``', but the rows
of a prefill chunk of its own attend to as few as 81 keys, where ``|o|`` can reach 1 and two
flat kernels then differ by one bf16 ulp of 2^-7: outputs are held to ``check_close_ulp``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch

from gpu.test_kernels import (  # noqa: F401  (workspace, results: fixtures)
    DTYPE,
    LSE_TOL,
    PAGE,
    TOL,
    Batch,
    Pages,
    Shape,
    check_close,
    check_close_ulp,
    flat_prefill,
    random_layer,
    results,
    workspace,
)
from vllm_cascade_plugin.execution.fa3_split import flat_rows
from vllm_cascade_plugin.execution.kernels import FlashAttnCascadeExecutor, fa3_unsupported_reason
from vllm_cascade_plugin.planning.planner import CascadePlanner

DEVICE = torch.device("cuda")
STEPS = 4
LAYERS = 2


def mixed_batch(rng: np.random.Generator, step: int, decode_rows: int = 24) -> Batch:
    """``decode_rows`` requests on four documents of 1K tokens (interleaved, as requests of
    several documents are), one token longer each step, and two prefill chunks that change
    every step: a new request's first chunk behind a document (a prefix-cache hit), and
    another's chunk of its own; placed among the decode rows at a different row each step."""
    pages = Pages()
    docs = [pages.new(64) for _ in range(4)]
    rows: list[tuple[list[int], int, int]] = []
    for r in range(decode_rows):
        rows.append((docs[r % 4], 64 * PAGE + 40 + r + step, 1))
    rows.insert((5 * step + 3) % decode_rows, (docs[step % 4], 64 * PAGE + 30 + 7 * step,
                                                30 + 7 * step))
    rows.insert((3 * step + 11) % decode_rows, ([], 200 + 9 * step, 120 + 9 * step))
    for shared, seq_len, query_len in rows:
        pages.add(shared, seq_len, query_len)
    return pages.build(rng)


def split_executor_step(executor: Any, planner: CascadePlanner, batch: Batch, shape: Shape,
                        padded_rows: int = 0) -> None:
    decode = batch.query_lens == 1
    plan = planner.plan(batch.block_table, batch.seq_lens, decode.astype(np.int32), PAGE)
    assert plan.num_levels == 2 and plan.stats.num_tokens == int(decode.sum())
    qsl = np.concatenate([[0], np.cumsum(batch.query_lens)]).astype(np.int32)
    # vLLM's metadata of the step, on the GPU: query start locations and the block table.
    split = flat_rows(torch.from_numpy(qsl).to(DEVICE),
                      torch.from_numpy(batch.block_table).to(DEVICE),
                      int(batch.query_lens.max()), int(batch.seq_lens.max()), qsl,
                      batch.seq_lens, decode, DEVICE)
    executor.plan(plan, num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
                  head_dim=shape.head_dim, page_size=PAGE, sm_scale=shape.sm_scale,
                  logits_soft_cap=None, q_dtype=DTYPE, kv_dtype=DTYPE, device=DEVICE,
                  padded_rows=padded_rows, split=split)
    assert executor.rows == batch.num_tokens


@pytest.fixture(autouse=True)
def fa3() -> None:
    if reason := fa3_unsupported_reason("NHD"):
        pytest.skip(reason)


@pytest.mark.parametrize("mode", ["fused", "unfused", "graphed"])
def test_split_mixed_steps_match_flat_attention(
    mode: str, workspace: torch.Tensor, results: list[dict[str, Any]],  # noqa: F811
    request: pytest.FixtureRequest,
) -> None:
    shape = Shape(32, 8, 128)
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, fused_decode=mode != "unfused",
                                        cuda_graphs=mode == "graphed")
    planner = CascadePlanner()
    rng = np.random.default_rng(5)
    batches = [mixed_batch(rng, s) for s in range(STEPS)]
    # Each layer's cache is the same tensor every step, as an engine's is (a graph bakes in its
    # address); its contents and the step's queries are new each step.
    caches = [random_layer(max(batches, key=lambda b: b.num_blocks), shape, seed=i)
              for i in range(LAYERS)]
    gen = torch.Generator(DEVICE).manual_seed(7)
    for s, batch in enumerate(batches):
        split_executor_step(executor, planner, batch, shape, padded_rows=32)
        step = executor._step
        assert (step.graph_key is not None) == (mode == "graphed")
        assert step.fused_decode == (mode != "unfused")
        prefill = flat_prefill(workspace, batch, shape)
        for i, cache in enumerate(caches):
            fresh = random_layer(batch, shape, seed=100 * s + i)
            cache.k.copy_(torch.randn(cache.k.shape, generator=gen, device=DEVICE, dtype=DTYPE))
            cache.v.copy_(torch.randn(cache.v.shape, generator=gen, device=DEVICE, dtype=DTYPE))
            layer = dataclasses.replace(cache, q=fresh.q)
            out = torch.full(layer.q.shape, math.nan, dtype=DTYPE, device=DEVICE)
            executor.run(layer.q, layer.k, layer.v, out)
            want, want_lse = prefill.run(layer.q, layer.kv, return_lse=True)
            name = f"{request.node.name}/step{s}/layer{i}"
            check_close_ulp(results, name, out, want, TOL)
            decode = torch.from_numpy(np.flatnonzero(
                np.repeat(batch.query_lens == 1, batch.query_lens))).to(DEVICE)
            # The executor's LSE: the decode rows', in their order (the padded rows after).
            got_lse = executor.lse[: decode.numel()]
            check_close(results, f"{name}-lse", got_lse, want_lse[decode], LSE_TOL)
    if mode == "graphed":
        assert executor.graphs is not None
        assert executor.graphs.captures == LAYERS  # every step the same decode layout
        assert executor.graphs.replays == LAYERS * STEPS - LAYERS - 1
