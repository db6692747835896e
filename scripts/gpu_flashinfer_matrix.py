"""The kernel-level GPU tests once per FlashInfer release, on the GPU machine (version matrix).

Usage, after ``source .devb/setup_device.sh`` (which puts vLLM 0.26.0 + its FlashInfer on
PYTHONPATH):

    python3 scripts/gpu_flashinfer_matrix.py --out DIR [WHEEL ...]

The environment's own FlashInfer is one cell; every ``flashinfer_python-*.whl`` given is another,
installed ``--no-deps`` into its own overlay folder that goes first on ``PYTHONPATH`` (the
releases we pick need nothing newer than vLLM 0.26.0's environment has). Cells run side by side
(FlashInfer JIT-compiles each release's kernels into its own cache folder, so compilation is
what takes the time). Each cell checks that ``import flashinfer`` gives the release it names,
then runs ``tests/gpu/test_kernels.py``. Writes ``flashinfer_matrix.json``, rows
``{"flashinfer", "vllm", "tests_passed", "tests_failed", "outcome", ...}``, plus a meta file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = "tests/gpu/test_kernels.py"


def wheel_release(wheel: Path) -> str:
    match = re.fullmatch(r"flashinfer_python-([^-]+)-.*\.whl", wheel.name)
    if match is None:
        raise SystemExit(f"not a flashinfer-python wheel: {wheel}")
    return match.group(1)


def overlay(wheel: Path, root: Path) -> Path:
    target = root / f"fi-{wheel_release(wheel)}"
    if not (target / ".complete").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target),
                        str(wheel)], check=True)
        (target / ".complete").touch()
    return target


def start_cell(release: str, site: Path | None, out: Path) -> tuple[subprocess.Popen, Path]:
    cell = out / f"fi-{release}"
    cell.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CASCADE_RESULTS_DIR=str(cell))
    if site is not None:
        env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
    script = (
        "import flashinfer, subprocess, sys\n"
        f"if flashinfer.__version__ != {release!r}:\n"
        f"    sys.exit(f'imported flashinfer {{flashinfer.__version__}}, wanted {release}')\n"
        "sys.exit(subprocess.call([sys.executable, '-m', 'pytest', '-q', '-p', "
        f"'no:cacheprovider', '--junitxml', {str(cell / 'junit.xml')!r}, {TESTS!r}]))\n")
    log = (cell / "pytest.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, cell


def cell_row(release: str, vllm: str, returncode: int, cell: Path, seconds: float) -> dict:
    passed = failed = skipped = 0
    junit = cell / "junit.xml"
    if junit.exists():
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            total, skipped_here = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
            failed_here = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            passed += total - skipped_here - failed_here
            failed += failed_here
            skipped += skipped_here
    worst = None
    report = cell / "kernel_correctness.json"
    if report.exists():
        errors = [c["max_abs_err"] for c in json.loads(report.read_text())["cases"]
                  if "corrupt" not in c["name"] and not c["name"].endswith("-lse")]
        worst = max(errors, default=None)
    ok = returncode == 0 and passed > 0 and failed == 0 and skipped == 0
    tail = (cell / "pytest.log").read_text().strip().splitlines()[-1:] or [""]
    return {"flashinfer": release, "vllm": vllm, "tests_passed": passed,
            "tests_failed": failed, "tests_skipped": skipped, "max_abs_err": worst,
            "seconds": round(seconds, 1), "summary": tail[0],
            "outcome": "pass" if ok else "fail"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--overlays", type=Path, default=Path("/tmp/fi-overlays"))
    parser.add_argument("wheels", nargs="*", type=Path)
    args = parser.parse_args()
    import flashinfer
    import torch
    import vllm

    cells: list[tuple[str, Path | None]] = [(flashinfer.__version__, None)]
    cells += [(wheel_release(w), overlay(w, args.overlays)) for w in args.wheels]
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    running = [(release, *start_cell(release, site, args.out)) for release, site in cells]
    rows = []
    for release, proc, cell in running:
        rows.append(cell_row(release, vllm.__version__, proc.wait(), cell,
                             time.monotonic() - start))
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "flashinfer_matrix.json").write_text(json.dumps(rows, indent=1))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    meta = {"date": datetime.date.today().isoformat(), "gpu": gpu,
            "vllm": vllm.__version__, "torch": torch.__version__,
            "python": platform.python_version(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "note": "cells run side by side on one GPU; seconds include FlashInfer JIT builds"}
    (args.out / "flashinfer_matrix.meta.json").write_text(json.dumps(meta, indent=1))
    return 0 if all(r["outcome"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
