"""``benchmarks.host.step``: the runner hooks' host work per step, timed on the batches the
planner bench uses; every plan it times must be the plan a fresh planner makes."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.host import planner as pb
from benchmarks.host import step as shb
from benchmarks.host import step_compare as compare
from benchmarks.host import step_toggle as toggle


@pytest.fixture(autouse=True)
def own_session():
    """The bench sets up the process's step session: put it back as it was."""
    from vllm_cascade_plugin import stats
    from vllm_cascade_plugin.step import session

    saved = dict(vars(session))
    yield
    vars(session).clear()
    vars(session).update(saved)
    stats.reset()


def test_the_timed_steps_are_planned_as_a_fresh_planner_plans_them():
    """``run(check=True)`` compares every timed step's plan with ``plan_cascade`` of the same
    rows (it raises on a difference); steady decode of 32 rows on 4 documents runs cascade,
    and every churn step (a request arrives and prefills) is a mixed step, kept flat."""
    case = shb.CASES[1]
    assert case.requests == 32
    times, cascade = shb.run(case, pb.DecodeBatch, 12, check=True)
    assert len(times) == 12 and all(t > 0 for t in times) and cascade == 12
    times, cascade = shb.run(case, pb.ChurnBatch, 12, check=True)
    assert cascade == 0


def test_the_case_with_few_rows_per_document_is_flat_as_the_cost_model_says():
    from vllm_cascade_plugin.planning.cost import decide
    from vllm_cascade_plugin.planning.planner import plan_cascade
    from vllm_cascade_plugin.step import session

    case = shb.CASES[0]
    batch = pb.DecodeBatch(case, np.random.default_rng(1))
    _, cascade = shb.run(case, pb.DecodeBatch, 4, check=True)
    plan = plan_cascade(batch.block_table, batch.seq_lens, batch.query_lens, pb.PAGE_SIZE)
    assert session.steady_cost_model is not None and session.shape is not None
    assert cascade == 0 and not decide(plan, session.shape, session.steady_cost_model).use_cascade


def test_through_model_runner_v2s_hook_rows_in_vllms_order_are_planned_as_fresh():
    """The ``v2_*`` columns: the V2 hook puts the rows in vLLM's batch order (an arriving
    request's prefill row goes behind the decode rows, moving the rows after its slot every
    step), and every plan it times is the fresh plan of the rows in that order."""
    case = shb.CASES[4]  # 256 rows behind one 32K prefix: its churn steps run cascade
    times, cascade = shb.run(case, pb.ChurnBatch, 8, check=True, v2=True)
    assert len(times) == 8 and cascade == 8
    times, cascade = shb.run(shb.CASES[1], pb.DecodeBatch, 8, check=True, v2=True)
    assert cascade == 8


def test_through_the_v1_runners_hook_the_rows_of_its_batch_are_planned_as_fresh(monkeypatch):
    """The ``v1_*`` columns: the V1 hook reads the rows from the runner's persistent batch (the
    requests' keys noted from the scheduler output, as the hooks note them) and every plan it
    times is the fresh plan of those rows; with nothing shared, the steps after the pre-check's
    proof are known unshared without their rows (``unshared_rows``): the planner never sees
    them."""
    from vllm_cascade_plugin import stats
    from vllm_cascade_plugin.stats import counters as c

    times, cascade = shb.run(shb.CASES[4], pb.ChurnBatch, 8, check=True, v1_hook=True)
    assert len(times) == 8 and cascade == 8
    times, cascade = shb.run(shb.CASES[1], pb.DecodeBatch, 8, check=True, v1_hook=True)
    assert cascade == 8
    from vllm_cascade_plugin.integration import hooks_dispatch

    read, plan_rows = [], hooks_dispatch.plan_rows
    monkeypatch.setattr(hooks_dispatch, "plan_rows",
                        lambda *args, **kwargs: read.append(1) or plan_rows(*args, **kwargs))
    stats.reset()
    times, cascade = shb.run(shb.CASES[5], pb.DecodeBatch, 8, check=True, v1_hook=True)
    assert cascade == 0 and shb.CASES[5].name.startswith("no sharing")
    assert stats.snapshot().planning_paths[c.PATH_UNSHARED] == 9  # the untimed first one too
    assert len(read) == 1  # the first step's rows: the proof
    assert "v1_churn_p50_us" in shb.measure(shb.CASES[1], 3, 1, check=False)


def test_the_comparison_gives_each_figure_before_over_after_with_its_spread():
    before = [[{"case": "c", "steady_p50_us": 200.0, "steady_p99_us": 400.0}],
              [{"case": "c", "steady_p50_us": 300.0, "steady_p99_us": 400.0}]]
    after = [[{"case": "c", "steady_p50_us": 100.0, "steady_p99_us": 400.0}],
             [{"case": "c", "steady_p50_us": 100.0, "steady_p99_us": 800.0}]]
    p50, p99 = compare.summary(before, after)
    assert "before   250.0 after   100.0  before/after 2.50 (2.00-3.00)" in p50
    assert "before   400.0 after   600.0  before/after 0.75 (0.50-1.00)" in p99


def test_parts_time_the_planner_and_the_decision_inside_each_timed_step():
    """``--parts``: each step's time in the planner and in the cost model's decision, measured
    inside the step's whole time (so they never exceed it), and the rest beside them."""
    parts: dict[str, list[int]] = {}
    times, cascade = shb.run(shb.CASES[1], pb.DecodeBatch, 10, check=True, v2=True,
                             parts=parts)
    assert cascade == 10 and set(parts) == set(shb.PARTS)
    for whole, planner, decision in zip(times, parts["planner"], parts["decision"], strict=True):
        assert planner > 0 and decision > 0 and planner + decision < whole
    row = shb.measure(shb.CASES[1], 5, 1, check=False, with_parts=True)
    for name in ("steady", "v2_steady"):
        assert row[f"{name}_planner_p50_us"] > 0 and row[f"{name}_rest_p50_us"] > 0
    # Churn steps of 32 rows are mixed steps the cost model's floor keeps flat unplanned.
    assert row["churn_planner_p50_us"] == 0 and row["churn_rest_p50_us"] > 0
    assert "steady_planner_p50_us" not in shb.measure(shb.CASES[1], 3, 1, check=False)


def test_the_toggle_bench_runs_both_ways_with_the_same_decisions():
    """``benchmarks.host.step_toggle``: the continuation off (every step read and pre-checked)
    and on, over the same steps; every variant makes the same cascade-or-flat decisions both
    ways (its steps are ``benchmarks.host.step``'s, whose plans the tests above check against
    fresh ones), and
    each figure has its rounds' ratio."""
    row = toggle.measure(shb.CASES[1], steps=12, rounds=2)
    for name, _, _ in toggle.VARIANTS:
        assert row[f"{name}_off_cascade_steps"] == row[f"{name}_on_cascade_steps"]
        median, low, high = row[f"{name}_p50_off_over_on"]
        assert 0 < low <= median <= high
    assert row["steady_on_cascade_steps"] == "12 of 12"
