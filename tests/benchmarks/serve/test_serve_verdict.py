"""benchmarks/serve/verdict.py: the plugin judged against fixed bounds and against two flat
servers' spread in the same run, on rows written by hand (the figures below worked out here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serve import verdict

ROOT = Path(__file__).resolve().parents[3]


def row(config: str, rate: str, tpot: float, ttft_p99: float, out: float = 1000.0,
        run: str = "R1", **more: object) -> dict:
    return {"config": config, "workload": "chat_1k_prefill_heavy", "rate_spec": rate,
            "request_rate": "burst" if rate == "burst" else 10.0, "run_id": run,
            "tpot_ms_p50": tpot, "ttft_ms_p99": ttft_p99, "output_tok_per_s": out,
            "completed": 100, "gpu": "NVIDIA H100 80GB HBM3", **more}


ROWS = [
    # 50%: the plugin 3% slower (TPOT 41.2 vs 40), flat again 4% slower (41.6): inside the spread
    row("flash_attn", "50%", 40.0, 200.0), row("cascade_flash_attn", "50%", 41.2, 204.0),
    row("flash_attn_again", "50%", 41.6, 190.0),
    # 90%: the plugin's TTFT p99 1.12x, flat again's 1.06x: outside even the widened bound
    row("flash_attn", "90%", 50.0, 500.0), row("cascade_flash_attn", "90%", 49.0, 560.0),
    row("flash_attn_again", "90%", 50.0, 530.0),
    # a burst with no flat again in its run: the fixed bounds only
    row("flash_attn", "burst", 30.0, 900.0, run="R2"),
    row("cascade_flash_attn", "burst", 20.0, 920.0, out=1800.0, run="R2"),
    # a plugin row whose requests all failed measured nothing
    row("flash_attn", "110%", 60.0, 800.0), row("cascade_flash_attn", "110%", 1.0, 1.0,
                                                completed=0),
]


def by_rate(points: list[dict]) -> dict[str, dict]:
    return {p["rate"]: p for p in points}


def test_a_plugin_inside_the_flat_servers_spread_passes_where_the_fixed_bound_fails():
    p = by_rate(verdict.judge(ROWS))["50%"]
    assert p["tpot_gain"] == pytest.approx(40.0 / 41.2)  # 0.971 < 0.99
    assert p["again_tpot_gain"] == pytest.approx(40.0 / 41.6)  # 0.962: the bound 0.962
    assert p["tpot_floor"] == pytest.approx(1 - (1 - 40.0 / 41.6))
    assert p["ttft_p99_ratio"] == pytest.approx(1.02)
    assert p["ttft_ceiling"] == pytest.approx(1.05)  # flat again 0.95x: |1 - 0.95| = the 5%
    assert p["target"] is False and p["spread"] is True


def test_a_plugin_further_from_flat_than_flat_is_from_itself_fails_both():
    p = by_rate(verdict.judge(ROWS))["90%"]
    assert p["tpot_gain"] == pytest.approx(50.0 / 49.0)
    assert p["ttft_p99_ratio"] == pytest.approx(1.12)
    assert p["ttft_ceiling"] == pytest.approx(1.06)
    assert p["target"] is False and p["spread"] is False


def test_without_flat_again_only_the_fixed_bounds_judge_and_failed_runs_are_left_out():
    points = by_rate(verdict.judge(ROWS))
    burst = points["burst"]
    assert burst["tpot_gain"] == pytest.approx(1.5) and burst["output_ratio"] == pytest.approx(1.8)
    assert burst["target"] is True and burst["spread"] is None
    assert "110%" not in points
    assert [p["rate"] for p in verdict.judge(ROWS, run="R2")] == ["burst"]


def test_the_command_prints_each_points_verdicts(tmp_path):
    (tmp_path / "serve.json").write_text(json.dumps(ROWS))
    out = subprocess.run([sys.executable, "-m", "benchmarks.serve.verdict", "--file",
                          str(tmp_path / "serve.json")], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert len(out) == 5  # what is judged, the column heads and three points
    assert out[0].startswith("# cascade_flash_attn against flash_attn, run every run of ")
    lines = {line.split()[2]: line.split() for line in out[2:]}
    assert lines["50%"][-2:] == ["FAIL", "pass"]
    assert lines["90%"][-2:] == ["FAIL", "FAIL"]
    assert lines["burst"][-2:] == ["pass", "-"]
    latest = subprocess.run([sys.executable, "-m", "benchmarks.serve.verdict", "--latest",
                             "--file", str(tmp_path / "serve.json")], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert latest[0].startswith("# cascade_flash_attn against flash_attn, run R1 of ")
    assert [line.split()[:3] for line in latest[2:]] == [["R1", "chat_1k_prefill_heavy", "50%"],
                                                        ["R1", "chat_1k_prefill_heavy", "90%"]]


def test_each_plugin_config_is_judged_against_its_own_flat_config(tmp_path):
    """The FP8 pair's plugin against flat on the same FP8 cache, not against flash_attn; and
    the command, not told which plugin, judges every plugin config of the run."""
    rows = [*ROWS, row("flash_attn_fp8", "50%", 30.0, 100.0, run="R3"),
            row("cascade_flash_attn_fp8", "50%", 20.0, 100.0, run="R3"),
            row("flash_attn", "50%", 60.0, 100.0, run="R3")]
    [p] = verdict.judge(rows, "cascade_flash_attn_fp8")
    assert (p["plugin"], p["flat"]) == ("cascade_flash_attn_fp8", "flash_attn_fp8")
    assert p["tpot_gain"] == pytest.approx(1.5) and p["spread"] is None  # not 60 / 20
    (tmp_path / "serve.json").write_text(json.dumps(rows))
    out = subprocess.run([sys.executable, "-m", "benchmarks.serve.verdict", "--file",
                          str(tmp_path / "serve.json")], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    heads = [line for line in out.splitlines() if line.startswith("# ")]
    assert [h.split(", run")[0] for h in heads] == [
        "# cascade_flash_attn against flash_attn",
        "# cascade_flash_attn_fp8 against flash_attn_fp8"]


def test_a_point_whose_rate_came_from_another_runs_burst_says_so(tmp_path):
    """A relative rate set by an earlier run's flat burst (perhaps another machine's) may sit
    near this run's capacity: the point names that run, and the printed line says so; a rate
    measured in the run itself names none."""
    rows = [row("flash_attn", "50%", 40.0, 200.0, sustainable_rate_run="R0"),
            row("cascade_flash_attn", "50%", 40.0, 200.0, sustainable_rate_run="R0"),
            row("flash_attn", "90%", 50.0, 500.0, sustainable_rate_run="R1"),
            row("cascade_flash_attn", "90%", 50.0, 500.0, sustainable_rate_run="R1")]
    points = by_rate(verdict.judge(rows))
    assert points["50%"]["rate_from_run"] == "R0" and points["90%"]["rate_from_run"] is None
    (tmp_path / "serve.json").write_text(json.dumps(rows))
    out = subprocess.run([sys.executable, "-m", "benchmarks.serve.verdict", "--file",
                          str(tmp_path / "serve.json")], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    [half] = [line for line in out.splitlines() if " 50% " in line]
    assert half.endswith("(rate from run R0's flat burst)")
    assert "rate from run" not in out.replace(half, "")


def test_each_point_shows_the_step_timelines_of_its_servers_by_kind_of_step():
    """Where the servers ran the step-timeline probe, a point's lines show each one's GPU ms
    per step and host wait, and the plugin's by kind of step; a point without it shows none."""
    timeline = {"gpu_step_ms_per_step": 28.25, "gpu_wait_ms_per_step": 0.1}
    kinds = {"flat": {"steps": 300, "gpu_step_ms_per_step": 27.0, "gpu_wait_ms_per_step": 0.2},
             "capture": {"steps": 20, "gpu_step_ms_per_step": 61.5,
                         "gpu_wait_ms_per_step": 0.4}}
    rows = [row("flash_attn", "110%", 41.0, 480.0, **timeline),
            row("cascade_flash_attn", "110%", 47.3, 480.0, gpu_step_ms_per_step=31.3,
                gpu_wait_ms_per_step=0.3, timeline_by_kind=kinds),
            row("flash_attn", "50%", 10.0, 100.0), row("cascade_flash_attn", "50%", 10.0, 100.0)]
    text = verdict.table(verdict.judge(rows))
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if " 110% " in line)
    assert lines[at + 1] == ("    GPU ms per step (host wait): flat 28.2 (0.10); plugin 31.3 "
                             "(0.30), flat 300x 27.0 (0.20), capture 20x 61.5 (0.40)")
    assert sum("GPU ms per step" in line for line in lines) == 1


