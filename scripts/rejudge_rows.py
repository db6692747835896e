"""Today's engine-oracle rule applied to recorded correctness rows (no GPU).

    python3 scripts/rejudge_rows.py benchmarks/results/gpu/gpu_validate/*/correctness*.json

A row of ``tests/gpu``'s engine tests (``tests/engine_oracle.py``) records the plugin's and the
two correct kernels' deviations (largest, mean, share of positions compared) next to the verdict
of the rule it ran under. This prints each row's recorded verdict beside the verdict of
``engine_oracle``'s rule as it stands, from the same numbers: what a change of the rule does to
measurements already made. Rows judged without a second kernel (speculative decoding's) keep
their recorded verdict.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]

import engine_oracle  # noqa: E402
from vllm_cascade_plugin.face import agreement  # noqa: E402

POSITIONS = 1_000_000  # rows keep the share compared; any large count reproduces it


def deviation(row: dict, prefix: str = "") -> agreement.Deviation:
    fraction = row[f"{prefix}compared_fraction"]
    return agreement.Deviation(row[f"{prefix}max_abs_dlogprob"], row[f"{prefix}mean_abs_dlogprob"],
                               round(fraction * POSITIONS), POSITIONS)


def rejudge(row: dict) -> tuple[str, str]:
    """(verdict, reference verdict) of today's rule."""
    if "reference_compared_fraction" not in row:
        return row["outcome"], row.get("reference_outcome", "-")
    plugin: agreement.Deviation | agreement.BeamDeviation = deviation(row)
    kernels: agreement.Deviation | agreement.BeamDeviation = deviation(row, "reference_")
    if "beams" in row:
        beams = row["beams"]
        plugin, kernels = (agreement.BeamDeviation(d.worst, d.mean, round(d.fraction * beams),
                                                   beams) for d in (plugin, kernels))
    ok, reference_ok = engine_oracle.verdicts(row["workload"], plugin, kernels,
                                              row["cascade_step_fraction"],
                                              row.get("kv_cache_dtype") == "fp8")
    return "pass" if ok else "fail", "pass" if reference_ok else "fail"


def main(paths: list[str]) -> int:
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            outcome, reference = rejudge(row)
            print(f"{Path(path).parent.name:18} {row['workload'][:52]:52} {row.get('runner', '')}"
                  f" {row.get('backend', 'FLASHINFER'):10} recorded {row['outcome']}/"
                  f"{row.get('reference_outcome', '-')}  now {outcome}/{reference}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
