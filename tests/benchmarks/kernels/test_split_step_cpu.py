"""``benchmarks.kernels.split_step`` on a CPU: its mixed batches are what its docstring says (decode
rows sharing their document's pages, one prefill row), the cost model's estimates of their
decode rows agree with a plan built independently of the bench, and the implied per-step term
is the gap the model misses."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.kernels import split_step as sb
from vllm_cascade_plugin.planning.cost import (
    AttentionShape,
    cost_model_for,
    decide,
    flash_attn_flat,
)
from vllm_cascade_plugin.planning.planner import plan_cascade


@pytest.mark.parametrize("case", [sb.Case(16, 4, 8192, 256, 512, True),
                                  sb.Case(32, 16, 2048, 256, 2048, False)])
def test_a_case_batch_shares_exactly_each_document_and_has_one_prefill_row(case):
    batch = sb.build_batch(case, np.random.default_rng(3))
    assert len(batch.seq_lens) == case.decode + 1
    prefill = np.flatnonzero(batch.query_lens > 1)
    assert prefill.tolist() == [case.decode // 2]
    assert batch.query_lens[prefill[0]] == case.prefill
    doc_pages = case.doc_tokens // sb.PAGE
    decode_rows = np.flatnonzero(batch.query_lens == 1)
    for i, r in enumerate(decode_rows):
        pages = -(-int(batch.seq_lens[r]) // sb.PAGE)
        # every row's first pages are its document's: the same as the other rows of it
        same_doc = decode_rows[i % case.docs]
        assert (batch.block_table[r, :doc_pages] == batch.block_table[same_doc, :doc_pages]).all()
        assert (batch.block_table[r, pages:] == 0).all()
    # documents differ, and own pages are every row's own
    firsts = {int(batch.block_table[r, 0]) for r in decode_rows}
    assert len(firsts) == case.docs
    own = np.concatenate([batch.block_table[r, doc_pages:-(-int(batch.seq_lens[r]) // sb.PAGE)]
                          for r in decode_rows])
    assert len(set(own.tolist())) == len(own)
    behind = batch.block_table[prefill[0], 0] == batch.block_table[decode_rows[0], 0]
    assert behind == case.prefill_behind_doc
    assert batch.block_table.max() < batch.num_blocks


def test_model_estimates_are_the_cost_models_on_the_decode_rows_without_the_step_term():
    case = sb.Case(64, 4, 8192, 256, 512, True)
    batch = sb.build_batch(case, np.random.default_rng(0))
    cascade, flat = sb.model_estimates(case, batch)
    # An independent plan of the decode rows alone (the prefill row dropped, not padded).
    keep = batch.query_lens == 1
    plan = plan_cascade(batch.block_table[keep], batch.seq_lens[keep],
                        np.ones(int(keep.sum()), np.int32), sb.PAGE)
    shape = AttentionShape(32, 8, 128, 2, num_layers=32)
    model = flash_attn_flat(cost_model_for("fa3", split=True))
    with_term = decide(plan, shape, model)
    assert flat == pytest.approx(with_term.flat_us)
    assert cascade == pytest.approx(with_term.cascade_us - model.step_fixed_us / 32)
    assert cascade < flat  # 64 rows behind 4 documents of 8K: the kernels alone win


def test_the_implied_step_term_is_what_the_model_misses():
    # measured: split 300 us over flat per step; model: cascade 5 us per layer under flat
    assert sb.implied_step_us(1000.0, 1300.0, 20.0, 25.0, layers=32) == pytest.approx(460.0)
    # a split that saves what the model says implies no per-step cost
    assert sb.implied_step_us(1000.0, 840.0, 20.0, 25.0, layers=32) == pytest.approx(0.0)


def test_cases_cover_both_document_sizes_and_both_prefill_kinds():
    assert {(c.docs, c.doc_tokens) for c in sb.CASES} == {(4, 8192), (16, 2048)}
    assert {c.prefill_behind_doc for c in sb.CASES} == {True, False}
    assert len({c.label for c in sb.CASES}) == len(sb.CASES)
