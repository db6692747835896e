"""How a cascade run's outputs are compared with vLLM's flat attention: one rule for every check.

The engine correctness tests (``tests/gpu/test_engine.py``) and the soak
(``benchmarks/soak/bench.py``) run the same prompts with the plugin on and off, greedy,
``logprobs=2``, and compare the chosen tokens' logprobs position by position up to the first
token where the two runs diverge, only where both runs' top-2 margin exceeds :data:`MARGIN`
(below that, bf16 noise legitimately flips the argmax). They agree when the mean |Δ| is at
most :data:`MEAN_TOL` and the largest at most :data:`MAX_TOL`.

The engine oracle judges against the noise floor of the same run (:func:`agrees_with_reference`):
the plugin's mean and largest deviation from its plugin-off backend are at most :data:`RELATIVE`
times those between two correct kernels (FlashAttention vs. FlashInfer, plugin off) on the same
workload, and its comparison covers at least :data:`MIN_COMPARED` of the generated positions (a
comparison that stops at the first token proves little), or nearly as much as the two kernels'
own where theirs covers less. Beam search is compared by its finished beams
(:func:`beam_record`, :func:`compare_beams`, :func:`beams_agree`). ``vllm-cascade demo`` keeps
the relative bounds without the coverage (:func:`agrees_relative`).
Pure Python and numpy; vLLM's outputs are read by attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MEAN_TOL, MAX_TOL, MARGIN = 0.02, 0.1, 0.1
MIN_COMPARED = 0.5  # of the generated positions (beams, for beam search)
RELATIVE = 1.5  # the plugin's mean deviation, at most this times the two-kernel reference's
# A reference below this counts as this much: two kernels can agree to a few bf16 flips of a
# logit (1/128 near 1.0) on a workload, and 1.5 times nearly nothing would fail any legitimate
# reordering of the sums. A tenth of MEAN_TOL, where a one-page KV error moves the engine
# oracle's model by more than ten MEAN_TOL (tests/test_oracle_model.py).
REFERENCE_FLOOR = 0.002
# Beam search: of the reference's beams, this share may be missing from a run even when the
# two-kernel reference misses none (a near-tie between the k-th and (k+1)-th beam).
BEAM_FLOOR = 0.125


def record(output: Any) -> dict[str, list]:
    """Tokens, chosen-token logprobs and top-2 margins of a vLLM ``RequestOutput``.

    Every completion (``n > 1`` gives several) ends with a boundary token ``-1``, where
    :func:`compare` restarts. The request needs ``logprobs >= 1`` (2 for the margins).
    """
    tokens: list[int] = []
    chosen: list[float] = []
    margins: list[float] = []
    for completion in output.outputs:
        for token, top in zip(completion.token_ids, completion.logprobs, strict=True):
            ranked = sorted((lp.logprob for lp in top.values()), reverse=True)
            tokens.append(int(token))
            chosen.append(float(top[token].logprob))
            margins.append(ranked[0] - ranked[1] if len(ranked) > 1 else float("inf"))
        tokens.append(-1)
        chosen.append(0.0)
        margins.append(0.0)
    return {"tokens": tokens, "logprobs": chosen, "margins": margins}


def _completions(r: dict) -> list[tuple[list, list, list]]:
    """A record's completions (tokens, logprobs, margins), split at the boundary tokens."""
    ends = [i for i, token in enumerate(r["tokens"]) if token < 0]
    if not ends or ends[-1] != len(r["tokens"]) - 1:
        ends.append(len(r["tokens"]))  # a last completion without its boundary
    starts = [0, *(end + 1 for end in ends[:-1])]
    return [tuple(r[k][start:end] for k in ("tokens", "logprobs", "margins"))
            for start, end in zip(starts, ends, strict=True)]


def compare(on: Sequence[dict], off: Sequence[dict]) -> tuple[float, float, int]:
    """(max, mean) |Δ chosen logprob| over comparable positions, and how many there were.

    ``on`` and ``off`` are :func:`record` results of the same requests, in the same order. Each
    completion is compared up to its first diverging token; the next completion starts afresh.
    """
    diffs: list[float] = []
    for a, b in zip(on, off, strict=True):
        for (ta_, la_, ma_), (tb_, lb_, mb_) in zip(_completions(a), _completions(b),
                                                    strict=True):
            for ta, tb, la, lb, ma, mb in zip(ta_, tb_, la_, lb_, ma_, mb_, strict=False):
                if ta != tb:
                    break
                if ma > MARGIN and mb > MARGIN:
                    diffs.append(abs(la - lb))
    if not diffs:
        return 0.0, 0.0, 0
    return float(np.max(diffs)), float(np.mean(diffs)), len(diffs)


def agrees(worst: float, mean: float, compared: int) -> bool:
    """The verdict on :func:`compare`'s result: something was compared, within both tolerances."""
    return compared > 0 and worst <= MAX_TOL and mean <= MEAN_TOL


