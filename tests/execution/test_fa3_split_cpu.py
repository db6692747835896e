"""Mixed prefill+decode steps run split by the FA3 executor (``execution.fa3_split``), on a CPU.

The decode rows are planned alone (every other row as padding, as the step session plans a
mixed step), the executor runs the other rows in one flat call and the decode rows' cascade on
their gathered queries, eagerly, fused or from (stand-in) CUDA graphs. FlashAttention 3 and
vLLM's merge are the torch stand-ins of ``test_fa3_executor_cpu``; every output row is checked
against per-request attention of the whole batch with no plan (``dense_attention``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from test_fa3_executor_cpu import (  # noqa: F401  (fake_fa3: a fixture)
    CALLS,
    TRITON_ON_CPU,
    fake_fa3,
    replaying_capture,
)
from test_planner import batches, make_batch
from test_reference import dense_attention, kv_cache
from vllm_cascade_plugin.execution.fa3 import FlashAttnCascadeExecutor
from vllm_cascade_plugin.execution.fa3_split import flat_rows
from vllm_cascade_plugin.planning.planner import CascadePlanner, plan_cascade


def split_plan(batch, planner=None):
    """The plan of the batch's decode rows alone (the others as padding), and which they are."""
    decode = batch.query_lens == 1
    lens = decode.astype(np.int32)
    if planner is None:
        plan = plan_cascade(batch.block_table, batch.seq_lens, lens, batch.page_size,
                            max_levels=3)
    else:
        plan = planner.plan(batch.block_table, batch.seq_lens, lens, batch.page_size)
    return plan, decode


def vllm_rows(batch):
    """What vLLM's FlashAttention metadata holds for the batch: query start locations and the
    block table, as tensors (on the GPU in an engine), and the longest query and row."""
    qsl = np.concatenate([[0], np.cumsum(batch.query_lens)]).astype(np.int32)
    return (torch.from_numpy(qsl), torch.from_numpy(batch.block_table),
            int(batch.query_lens.max()), int(batch.seq_lens.max()), qsl)


def planned_split(batch, plan, decode, executor, heads, kv_heads, d, dtype, padded_rows=0):
    qsl_t, table_t, max_q, max_k, qsl = vllm_rows(batch)
    split = flat_rows(qsl_t, table_t, max_q, max_k, qsl, batch.seq_lens, decode,
                      torch.device("cpu"))
    executor.plan(plan, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                  page_size=batch.page_size, sm_scale=d**-0.5, logits_soft_cap=None,
                  q_dtype=dtype, kv_dtype=dtype, device=torch.device("cpu"),
                  padded_rows=padded_rows, split=split)
    return split


@settings(max_examples=160, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_requests=6), dtype=st.sampled_from([torch.float32, torch.float16]),
       fused=st.booleans(), with_sinks=st.booleans(), seed=st.integers(0, 2**16))
# A padding row (no query) longer than its table: the flat call reads nothing of it.
@example(batch=make_batch([[2], [0, 3], []], [1, 2, 3], [1, 2, 0], 1), dtype=torch.float32,
         fused=False, with_sinks=True, seed=0)
