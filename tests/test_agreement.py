"""The plugin-on vs. plugin-off comparison rule (vllm_cascade_plugin.agreement), by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_cascade_plugin import agreement


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
