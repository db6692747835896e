"""A histogram of per-step host times in fixed buckets, and its percentiles. Standard library only.

The bucket bounds never change, so the counts of two moments subtract (the steps in between)
and the counts of several processes add up, as a Prometheus histogram's do: the periodic log
line, ``/metrics`` (``vllm_cascade_step_planning_seconds``) and ``benchmarks/serve/results.py``
read percentiles from the same buckets. A percentile is interpolated linearly inside the bucket
that holds it (as Prometheus's ``histogram_quantile``), so it is exact to a bucket's width:
the bounds step by 1.5-2x from 5 µs to 100 ms.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# Upper bounds (seconds, inclusive) of every bucket but the last, which holds what is above.
BOUNDS_S: tuple[float, ...] = (
    5e-6, 10e-6, 20e-6, 30e-6, 50e-6, 75e-6, 100e-6, 150e-6, 200e-6, 300e-6, 500e-6, 750e-6,
    1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 10e-3, 20e-3, 50e-3, 100e-3)


def bucket(seconds: float, bounds: Sequence[float] = BOUNDS_S) -> int:
    """The index of the bucket that counts ``seconds``: the first whose bound holds it."""
    return bisect.bisect_left(bounds, seconds)


def quantile(counts: Sequence[float], q: float,
             bounds: Sequence[float] = BOUNDS_S) -> float | None:
    """The ``q``-quantile (0 < q <= 1) of the values counted per bucket (``counts``: one more
    than ``bounds``, not cumulative), in the bounds' unit; None when nothing was counted. Inside
    a bucket the values are taken as spread evenly from the bound below (0 for the first); in
    the last bucket, above every bound, the quantile is the largest bound."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    below = 0.0
    for i, n in enumerate(counts[: len(bounds)]):
        if n > 0 and below + n >= rank:
            lower = bounds[i - 1] if i else 0.0
            return lower + (bounds[i] - lower) * (rank - below) / n
        below += n
    return float(bounds[-1])
