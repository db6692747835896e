"""The rows of ``benchmarks/results/gpu/gpu_validate.json``, written by scripts/gpu_validate.sh.

    python3 scripts/gpu_validate_rows.py row PART SECONDS [--junit FILE] [--rc N] [--checks P F]
    python3 scripts/gpu_validate_rows.py table OUT_JSON PART... [--previous JSON]
    python3 scripts/gpu_validate_rows.py join FOLDER

``row`` appends one part's outcome to ``rows.jsonl`` beside this run's results
(``CASCADE_GV_DIR``): passed, failed and skipped tests from pytest's JUnit XML, or a command's
checks (``--checks PASSED FAILED``); a part whose XML is missing (killed at its time limit,
crashed) counts one failure. ``table`` writes the latest row of each named part, in that order;
with ``--previous`` (the committed gpu_validate.json) a part this run did not run keeps its
earlier row, and every row carries ``last_passed``: the date, commit and GPU of the latest run
of that part without a failure (null: none yet).
``join`` merges result files that pytest-xdist workers wrote one each (``name.gw0.json``, ...)
into ``name.json``. The commit is ``CASCADE_COMMIT`` (the device's copy of the checkout has no
git history), else git's, else "unknown".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

RESULTS = Path(os.environ.get("CASCADE_GV_DIR", "/tmp/gv"))


def commit() -> str:
    if found := os.environ.get("CASCADE_COMMIT"):
        return found
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_name() -> str:
    """The first GPU's name as ``nvidia-smi`` gives it (the lent machine may be an H100 or an
    H200), else "unknown"."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True,
                              timeout=30).stdout.splitlines()[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def junit_counts(path: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) of a pytest JUnit XML file; errors count as failures."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = failed = skipped = 0
    for suite in suites:
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def row(args: argparse.Namespace) -> dict:
    record = {"part": args.part, "commit": commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "gpu": gpu_name(), "passed": 0, "failed": 0, "skipped": 0,
              "seconds": round(args.seconds)}
    if args.junit is not None:
        if args.junit.is_file():
            record["passed"], record["failed"], record["skipped"] = junit_counts(args.junit)
        else:
            record["failed"] = 1
            record["note"] = f"no test report: the part ended with exit status {args.rc}"
    if args.checks is not None:
        record["passed"], record["failed"] = args.checks
    if args.rc not in (None, 0) and record["failed"] == 0:
        record["failed"] = 1  # pytest's own failure (collection, usage) or the command's
        record["note"] = f"exit status {args.rc}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "rows.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def passed(record: dict) -> bool:
    return record["failed"] == 0 and record["passed"] > 0


def table(out: Path, parts: list[str], previous: Path | None = None) -> list[dict]:
    earlier = {r["part"]: r for r in json.loads(previous.read_text())} if (
        previous is not None and previous.is_file()) else {}
    latest: dict[str, dict] = dict(earlier)
    last_passed = {part: r.get("last_passed") for part, r in earlier.items()}
    rows_file = RESULTS / "rows.jsonl"
    if rows_file.is_file():
        for line in rows_file.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                latest[record["part"]] = record
                if passed(record):
                    last_passed[record["part"]] = {"date": record["date"],
                                                   "commit": record["commit"],
                                                   "gpu": record.get("gpu", "unknown")}
    rows = [{**latest[p], "last_passed": last_passed.get(p)} for p in parts if p in latest]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def join(folder: Path) -> list[Path]:
    """Merge ``name.gwN.json`` fragments (lists, or objects whose ``cases`` are lists)."""
    groups: dict[Path, list[Path]] = {}
    for part in sorted(folder.rglob("*.gw*.json")):
        if re.fullmatch(r".+\.gw\d+\.json", part.name):
            groups.setdefault(part.with_name(part.name.split(".gw")[0] + ".json"), []).append(part)
    for whole, fragments in groups.items():
        loaded = [json.loads(f.read_text()) for f in fragments]
        if all(isinstance(x, list) for x in loaded):
            merged: object = [item for x in loaded for item in x]
        else:
            merged = {**loaded[0], "cases": [c for x in loaded for c in x.get("cases", [])]}
        whole.write_text(json.dumps(merged, indent=1))
        for f in fragments:
            f.unlink()
    return list(groups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("row")
    p.add_argument("part")
    p.add_argument("seconds", type=float)
    p.add_argument("--junit", type=Path)
    p.add_argument("--rc", type=int)
    p.add_argument("--checks", type=int, nargs=2, metavar=("PASSED", "FAILED"))
    p = sub.add_parser("table")
    p.add_argument("out", type=Path)
    p.add_argument("parts", nargs="+")
    p.add_argument("--previous", type=Path)
    p = sub.add_parser("join")
    p.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.command == "row":
        print(json.dumps(row(args)))
    elif args.command == "table":
        for record in table(args.out, args.parts, args.previous):
            print(json.dumps(record))
    else:
        for whole in join(args.folder):
            print(f"joined {whole}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
