"""How each planned step ends in the counters: cascade, or flat with exactly one reason; the
planning histogram and its percentiles; the flat steps in the log line and on /metrics."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from test_stats import clock, lines  # noqa: F401  (clock is a fixture)
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.stats import counters as c
from vllm_cascade_plugin.stats.histogram import BOUNDS_S, bucket, quantile
from vllm_cascade_plugin.stats.prometheus import PrometheusCounters

QUIET = logging.DEBUG  # fallbacks logged below the test's level


@pytest.fixture(autouse=True)
def fresh():
    stats.reset()
    yield
    stats.reset()


def partition_holds(counted: stats.Counters) -> bool:
    return (counted.steps_planned == counted.steps_cascade + sum(counted.flat_reasons.values())
            and counted.decode_steps_planned
            == counted.decode_steps_cascade + sum(counted.decode_flat_reasons.values()))


def test_every_planned_step_ends_once_as_cascade_or_flat_with_one_reason():
    """Each step below says what happens in it; the expected outcome is written beside it."""
    expected: list[tuple[bool, str | None]] = []  # (decode, flat reason or None: cascade)

    stats.record_planned(decode=True)  # the session's decision, then a fallback: the decision
    stats.flat_decision(c.COST_MODEL, 1.5)
    stats.record_fallback("kernel error", level=QUIET)
    expected.append((True, c.COST_MODEL))
    stats.end_step()

    stats.record_planned(decode=True)  # two fallbacks: the first one
    stats.record_fallback("plan does not match the batch", level=QUIET)
    stats.record_fallback("batch sequence lengths unknown", level=QUIET)
    expected.append((True, "plan does not match the batch"))
    stats.end_step()

    stats.record_planned(decode=False)  # two builders run the plan, a layer falls back after
    stats.record_cascade(1000, 100, decode=False)
    stats.record_cascade(1000, 100, decode=False)
    stats.record_fallback("kernel error", level=QUIET)
    expected.append((False, None))
    stats.end_step()

    stats.record_planned(decode=True)  # cascade chosen, nobody ran it, nobody said why
    expected.append((True, c.UNUSED))
    stats.end_step()
    stats.end_step()  # ending twice counts once

    stats.record_planned(decode=False)  # never ended by end_step: the next plan ends it
    stats.flat_decision(c.MIXED, 2.0)
    expected.append((False, c.MIXED))
    stats.record_planned(decode=True)
    stats.flat_decision(c.NO_SHARED)
    expected.append((True, c.NO_SHARED))
    assert stats.snapshot().flat_reasons[c.NO_SHARED] == 0  # still open
    stats.end_step()

    counted = stats.snapshot()
    flat = [(d, r) for d, r in expected if r is not None]
    assert counted.steps_planned == len(expected)
    assert counted.steps_cascade == 1 and counted.pages_flat == 1000  # once, not per builder
    assert counted.flat_reasons == {r: sum(x == r for _, x in flat) for _, r in flat}
    assert counted.decode_flat_reasons == {r: sum(x == r for d, x in flat if d)
                                           for d, r in flat if d}
    assert counted.flat_cost_ratio == {c.COST_MODEL: 1.5, c.MIXED: 2.0}
    assert counted.fallbacks == {"kernel error": 2, "plan does not match the batch": 1,
                                 "batch sequence lengths unknown": 1}
    assert partition_holds(counted)


def test_a_fallback_between_steps_is_no_steps_reason():
    stats.record_fallback("block id mirror error", level=QUIET)  # before any step
    stats.record_planned(decode=True)
    stats.record_cascade(10, 5, decode=True)
    stats.end_step()
    stats.record_fallback("runner hook error", level=QUIET)  # after it ended
    counted = stats.snapshot()
    assert counted.steps_cascade == 1 and not counted.flat_reasons and partition_holds(counted)


def test_nested_planning_blocks_count_once_and_the_time_goes_to_the_step_they_planned(
        monkeypatch):
    import time

    recorded: list[float] = []
    real = stats.record_planning
    monkeypatch.setattr(stats, "record_planning",
                        lambda s, cpu=0.0: recorded.append(s) or real(s, cpu))
    with stats.planning():
        stats.record_planned(decode=True)
        with stats.planning():
            time.sleep(0.002)
    assert len(recorded) == 1 and recorded[0] >= 0.002  # the outer block, the inner within it
    stats.end_step()
    stats.record_planned(decode=True)
    stats.record_planning(0.0005)
    stats.record_planning(0.0005)
    stats.end_step()
    counted = stats.snapshot()
    assert counted.planning_s == pytest.approx(recorded[0] + 0.001)
    assert counted.planning_buckets[bucket(recorded[0])] >= 1
    assert counted.planning_buckets[bucket(0.001)] >= 1 and sum(counted.planning_buckets) == 2


@pytest.mark.parametrize("value", [0.0, 5e-6, 5.0001e-6, 1e-3, 0.1, 0.2])
def test_a_value_is_counted_in_the_first_bucket_whose_bound_holds_it(value):
    index = bucket(value)
    assert value <= (BOUNDS_S[index] if index < len(BOUNDS_S) else float("inf"))
    assert index == 0 or value > BOUNDS_S[index - 1]


def test_quantiles_of_the_histogram_stay_within_the_bucket_of_the_exact_value():
    """Against numpy's percentile of the samples themselves: the interpolated value lies in
    the bucket that holds the exact one."""
    rng = np.random.default_rng(11)
    samples = rng.lognormal(np.log(300e-6), 1.0, 5000)
    counts = [0] * (len(BOUNDS_S) + 1)
    for value in samples:
        counts[bucket(float(value))] += 1
    for q in (0.1, 0.5, 0.9, 0.99):
        exact = float(np.quantile(samples, q))
        at = bucket(exact)
        got = quantile(counts, q)
        assert got is not None
        lower = BOUNDS_S[at - 1] if at else 0.0
        upper = BOUNDS_S[at] if at < len(BOUNDS_S) else BOUNDS_S[-1]
        assert lower <= got <= upper, (q, exact, got)
    assert quantile([0] * (len(BOUNDS_S) + 1), 0.5) is None
    # Evenly spread inside a bucket: 4 values up to 10 us; above every bound: the largest.
    assert quantile([0, 4, 0], 0.5, bounds=(5e-6, 10e-6)) == pytest.approx(7.5e-6)
    assert quantile([1, 0, 3], 0.9, bounds=(5e-6, 10e-6)) == 10e-6


def test_the_log_line_names_each_flat_reason_with_the_predicted_ratio(clock, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="vllm.cascade_plugin")
    for ratio in (1.1, 1.3):
        stats.record_planned(decode=True)
        stats.flat_decision(c.COST_MODEL, ratio)
    stats.record_planned(decode=True)
    stats.flat_decision(c.NO_SHARED)
    stats.record_planned(decode=True)
    stats.record_fallback("kernel planning error", level=QUIET)
    clock.now += 61
    stats.record_planned(decode=True)
    [line] = lines(caplog)
    assert (f"flat steps: {c.COST_MODEL} 2 (predicted 1.20x flat), "
            f"kernel planning error 1, {c.NO_SHARED} 1;") in line


def test_prometheus_counts_flat_steps_by_reason_and_planning_per_step(monkeypatch):
    """Steps counted through ``stats``, published to the metrics by ``snapshot()``."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    monkeypatch.setattr(stats, "_metrics", PrometheusCounters(registry, tp_rank="0"))

    def step(seconds: float, reason: str | None, decode: bool, ratio: float | None,
             path: str | None) -> None:
        stats.record_planned(decode)
        stats.record_planning(seconds)
        if path is not None:
            stats.plan_path(path)
        if reason is None:
            stats.record_cascade(10, 2, decode)
        elif reason == "planner error":
            stats.record_fallback(reason, level=QUIET)
        else:
            stats.flat_decision(reason, ratio)

    step(0.0004, c.COST_MODEL, True, 1.25, c.PATH_COST_FLOOR)
    step(0.0004, c.COST_MODEL, False, 0.75, c.PATH_SCRATCH)
    step(0.002, None, True, None, c.PATH_SCRATCH)  # cascade: its planning time only
    step(0.00001, "planner error", True, None, None)  # no path said: "other"
    stats.end_step()
    stats.record_builder(0.5, 0.125, 0.25, 0.0625)
    stats.snapshot()

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"vllm_cascade_{name}", {"tp_rank": "0", **labels})

    assert value("flat_steps_total", reason=c.COST_MODEL) == 2
    assert value("decode_flat_steps_total", reason=c.COST_MODEL) == 1
    assert value("decode_flat_steps_total", reason="planner error") == 1
    assert value("flat_cost_ratio_total", reason=c.COST_MODEL) == 2.0
    assert value("flat_cost_ratio_total", reason="planner error") is None
    assert value("step_planning_seconds_count") == 4
    assert value("step_planning_seconds_sum") == pytest.approx(0.00281)
    assert value("step_planning_seconds_bucket", le="0.0005") == 3
    assert value("step_planning_seconds_bucket", le="0.002") == 4
    assert value("planning_path_steps_total", path=c.PATH_SCRATCH) == 2
    assert value("planning_path_seconds_total", path=c.PATH_SCRATCH) == pytest.approx(0.0024)
    assert value("planning_path_steps_total", path=c.PATH_COST_FLOOR) == 1
    assert value("planning_path_steps_total", path=c.PATH_OTHER) == 1
    assert value("builder_seconds_total") == 0.5
    assert value("builder_staging_seconds_total") == 0.125
    assert value("builder_launch_seconds_total") == 0.0625
    assert value("builder_cpu_seconds_total") == 0.25
    stats.record_planned(True)  # a second publication adds only what was counted since
    stats.end_step()
    stats.snapshot()
    assert value("step_planning_seconds_count") == 5
    assert value("flat_steps_total", reason=c.COST_MODEL) == 2