@dataclass(frozen=True)
class Deviation:
    """:func:`compare`'s result and how many generated positions there were to compare."""

    worst: float
    mean: float
    compared: int
    positions: int

    @property
    def fraction(self) -> float:
        return self.compared / self.positions if self.positions else 0.0


def measure(run: Sequence[dict], reference: Sequence[dict]) -> Deviation:
    """:func:`compare` of two runs' records, with the reference's generated positions counted."""
    worst, mean, compared = compare(run, reference)
    positions = sum(token >= 0 for r in reference for token in r["tokens"])
    return Deviation(worst, mean, compared, positions)


def within_reference(mean: float, reference_mean: float) -> bool:
    """At most :data:`RELATIVE` times the two-kernel reference (floored at REFERENCE_FLOOR)."""
    return mean <= RELATIVE * max(reference_mean, REFERENCE_FLOOR)


def agrees_with_reference(plugin: Deviation, kernels: Deviation) -> bool:
    """The engine oracle's verdict: ``plugin`` (plugin on vs. off, same backend) deviates at most
    :data:`RELATIVE` times as much as ``kernels`` (two correct kernels, plugin off) on average
    and at its largest (:func:`agrees_relative`), stays within :data:`MEAN_TOL` on average, and
    its comparison reaches :data:`MIN_COMPARED` of the positions, or, where the two kernels'
    own comparison reaches less (a long workload: greedy runs meet a near-tie and part), at
    least 1/:data:`RELATIVE` of theirs."""
    return (agrees_relative(plugin, kernels) and plugin.mean <= MEAN_TOL
            and plugin.fraction >= min(MIN_COMPARED, kernels.fraction / RELATIVE))


def agrees_relative(plugin: Deviation, kernels: Deviation) -> bool:
    """The rule for a model whose greedy runs diverge after a few tokens (a large model with
    random weights, ``vllm-cascade demo``): something compared, the plugin's mean deviation at
    most :data:`RELATIVE` times the two-kernel reference's (:func:`within_reference`) and its
    largest at most :data:`MAX_TOL` or :data:`RELATIVE` times the reference's largest. No
    coverage requirement: how far a comparison reaches is the model's, not the plugin's."""
    return (plugin.compared > 0 and within_reference(plugin.mean, kernels.mean)
            and plugin.worst <= max(MAX_TOL, RELATIVE * kernels.worst))


def beam_record(output: Any, prompt_len: int) -> dict[str, list]:
    """The finished beams of a vLLM ``BeamSearchOutput``: generated tokens and cumulative logprob.

    ``BeamSearchSequence.tokens`` starts with the prompt; ``prompt_len`` strips it.
    """
    beams = [[int(t) for t in seq.tokens[prompt_len:]] for seq in output.sequences]
    return {"beams": beams, "cum_logprobs": [float(seq.cum_logprob) for seq in output.sequences]}


@dataclass(frozen=True)
class BeamDeviation:
    """How two beam searches of the same prompts differ: of the reference's ``beams``,
    ``matched`` were found by the run too (same tokens); ``worst`` and ``mean`` are their
    |Δ cumulative logprob| divided by the beam's length (a per-token figure, the same units as
    MEAN_TOL and MAX_TOL; it is at most the mean per-token |Δ| along the beam)."""

    worst: float
    mean: float
    matched: int
    beams: int

    @property
    def fraction(self) -> float:
        return self.matched / self.beams if self.beams else 0.0


def compare_beams(run: Sequence[dict], reference: Sequence[dict]) -> BeamDeviation:
    """Beam sets of the same requests in the same order (:func:`beam_record` results)."""
    diffs: list[float] = []
    beams = 0
    for a, b in zip(run, reference, strict=True):
        found = dict(zip(map(tuple, a["beams"]), a["cum_logprobs"], strict=True))
        beams += len(b["beams"])
        for tokens, cum in zip(b["beams"], b["cum_logprobs"], strict=True):
            if tuple(tokens) in found:
                diffs.append(abs(found[tuple(tokens)] - cum) / max(len(tokens), 1))
    if not diffs:
        return BeamDeviation(0.0, 0.0, 0, beams)
    return BeamDeviation(float(np.max(diffs)), float(np.mean(diffs)), len(diffs), beams)


def beams_agree(plugin: BeamDeviation, kernels: BeamDeviation) -> bool:
    """Beam search's verdict: at least :data:`MIN_COMPARED` of the beams found, missing at most
    :data:`RELATIVE` times as many as the two-kernel reference (floored at :data:`BEAM_FLOOR`),
    and the matched beams' cumulative logprobs within the tolerances and the relative bound."""
    missing = 1.0 - plugin.fraction
    reference_missing = 1.0 - kernels.fraction
    return (plugin.matched > 0 and plugin.fraction >= MIN_COMPARED
            and missing <= RELATIVE * max(reference_missing, BEAM_FLOOR)
            and plugin.worst <= MAX_TOL and plugin.mean <= MEAN_TOL
            and within_reference(plugin.mean, kernels.mean))
