"""``benchmarks/calibration/break_even.py``: the plans it asks the cost model about are the
served workload's decode steps, and the break-even batch it reports is where ``decide`` turns."""

from __future__ import annotations

import json

import numpy as np

from benchmarks.calibration import break_even as be
from benchmarks.serve import expected
from benchmarks.serve import workloads as sw
from vllm_cascade_plugin.planning.cost import FA3_LAYER_GRAPHS_STEP_FIXED_US, decide
from vllm_cascade_plugin.planning.invariants import plan_violations

W = sw.WORKLOADS["chat_6k_system"]


def test_its_plans_are_the_workloads_decode_steps_one_shared_prompt_and_own_pages():
    for page in (16, 768):
        plan = be.decode_plan(W, 24, page, np.random.default_rng(0))
        assert plan.num_levels == 2 and plan.stats.group_sizes == (24,)
        assert plan.stats.shared_pages == (W.prefix_len // page,)
        assert plan.stats.num_tokens == plan.stats.num_requests == 24


def test_gpt_oss_is_planned_with_its_full_layers_shape():
    shape = be.shape_of(expected.MODELS / "gpt-oss-20b-dense")
    assert (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.num_layers) == (
        64, 8, 64, 12)


def test_the_break_even_batch_is_where_decide_turns_to_cascade(tmp_path):
    assert be.main(["--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "break_even.json").read_text())
    assert [r["model"] for r in result["rows"]] == list(expected.FAMILIES)
    for row in result["rows"]:
        folder = expected.MODELS / row["model"]
        shape, page = be.shape_of(folder), expected.model_of(folder).page
        turns = {}
        for name, model in be.GRAPHS.items():
            picks = [decide(be.decode_plan(W, b, page, np.random.default_rng(b)), shape,
                            model).use_cascade for b in be.BATCHES]
            first = picks.index(True) if True in picks else None
            assert all(picks[first:]) if first is not None else not any(picks)
            turns[name] = None if first is None else be.BATCHES[first]
            assert row[name]["break_even_batch"] == turns[name]
        # Per-layer graphs charge a step more, so cascade needs at least as many rows there.
        assert be.GRAPHS["per-layer graphs"].step_fixed_us == FA3_LAYER_GRAPHS_STEP_FIXED_US
        assert be.GRAPHS["per-layer graphs"].step_fixed_us > be.GRAPHS[
            "whole-step graphs"].step_fixed_us
        whole, layer = turns["whole-step graphs"], turns["per-layer graphs"]
        assert whole is not None and (layer is None or layer >= whole)


def test_its_plans_keep_the_plan_invariants():
    table, seq = be.decode_rows(W, 8, 16, np.random.default_rng(3))
    plan = be.decode_plan(W, 8, 16, np.random.default_rng(3))
    assert plan_violations(plan, table, seq, np.ones(8, np.int32)) == []