def test_a_point_shows_the_hosts_preparation_of_a_step_where_the_probe_timed_it():
    kinds = {"flat": {"steps": 90, "gpu_step_ms_per_step": 9.5, "gpu_wait_ms_per_step": 0.4,
                      "host_prep_ms_per_step": 0.6},
             "cascade": {"steps": 10, "gpu_step_ms_per_step": 12.3, "gpu_wait_ms_per_step": 5.3,
                         "host_prep_ms_per_step": 6.1, "host_run_ms_per_step": 11.9,
                         "rows_per_step": 47.6}}
    rows = [row("flash_attn", "50%", 9.1, 100.0, gpu_step_ms_per_step=9.1,
                gpu_wait_ms_per_step=0.33, host_prep_ms_per_step=0.55),
            row("cascade_flash_attn", "50%", 9.8, 100.0, gpu_step_ms_per_step=9.8,
                gpu_wait_ms_per_step=0.9, host_prep_ms_per_step=1.15, timeline_by_kind=kinds)]
    lines = verdict.table(verdict.judge(rows)).splitlines()
    assert lines[-1] == ("    GPU ms per step (host wait): flat 9.1 (0.33, prep 0.55); plugin "
                         "9.8 (0.90, prep 1.15), flat 90x 9.5 (0.40, prep 0.60), cascade 10x "
                         "12.3 (5.30, prep 6.10, launch 11.90, 48 rows)")


