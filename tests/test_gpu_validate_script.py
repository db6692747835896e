"""``scripts/gpu_validate.sh wait``: on a machine without the detached run (a fresh machine: the
one that ran ``start`` was given back when idle) or with a run that died, it returns at once
instead of waiting out its seconds of device time."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _wait(gv_dir: Path, seconds: int) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # nothing to pack
    env["CASCADE_GV_DIR"] = str(gv_dir)
    start = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "scripts/gpu_validate.sh"), "wait", str(seconds)],
                          env=env, capture_output=True, text=True, timeout=seconds + 30)
    return done, time.monotonic() - start


def test_wait_on_a_machine_that_started_nothing_fails_at_once(tmp_path):
    done, took = _wait(tmp_path / "gv", 60)
    assert done.returncode == 3, done.stderr
    assert "no run was started on this machine" in done.stderr
    assert took < 20


def test_wait_returns_when_the_detached_run_has_died(tmp_path):
    gv = tmp_path / "gv"
    gv.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (gv / "pipeline.pid").write_text(f"{dead.pid}\n")
    (gv / "parts.log").write_text("[gpu_validate 10:00:00] serve_grid flash_attn_long rc=0\n")
    done, took = _wait(gv, 60)
    assert done.returncode == 0, done.stderr
    assert "ended without finishing" in done.stdout and "flash_attn_long rc=0" in done.stdout
    assert took < 20


def test_wait_keeps_waiting_while_the_run_is_alive(tmp_path):
    gv = tmp_path / "gv"
    gv.mkdir()
    alive = subprocess.Popen(["sleep", "30"])
    try:
        (gv / "pipeline.pid").write_text(f"{alive.pid}\n")
        done, took = _wait(gv, 6)
        assert done.returncode == 0, done.stderr
        assert "ended without finishing" not in done.stdout
        # bash's SECONDS counts whole seconds since the shell started: a 6 s deadline is
        # reached after 5 to 6 s of wall time
        assert took >= 5
    finally:
        alive.kill()
        alive.wait()


def _serve_grid(tmp_path: Path, grid: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``gpu_validate.sh serve_grid`` with ``SERVE_GRID=grid`` and a ``python3`` that only
    records which slice's serve bench it was asked to run (its ``--configs``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(CASCADE_GV_DIR=str(tmp_path / "gv"), SERVE_GRID=grid,
               PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    done = subprocess.run(["bash", str(ROOT / "scripts/gpu_validate.sh"), "serve_grid"],
                          env=env, capture_output=True, text=True, timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return done, [x.split("--configs ")[1].split()[0] for x in lines
                  if "-m benchmarks.serve.bench" in x]


def test_serve_grid_runs_the_slices_in_the_order_named(tmp_path):
    done, configs = _serve_grid(tmp_path, "flash_attn_moderate api_servers")
    assert done.returncode == 0, done.stdout + done.stderr
    assert configs == ["flash_attn,cascade_flash_attn",
                       "flash_attn_api_servers_4,cascade_flash_attn_api_servers_4"]


def test_serve_grid_stops_at_a_slice_it_does_not_know(tmp_path):
    done, configs = _serve_grid(tmp_path, "api_servers flash_attn_moderat flashinfer")
    assert "no slice named flash_attn_moderat" in done.stdout
    assert configs == ["flash_attn_api_servers_4,cascade_flash_attn_api_servers_4"]
