"""The plugin-on vs. plugin-off comparison rule (vllm_cascade_plugin.face.agreement), by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_cascade_plugin.face import agreement


def _logprobs(*pairs: tuple[int, float]) -> dict[int, SimpleNamespace]:
    return {token: SimpleNamespace(logprob=lp) for token, lp in pairs}


def rec(tokens: list[int], logprobs: list[float], margins: list[float] | None = None) -> dict:
    return {"tokens": tokens, "logprobs": logprobs, "margins": margins or [1.0] * len(tokens)}


def test_the_tolerances_are_the_correctness_issues():
    assert (agreement.MEAN_TOL, agreement.MAX_TOL, agreement.MARGIN) == (0.02, 0.1, 0.1)


def test_record_keeps_chosen_logprobs_and_top2_margins_and_marks_completion_ends():
    output = SimpleNamespace(outputs=[
        SimpleNamespace(token_ids=[7, 9], logprobs=[_logprobs((7, -0.1), (8, -2.6)),
                                                    _logprobs((9, -1.0), (3, -0.5), (4, -3.0))]),
        SimpleNamespace(token_ids=[5], logprobs=[_logprobs((5, -0.2))]),  # n=2, logprobs=1
    ])
    record = agreement.record(output)
    assert record["tokens"] == [7, 9, -1, 5, -1]
    assert record["logprobs"] == [-0.1, -1.0, 0.0, -0.2, 0.0]
    # The chosen token need not be the top one: token 9's margin is top-1 minus top-2 (0.5).
    assert record["margins"] == pytest.approx([2.5, 0.5, 0.0, float("inf"), 0.0])


def test_compare_stops_at_the_first_diverging_token_and_skips_small_margins():
    run = [rec([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0], [1.0, 0.05, 1.0, 1.0])]
    replay = [rec([1, 2, 5, 4], [-1.01, -9.0, -9.0, -9.0])]
    # Token 2's margin is below 0.1 (skipped), token 3 diverges: only token 1 is compared.
    assert agreement.compare(run, replay) == (pytest.approx(0.01), pytest.approx(0.01), 1)
    assert agreement.compare([rec([-1], [0.0])], [rec([-1], [0.0])]) == (0.0, 0.0, 0)


def test_compare_restarts_after_a_completion_boundary_and_spans_requests():
    run = [rec([5, 6, -1, 7, 8], [-0.5, -0.7, 0.0, -0.2, -0.3], [0.5, 0.09, 0.0, 0.3, 0.3]),
           rec([1, 2, 3], [-0.1, -0.2, -0.3])]
    replay = [rec([5, 6, -1, 7, 9], [-0.52, -0.6, 0.0, -0.25, -0.1]),
              rec([1, 2, 3], [-0.13, -0.2, -0.36])]
    # Compared: 5 (0.02), 7 (0.05) -- 6 has a small margin, 8/9 diverge -- then 1, 2, 3.
    worst, mean, count = agreement.compare(run, replay)
    assert count == 5
    assert worst == pytest.approx(0.06)
    assert mean == pytest.approx((0.02 + 0.05 + 0.03 + 0.0 + 0.06) / 5)


def test_compare_needs_the_same_requests_on_both_sides():
    with pytest.raises(ValueError):
        agreement.compare([rec([1], [-1.0])], [])


@pytest.mark.parametrize(("worst", "mean", "count", "ok"), [
    (0.1, 0.02, 10, True),      # at both limits
    (0.1001, 0.001, 10, False),  # one token too far off
    (0.05, 0.0201, 10, False),   # too far off on average
    (0.0, 0.0, 0, False),        # nothing compared proves nothing
])
def test_agrees_needs_both_tolerances_and_something_compared(worst, mean, count, ok):
    assert agreement.agrees(worst, mean, count) is ok


def test_the_oracle_constants_are_the_issues():
    assert (agreement.MIN_COMPARED, agreement.RELATIVE) == (0.5, 1.5)
    assert agreement.REFERENCE_FLOOR == pytest.approx(agreement.MEAN_TOL / 10)


def test_measure_counts_the_reference_positions_without_boundaries():
    run = [rec([1, 2, -1, 3, 4, -1], [-1.0, -1.0, 0.0, -1.0, -1.0, 0.0])]
    reference = [rec([1, 9, -1, 3, 4, -1], [-1.01, -1.0, 0.0, -1.02, -1.03, 0.0])]
    # Token 2 diverges; the next completion starts afresh and compares both: 3 of 4 positions.
    dev = agreement.measure(run, reference)
    assert (dev.compared, dev.positions) == (3, 4)
    assert dev.fraction == pytest.approx(0.75)
    assert dev.mean == pytest.approx(0.02)
    assert agreement.Deviation(0.0, 0.0, 0, 0).fraction == 0.0


def dev(mean: float, fraction: float = 1.0, worst: float | None = None) -> agreement.Deviation:
    return agreement.Deviation(mean if worst is None else worst, mean, int(100 * fraction), 100)


@pytest.mark.parametrize(("plugin", "kernels", "ok"), [
    (dev(0.006), dev(0.004), True),             # exactly 1.5x the reference
    (dev(0.0061), dev(0.004), False),           # more than 1.5x: fails though far within 0.02
    (dev(0.003), dev(0.0), True),               # a reference of 0 counts as the floor, 0.002
    (dev(0.0031), dev(0.0), False),
    (dev(0.021), dev(0.02), False),             # within 1.5x, beyond the absolute tolerance
    (dev(0.01, worst=0.11), dev(0.01), False),  # one token beyond MAX_TOL
    (dev(0.004, 0.5), dev(0.004), True),        # half the positions compared is enough
    (dev(0.004, 0.49), dev(0.004), False),      # fewer is not
    (dev(0.0, 0.0), dev(0.004), False),         # nothing compared
    # The corrupted-plan shape: the first tokens diverge, the few compared ones far off.
    (dev(0.3, 0.05), dev(0.005), False),
    # One token beyond MAX_TOL, where two correct kernels' largest is nearly as far: fine.
    (dev(0.015, worst=0.118), dev(0.016, worst=0.093), True),
    (dev(0.015, worst=0.15), dev(0.016, worst=0.093), False),  # beyond 1.5 times theirs
    # A long workload: two kernels compare a third of the positions, the plugin as much.
    (dev(0.015, 0.33), dev(0.015, 0.33), True),
    (dev(0.015, 0.21), dev(0.015, 0.33), False),  # under two thirds of theirs
])
def test_agrees_with_reference_needs_coverage_tolerance_and_the_relative_bound(plugin, kernels,
                                                                               ok):
    assert agreement.agrees_with_reference(plugin, kernels) is ok


def test_beam_record_strips_the_prompt_and_keeps_the_order():
    out = SimpleNamespace(sequences=[SimpleNamespace(tokens=[5, 6, 7, 8], cum_logprob=-1.5),
                                     SimpleNamespace(tokens=[5, 6, 9, 8], cum_logprob=-2.0)])
    assert agreement.beam_record(out, 2) == {"beams": [[7, 8], [9, 8]],
                                             "cum_logprobs": [-1.5, -2.0]}


def beams(*pairs: tuple[list[int], float]) -> dict:
    return {"beams": [list(t) for t, _ in pairs], "cum_logprobs": [c for _, c in pairs]}


def test_compare_beams_matches_beams_by_tokens_whatever_their_rank():
    run = [beams(([1, 2], -1.0), ([3, 4], -1.1)), beams(([5, 6], -0.5), ([7, 8], -0.9))]
    reference = [beams(([3, 4], -1.14), ([1, 2], -1.0)), beams(([5, 6], -0.52), ([7, 9], -0.8))]
    dev = agreement.compare_beams(run, reference)
    # Matched: [3, 4] (|Δ| 0.04 over 2 tokens), [1, 2] (0), [5, 6] (0.02 / 2); [7, 9] missing.
    assert (dev.matched, dev.beams) == (3, 4)
    assert dev.worst == pytest.approx(0.02)
    assert dev.mean == pytest.approx((0.02 + 0.0 + 0.01) / 3)
    assert agreement.compare_beams([beams(([1], -1.0))], [beams(([2], -1.0))]) == \
        agreement.BeamDeviation(0.0, 0.0, 0, 1)
    with pytest.raises(ValueError):
        agreement.compare_beams(run, reference[:1])


def bdev(mean: float, fraction: float = 1.0, worst: float | None = None
         ) -> agreement.BeamDeviation:
    return agreement.BeamDeviation(mean if worst is None else worst, mean, int(32 * fraction), 32)


@pytest.mark.parametrize(("plugin", "kernels", "ok"), [
    (bdev(0.003), bdev(0.002), True),
    (bdev(0.004), bdev(0.002), False),               # cumulative logprobs 2x the reference's
    (bdev(0.002, 26 / 32), bdev(0.002), True),       # 6 of 32 beams missing: 1.5 x the floor
    (bdev(0.002, 25 / 32), bdev(0.002), False),      # 7 missing, the reference missed none
    (bdev(0.002, 20 / 32), bdev(0.002, 24 / 32), True),   # 12 missing vs the reference's 8
    (bdev(0.002, 19 / 32), bdev(0.002, 24 / 32), False),
    (bdev(0.002, 15 / 32), bdev(0.002, 15 / 32), False),  # under half the beams found
    (bdev(0.021), bdev(0.02), False),                # beyond MEAN_TOL per token
    (bdev(0.01, worst=0.2), bdev(0.01), False),      # one beam beyond MAX_TOL per token
    (bdev(0.0, 0.0), bdev(0.0), False),              # no beam in common
])
def test_beams_agree_against_the_two_kernel_reference(plugin, kernels, ok):
    assert agreement.beams_agree(plugin, kernels) is ok


@pytest.mark.parametrize(("plugin", "kernels", "agrees"), [
    ((0.15, 0.045, 500), (0.14, 0.040, 480), True),    # a large random model: both far off
    ((0.15, 0.065, 500), (0.14, 0.040, 480), False),   # mean beyond 1.5 times the kernels'
    ((0.25, 0.045, 500), (0.14, 0.040, 480), False),   # max beyond 1.5 times the kernels'
    ((0.09, 0.003, 500), (0.001, 0.0001, 480), True),  # both tiny: the floors apply
    ((0.0, 0.0, 0), (0.0, 0.0, 0), False),             # nothing compared
])
def test_agrees_relative_bounds_mean_and_max_by_two_correct_kernels(plugin, kernels, agrees):
    def deviation(worst, mean, compared):
        return agreement.Deviation(worst, mean, compared, 1000)

    assert agreement.agrees_relative(deviation(*plugin), deviation(*kernels)) is agrees