def test_a_split_step_equals_per_request_attention_of_every_row(batch, dtype, fused, with_sinks,
                                                                seed):
    decode = batch.query_lens == 1
    if not decode.any() or not (batch.query_lens > 1).any():
        return  # not a mixed step
    fused = fused and TRITON_ON_CPU
    plan, decode = split_plan(batch)
    assert plan.stats.num_tokens == int(decode.sum())
    heads, kv_heads, d = 4, 2, 64
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, fused_decode=fused)
    split = planned_split(batch, plan, decode, executor, heads, kv_heads, d, dtype)
    tokens = int(batch.query_lens.sum())
    assert executor.rows == tokens == split.num_tokens
    CALLS.clear()
    k_cache, v_cache = kv_cache(batch.num_blocks, batch.page_size, kv_heads, d, dtype, seed)
    q = torch.randn(tokens, heads, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    out = torch.full(q.shape, math.nan, dtype=dtype)
    # Sinks (gpt-oss): the flat rows take them in the flat call, the decode rows after their merge.
    sinks = 3 * torch.rand(heads, generator=torch.Generator().manual_seed(seed)) if with_sinks \
        else None
    executor.run(q, k_cache, v_cache, out, sinks=sinks)
    want, _ = dense_attention(batch, q, k_cache, v_cache, d**-0.5, sinks=sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    # The first call is the flat one, over every row; the decode rows' cascade reads only them.
    assert CALLS[0]["causal"] and CALLS[0]["rows"] == tokens
    assert all(c["rows"] <= int(decode.sum()) for c in CALLS[1:])


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs Triton (its CPU interpreter)")
def test_mixed_steps_of_one_decode_layout_replay_one_graph_per_layer_whatever_their_prefills():
    """Six decode rows behind two documents, and each step a different prefill (another
    request, another length, another place in the batch): the decode rows' cascade is
    captured once per layer and replayed by every later mixed step of that layout; each
    step equals per-request attention."""
    layers, heads, kv_heads, d = 2, 4, 2, 64
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=True)
    executor.graphs.capture = replaying_capture
    planner = CascadePlanner()
    gen = torch.Generator().manual_seed(7)
    caches = [kv_cache(64, 16, kv_heads, d, torch.float32, seed=20 + i) for i in range(layers)]
    steps = 5
    for s in range(steps):
        table = [[1, 2, 3, 20 + r] if r % 2 else [4, 5, 6, 7, 30 + r] for r in range(6)]
        seq = [16 * (len(row) - 1) + 5 + s for row in table]
        query = [1] * 6
        prefill = [40 + s, 41 + s] if s % 2 else [1, 2, 3, 50 + s]  # new, or on a document
        at = s % 7
        table.insert(at, prefill)
        seq.insert(at, 16 * (len(prefill) - 1) + 9 + s)
        query.insert(at, 3 + 2 * s)
        batch = make_batch(table, seq, query, page_size=16)
        plan, decode = split_plan(batch, planner)
        assert plan.num_levels == 2
        planned_split(batch, plan, decode, executor, heads, kv_heads, d, torch.float32,
                      padded_rows=8)
        assert executor._step.graph_key is not None and executor._step.rows == 8
        for k_cache, v_cache in caches:
            # vLLM's query and output of a mixed step: wherever its allocator puts them.
            q = torch.randn(int(batch.query_lens.sum()), heads, d, generator=gen)
            out = torch.full(q.shape, math.nan)
            executor.run(q, k_cache, v_cache, out)
            want, _ = dense_attention(batch, q, k_cache, v_cache, d**-0.5)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert executor.graphs.captures == layers
    assert executor.graphs.replays == layers * steps - layers - 1


def test_a_split_plan_takes_a_16_bit_cache_and_the_decode_rows_plan_only():
    batch = make_batch([[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 7]], [60, 50, 40], [1, 1, 6], 16)
    plan, decode = split_plan(batch)
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4)
    whole = batch.plan()  # every row: not what the split runs
    with pytest.raises(ValueError, match="decode rows"):
        planned_split(batch, whole, decode, executor, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="16-bit"):
        qsl_t, table_t, max_q, max_k, qsl = vllm_rows(batch)
        executor.plan(plan, num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                      sm_scale=0.125, logits_soft_cap=None, q_dtype=torch.bfloat16,
                      kv_dtype=torch.float8_e4m3fn, device=torch.device("cpu"),
                      split=flat_rows(qsl_t, table_t, max_q, max_k, qsl, batch.seq_lens,
                                      decode, torch.device("cpu")))


def test_the_flat_rows_zero_the_decode_rows_kv_and_find_their_queries():
    batch = make_batch([[1, 2, 9], [1, 2, 3, 4], [1, 2, 8], [5]], [40, 60, 35, 7],
                       [1, 17, 1, 7], 16)
    qsl_t, table_t, max_q, max_k, qsl = vllm_rows(batch)
    rows = flat_rows(torch.cat([qsl_t, qsl_t[-1:]]), table_t, max_q, max_k, qsl,
                     batch.seq_lens, batch.query_lens == 1, torch.device("cpu"))
    # One padding row past the batch (vLLM pads its rows for CUDA graphs): no queries, no KV.
    assert rows.seq_lens.tolist() == [0, 60, 0, 7, 0]
    assert rows.decode_tokens.tolist() == [0, 18] and rows.num_decode == 2
    assert rows.num_tokens == 26 and dataclasses.is_dataclass(rows)