def test_a_point_compares_decode_steps_with_flats_at_equal_batch_sizes():
    """The plugin's flat decode steps 2% slower than flat's at the same batch sizes, its
    cascade ones 30% faster, flat again's 1% faster: a line under the point's."""
    flat = {"flat": {"32": [50, 10.0, 0.1], "48": [50, 12.0, 0.1]}}
    plugin = {"flat": {"32": [40, 10.2, 0.1], "48": [60, 12.24, 0.1]},
              "cascade": {"48": [20, 8.4, 0.1]}}
    again = {"flat": {"32": [50, 9.9, 0.1], "48": [50, 11.88, 0.1]}}
    rows = [row("flash_attn", "50%", 9.1, 100.0, decode_by_rows=flat),
            row("cascade_flash_attn", "50%", 9.2, 100.0, decode_by_rows=plugin),
            row("flash_attn_again", "50%", 9.0, 100.0, decode_by_rows=again)]
    [point] = verdict.judge(rows)
    assert point["matched"]["plugin's flat"] == {"ratio": 1.02, "steps": 90, "sizes": 2}
    assert point["matched"]["cascade"] == {"ratio": 0.7, "steps": 20, "sizes": 1}
    assert point["matched"]["again"]["ratio"] == 0.99
    assert verdict.table([point]).splitlines()[-1] == (
        "    decode GPU ms at equal requests, over flat's: plugin's flat 1.020 (90 steps, 2 "
        "sizes), cascade 0.700 (20 steps, 1 sizes), again 0.990 (100 steps, 2 sizes)")


def test_a_point_shows_each_servers_mixed_steps_with_their_tokens():
    """Mixed steps (a prefill in them) apart, where the probe told them apart: how many, GPU
    ms, wait, prep, launch and tokens per step, a line for the point's servers that have them
    (flat again here has none: not shown)."""
    def mixed(steps: int, gpu: float, launch: float, tokens: float) -> dict:
        return {"timeline_by_phase": {"mixed": {
            "steps": steps, "gpu_step_ms_per_step": gpu, "gpu_wait_ms_per_step": 2.3,
            "host_prep_ms_per_step": 1.0, "host_run_ms_per_step": launch,
            "tokens_per_step": tokens, "rows_per_step": 25.0}}}
    rows = [row("flashinfer", "50%", 11.6, 125.0, **mixed(210, 23.0, 22.4, 647.0)),
            row("cascade", "50%", 12.4, 153.0, **mixed(205, 24.72, 24.9, 664.2)),
            row("flashinfer_again", "50%", 11.8, 120.0)]
    [point] = verdict.judge(rows, plugin="cascade")
    assert verdict.table([point]).splitlines()[-1] == (
        "    mixed steps, GPU ms (host wait): flat 210x 23.0 (2.30, prep 1.00, launch 22.40, "
        "647 tokens); plugin 205x 24.7 (2.30, prep 1.00, launch 24.90, 664 tokens)")


def test_a_point_shows_each_servers_prefix_cache_hits_and_preemptions():
    """vLLM's counters of the work each server scheduled for the same requests: the share of
    looked-up prompt tokens found in the prefix cache, and preemptions; a server without them
    (an older row) is left out of the line."""
    rows = [row("flashinfer", "50%", 11.6, 125.0, vllm_prefix_cache_queries=80000.0,
                vllm_prefix_cache_hits=60000.0, vllm_preemptions=0.0),
            row("cascade", "50%", 12.4, 153.0, vllm_prefix_cache_queries=80000.0,
                vllm_prefix_cache_hits=50000.0, vllm_preemptions=2.0),
            row("flashinfer_again", "50%", 11.8, 120.0)]
    [point] = verdict.judge(rows, plugin="cascade")
    assert verdict.table([point]).splitlines()[-1] == (
        "    engine: flat prefix cache 75.0% of 80000 tokens, 0 preempted; "
        "plugin prefix cache 62.5% of 80000 tokens, 2 preempted")


def test_the_flashinfer_plugin_is_judged_beside_flat_flashinfer_run_twice():
    """On the FLASHINFER backend the triple is flashinfer, cascade, flashinfer_again; a
    flash_attn_again row of the same run is not FlashInfer's spread."""
    rows = [row("flashinfer", "50%", 40.0, 200.0, run="F"), row("cascade", "50%", 41.2, 204.0,
                                                               run="F"),
            row("flashinfer_again", "50%", 41.6, 190.0, run="F"),
            row("flash_attn_again", "50%", 80.0, 900.0, run="F")]
    [p] = verdict.judge(rows, "cascade")
    assert (p["plugin"], p["flat"]) == ("cascade", "flashinfer")
    assert p["again_tpot_gain"] == pytest.approx(40.0 / 41.6)
    assert p["target"] is False and p["spread"] is True  # 0.971 inside flat's own 0.962
