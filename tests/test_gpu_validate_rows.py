"""scripts/gpu_validate_rows.py: the rows of gpu_validate.json, from pytest's own reports."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_validate_rows.py"


def rows_module(results: Path):
    spec = importlib.util.spec_from_file_location("gpu_validate_rows", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.RESULTS = results
    return module


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"CASCADE_GV_DIR": str(tmp_path), "CASCADE_COMMIT": "abc1234",
           "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, check=True)


def junit(path: Path, tests: int, failures: int, errors: int, skipped: int) -> Path:
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{tests}" '
                    f'failures="{failures}" errors="{errors}" skipped="{skipped}"/></testsuites>')
    return path


def test_a_row_counts_pytest_s_report_and_a_missing_report_fails(tmp_path):
    run(tmp_path, "row", "kernels", "12.4", "--junit", str(junit(tmp_path / "a.xml", 10, 1, 1, 3)),
        "--rc", "1")
    run(tmp_path, "row", "fp8", "600", "--junit", str(tmp_path / "none.xml"), "--rc", "124")
    run(tmp_path, "row", "demo", "90", "--checks", "1", "0", "--rc", "0")
    kernels, fp8, demo = (json.loads(line) for line in
                          (tmp_path / "rows.jsonl").read_text().splitlines())
    assert {k: kernels[k] for k in ("part", "commit", "passed", "failed", "skipped", "seconds")} \
        == {"part": "kernels", "commit": "abc1234", "passed": 5, "failed": 2, "skipped": 3,
            "seconds": 12}
    assert (fp8["passed"], fp8["failed"]) == (0, 1) and "124" in fp8["note"]
    assert (demo["passed"], demo["failed"]) == (1, 0)


def test_a_command_that_failed_without_failed_tests_counts_one_failure(tmp_path):
    run(tmp_path, "row", "engine", "5", "--junit", str(junit(tmp_path / "a.xml", 0, 0, 0, 0)),
        "--rc", "3")
    [row] = (json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines())
    assert row["failed"] == 1 and row["note"] == "exit status 3"


def test_the_table_keeps_earlier_rows_and_the_last_pass(tmp_path):
    module = rows_module(tmp_path)
    previous = tmp_path / "committed.json"
    previous.write_text(json.dumps([
        {"part": "soak", "commit": "old", "date": "2026-11-30", "passed": 13, "failed": 0,
         "skipped": 0, "seconds": 400, "last_passed": {"date": "2026-11-30", "commit": "old"}},
        {"part": "serving", "commit": "old", "date": "2026-11-30", "passed": 2, "failed": 0,
         "skipped": 0, "seconds": 99, "last_passed": {"date": "2026-11-30", "commit": "old"}}]))
    lines = [{"part": "serving", "commit": "new", "date": "2026-12-01", "passed": 0, "failed": 1,
              "skipped": 0, "seconds": 50},
             {"part": "kernels", "commit": "new", "date": "2026-12-01", "passed": 75,
              "failed": 0, "skipped": 0, "seconds": 200, "gpu": "NVIDIA H100 80GB HBM3"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = module.table(tmp_path / "out.json", ["kernels", "serving", "soak", "tp"], previous)
    by_part = {r["part"]: r for r in rows}
    assert list(by_part) == ["kernels", "serving", "soak"]  # tp: never run, no row
    assert by_part["kernels"]["last_passed"] == {"date": "2026-12-01", "commit": "new",
                                                 "gpu": "NVIDIA H100 80GB HBM3"}
    # Failed now: the row is today's, the last pass the earlier one.
    assert by_part["serving"]["failed"] == 1
    assert by_part["serving"]["last_passed"] == {"date": "2026-11-30", "commit": "old"}
    assert by_part["soak"]["commit"] == "old"  # not run now: kept
    assert json.loads((tmp_path / "out.json").read_text()) == rows


@pytest.mark.parametrize("shape", ["list", "cases"])
def test_join_merges_the_xdist_workers_files(tmp_path, shape):
    module = rows_module(tmp_path)
    part = tmp_path / "kernels"
    part.mkdir()
    for worker, items in (("gw0", [1, 2]), ("gw1", [3])):
        body = items if shape == "list" else {"device": "H200", "cases": items}
        (part / f"kernel_correctness.{worker}.json").write_text(json.dumps(body))
    module.join(tmp_path)
    merged = json.loads((part / "kernel_correctness.json").read_text())
    assert (merged if shape == "list" else merged["cases"]) == [1, 2, 3]
    assert not list(part.glob("*.gw*.json"))


def test_the_readme_cell_names_each_runs_gpu_and_says_where_a_row_does_not():
    spec = importlib.util.spec_from_file_location("readme_compat", SCRIPT.with_name(
        "readme_compat.py"))
    assert spec is not None and spec.loader is not None
    compat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compat)
    h100 = {"date": "2026-12-05", "commit": "new", "gpu": "NVIDIA H100 80GB HBM3"}
    results = {
        "kernels": {"part": "kernels", **h100, "passed": 82, "failed": 0, "last_passed": h100},
        "soak": {"part": "soak", "date": "2026-12-05", "commit": "b", "gpu": "NVIDIA H200",
                 "passed": 0, "failed": 1,
                 "last_passed": {"date": "2026-12-01", "commit": "a"}},  # no gpu recorded
    }
    assert compat._cell(("kernels", "soak"), results) == (
        "`kernels` 2026-12-05, new on H100; `soak` 2026-12-01, a, GPU unknown (1 failed "
        "2026-12-05, b on H200)")
