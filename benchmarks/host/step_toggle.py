"""The runner hooks' host time per step with and without steady decode continued from the last
step (``PlanMemory.continue_decode`` and the pre-checks it lets the hooks skip), in one process.

``host/step_compare.py`` runs two versions in separate processes, whose medians drift apart on a
shared CPU by more than this change moves them; here the same code runs ``host/step.py``'s
cases with the continuation turned off (``PlanMemory.continues`` answering False: every step
read, followed and pre-checked, as before it) and on, alternating every round of ``--steps``
steps, so that slow and fast stretches of the machine fall on both. A figure is the median over
rounds of each round's p50 (or p99); ``off_over_on`` is the median of the rounds' ratios, with
their range.

    PYTHONPATH=src python3 -m benchmarks.host.step_toggle [--rounds 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
from pathlib import Path

import numpy as np

from benchmarks.common import command_line, commit
from benchmarks.host import step as shb
from benchmarks.host.planner import ChurnBatch, DecodeBatch
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.planning import memory

VARIANTS = (("steady", DecodeBatch, False), ("churn", ChurnBatch, False),
            ("v2_steady", DecodeBatch, True), ("v2_churn", ChurnBatch, True))


def run(case: shb.Case, batch_type: type[DecodeBatch], steps: int, v2: bool,
        continued: bool) -> tuple[list[int], int]:
    """``benchmarks.host.step.run`` (every plan checked against a fresh one) with the continuation
    on or off."""
    original = memory.PlanMemory.continues
    if not continued:
        memory.PlanMemory.continues = lambda self, *a, **k: False  # type: ignore[method-assign]
    try:
        return shb.run(case, batch_type, steps, check=False, v2=v2)
    finally:
        memory.PlanMemory.continues = original  # type: ignore[method-assign]


def measure(case: shb.Case, steps: int, rounds: int) -> dict[str, object]:
    row: dict[str, object] = {"case": case.name, "requests": case.requests}
    for name, batch_type, v2 in VARIANTS:
        figures: dict[str, list[float]] = {}
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)  # each first every other time
            for continued in order:
                times, cascade = run(case, batch_type, steps, v2, continued)
                label = "on" if continued else "off"
                figures.setdefault(f"{label}_p50", []).append(float(np.percentile(times, 50)))
                figures.setdefault(f"{label}_p99", []).append(float(np.percentile(times, 99)))
                row[f"{name}_{label}_cascade_steps"] = f"{cascade} of {steps}"
        for stat in ("p50", "p99"):
            off, on = figures[f"off_{stat}"], figures[f"on_{stat}"]
            ratios = [a / b for a, b in zip(off, on, strict=True)]
            row[f"{name}_off_{stat}_us"] = round(statistics.median(off) / 1e3, 1)
            row[f"{name}_on_{stat}_us"] = round(statistics.median(on) / 1e3, 1)
            row[f"{name}_{stat}_off_over_on"] = [round(statistics.median(ratios), 2),
                                                 round(min(ratios), 2), round(max(ratios), 2)]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="20 steps, 2 rounds (smoke test)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    steps, rounds = (20, 2) if args.quick else (args.steps, args.rounds)
    stats.reset()
    rows = []
    for case in shb.CASES:
        row = measure(case, steps, rounds)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        args.out.write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "numpy": np.__version__, "python": platform.python_version(),
            "code": commit(), "command": command_line(), "steps": steps, "rounds": rounds,
            "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
