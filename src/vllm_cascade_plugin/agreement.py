"""How a cascade run's outputs are compared with vLLM's flat attention: one rule for every check.

The engine correctness tests (``tests/gpu/test_engine.py``) and the soak (``benchmarks/soak.py``)
run the same prompts with the plugin on and off, greedy, ``logprobs=2``, and compare the chosen
tokens' logprobs position by position up to the first token where the two runs diverge, only
where both runs' top-2 margin exceeds :data:`MARGIN` (below that, bf16 noise legitimately flips
the argmax). They agree when the mean |Δ| is at most :data:`MEAN_TOL` and the largest at most
:data:`MAX_TOL`. Pure Python and numpy; vLLM's outputs are read by attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MEAN_TOL, MAX_TOL, MARGIN = 0.02, 0.1, 0.1


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


def compare(on: Sequence[dict], off: Sequence[dict]) -> tuple[float, float, int]:
    """(max, mean) |Δ chosen logprob| over comparable positions, and how many there were.

    ``on`` and ``off`` are :func:`record` results of the same requests, in the same order.
    """
    diffs: list[float] = []
    for a, b in zip(on, off, strict=True):
        for ta, tb, la, lb, ma, mb in zip(a["tokens"], b["tokens"], a["logprobs"],
                                          b["logprobs"], a["margins"], b["margins"], strict=False):
            if ta != tb:
                break
            if ta >= 0 and ma > MARGIN and mb > MARGIN:
                diffs.append(abs(la - lb))
    if not diffs:
        return 0.0, 0.0, 0
    return float(np.max(diffs)), float(np.mean(diffs)), len(diffs)


def agrees(worst: float, mean: float, compared: int) -> bool:
    """The verdict on :func:`compare`'s result: something was compared, within both tolerances."""
    return compared > 0 and worst <= MAX_TOL and mean <= MEAN_TOL
