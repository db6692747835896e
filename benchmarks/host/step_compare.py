"""Two versions of the plugin's host work per step, side by side: ``host/step.py`` run
from each version's source in turn, ``--times`` times each (medians drift between invocations,
and the first of two runs is slower, so they alternate, each first every other time), and each
figure's ratio before / after with its spread.

    python3 -m benchmarks.host.step_compare --before OLD/src --after src --times 5 \\
        --what "what each version is" --out benchmarks/results/cpu/step_host_before_after.json

``--before`` and ``--after`` are the ``src`` folders of two checkouts; this checkout's
``host/step.py`` times both (it calls only the hooks' entry points both have).
``--cold`` passes ``--cold`` on: the CPU caches evicted between steps, as inside ``vllm serve``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import child_path, module_command

STEP_BENCH = "benchmarks.host.step"  # this checkout's, run with each version's src


def bench(src: Path, steps: int, cold: bool = False, cases: str = "") -> list[dict[str, object]]:
    """One ``benchmarks.host.step`` run with ``src`` first on the path (``cold``: with
    ``--cold``; ``cases``: its ``--cases``): its rows."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": child_path(src, inherited=os.environ.get("PYTHONPATH"))}
        subprocess.run([*module_command(STEP_BENCH), "--steps", str(steps),
                        "--out", out, *(["--cold"] if cold else []),
                        *(["--cases", cases] if cases else [])], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        name = "step_host_cold.json" if cold else "step_host.json"
        rows: list[dict[str, object]] = json.loads((Path(out) / name).read_text())["rows"]
        return rows


def summary(before: list[list[dict[str, object]]], after: list[list[dict[str, object]]]
            ) -> list[str]:
    """Per case and figure: the medians over the runs, and before / after (median, min-max)."""
    lines = []
    for at, row in enumerate(before[0]):
        for key in (k for k in row if k.endswith(("_p50_us", "_p99_us"))):
            b = [float(run[at][key]) for run in before]  # type: ignore[arg-type]
            a = [float(run[at][key]) for run in after]  # type: ignore[arg-type]
            ratios = [x / y for x, y in zip(b, a, strict=True)]
            lines.append(f"{row['case']:<22} {key:<17} before {statistics.median(b):7.1f} "
                         f"after {statistics.median(a):7.1f}  before/after "
                         f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    return lines


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the older version's src")
    parser.add_argument("--after", type=Path, required=True, help="the newer version's src")
    parser.add_argument("--times", type=int, default=5)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--cold", action="store_true",
                        help="host/step.py --cold: the CPU caches evicted between steps")
    parser.add_argument("--cases", default="",
                        help="only the cases whose name contains this text (host/step.py's)")
    parser.add_argument("--what", default="", help="what each version is (goes to the file)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    before, after = [], []
    for time in range(args.times):  # each version first every other time: warm-up bias
        for run in (0, 1) if time % 2 == 0 else (1, 0):
            (before, after)[run].append(bench((args.before, args.after)[run].resolve(),
                                              args.steps, args.cold, args.cases))
    lines = summary(before, after)
    print("\n".join(lines))
    command = shlex.join(["python", "-m", "benchmarks.host.step_compare", *sys.argv[1:]])
    result = {"what": args.what, "command": command, "summary": lines, "before": before,
              "after": after,
              "date": datetime.date.today().isoformat(), "numpy": np.__version__,
              "python": platform.python_version(), "cpus": os.cpu_count(),
              "machine": platform.machine(), "cpu": cpu_name()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
