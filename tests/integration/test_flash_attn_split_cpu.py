"""A mixed prefill+decode step through vLLM's real FlashAttention builder and our impl, split
(``execution.fa3_split``): the decode rows as cascade, the prefill rows flat, from vLLM's own
metadata of the step. On a CPU, with the torch stand-ins of FlashAttention 3 and vLLM's merge
(``test_flash_attn_cpu``); every output row against dense attention of the whole batch."""

from __future__ import annotations

import dataclasses

import torch

from test_flash_attn_cpu import (  # noqa: F401  (fixtures; restored_session: autouse)
    fa_config,
    fa_engine,
    restored_session,
    run_layers,
)
from test_integration_cpu import batch, common_metadata
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.execution import kernels
from vllm_cascade_plugin.planning.cost import cost_model_for, flash_attn_flat
from vllm_cascade_plugin.step import session

SPLIT = flash_attn_flat(cost_model_for("fa3", split=True))


def test_a_mixed_step_runs_its_decode_rows_as_cascade_and_the_rest_flat(
        fa_engine, monkeypatch):  # noqa: F811
    """``batch()``: four decode rows (two sharing a prefix) and two prefill rows on the same
    prefix. The plan covers the decode rows alone; the executor takes vLLM's query start
    locations and block table for the flat call, and the output of every row is attention."""
    _config, builder, layers = fa_engine
    monkeypatch.setattr(session, "split_cost_model", SPLIT)  # what a graphed engine registers
    monkeypatch.setattr(session, "config", dataclasses.replace(session.config, split_mixed=True))
    # The decode rows' levels on the FA3 stand-in: the fused decode kernel's bf16 is wrong under
    # Triton's CPU interpreter (test_fa3_executor_cpu; test_fa3_split_cpu runs it in fp32).
    builder._cascade_executor = kernels.FlashAttnCascadeExecutor("NHD", fused_decode=False)
    table, seq, q = batch()
    step = session.plan_step(table, seq, q)
    assert step is not None and step.decision.use_cascade  # CASCADE_POLICY=always (fa_engine)
    assert step.decode_rows is not None and step.decode_rows.tolist() == list(q == 1)
    assert step.plan.stats.num_tokens == int((q == 1).sum()) == 4
    metadata = builder.build(0, common_metadata(table, seq, q))
    executor = metadata.cascade
    assert isinstance(executor, kernels.FlashAttnCascadeExecutor)
    flat, _, _ = executor._step.split
    assert flat.query_start_loc is metadata.query_start_loc  # vLLM's tensors, not copies
    assert flat.block_table is metadata.block_table
    assert flat.seq_lens.tolist() == [0, 0, 0, 0, *seq[4:].tolist()]
    assert metadata.cascade_rows == int(q.sum())
    run_layers(layers, metadata, table, seq, q)
    counters = stats.snapshot()
    assert counters.steps_cascade == 1 and counters.decode_steps_cascade == 0


def test_the_flash_attn_builder_splits_mixed_steps_only_with_graphs_and_a_16_bit_cache(
        fa_engine):  # noqa: F811
    _config, builder, _ = fa_engine
    args = builder._kernel_args
    assert builder._split_cost_model(True, args) == SPLIT
    assert builder._split_cost_model(False, args) is None  # eager decode rows: not worth it
    fp8 = dataclasses.replace(args, kv_dtype=torch.float8_e4m3fn)
    assert builder._split_cost_model(True, fp8) is None
