"""Engine level: vLLM's LLM with the plugin on vs. off, same prompts, greedy, both model runners.

The model is the tiny Llama config with transformers' normal random initialisation (std 0.02),
saved once: vLLM's dummy weights (~1e-3) make attention nearly uniform, so a wrong page would go
unnoticed. Each configuration runs in its own process (the plugin registers at startup).

Tolerances (issue 4, in ``vllm_cascade_plugin.agreement``): chosen-token logprobs agree within
0.02 on average and 0.1 at most, compared position by position up to the first token where the
two runs diverge, and only where the top-2 margin exceeds 0.1 in both (below that, bf16 noise
legitimately flips the argmax).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_cascade_plugin import agreement

HERE = Path(__file__).parent
CASCADE_WORKLOADS = ("a_", "b_", "c_", "d_")  # cascade must run on >= 90% of their decode steps
GRAPH_KEYS = ("graph_captures", "graph_replays", "full_graph_captures", "full_graph_replays")
RESULTS: list[dict] = []
_RUNS: dict[tuple, dict] = {}  # one engine per configuration per session, shared by the tests


def run_engine(model_dir: str, out: Path, *, plugin: bool, runner: str,
               extra: tuple[str, ...] = (), knobs: tuple[tuple[str, str], ...] = ()) -> dict:
    key = (plugin, runner, extra, knobs)
    if key not in _RUNS:
        _RUNS[key] = _run_engine(model_dir, out, plugin=plugin, runner=runner, extra=extra,
                                 knobs=knobs)
    return _RUNS[key]


def _run_engine(model_dir: str, out: Path, *, plugin: bool, runner: str,
                extra: tuple[str, ...], knobs: tuple[tuple[str, str], ...] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASCADE_")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_USE_V2_MODEL_RUNNER="1" if runner == "v2" else "0")
    if plugin:
        env.update(CASCADE_ATTENTION="1", CASCADE_POLICY="always", **dict(knobs))
        # The executor under test: CASCADE_TEST_KERNEL=fa3|flashinfer (default: the plugin's auto).
        if kernel := os.environ.get("CASCADE_TEST_KERNEL"):
            env["CASCADE_KERNEL"] = kernel
    proc = subprocess.run([sys.executable, str(HERE / "engine_driver.py"), model_dir, str(out),
                           *extra], env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    if results := os.environ.get("CASCADE_RESULTS_DIR"):  # the whole log, for the record
        Path(results).mkdir(parents=True, exist_ok=True)
        name = "-".join(["on" if plugin else "off", runner, *(a.strip("-") for a in extra)])
        (Path(results) / f"engine-{name.replace(',', '')}.log").write_text(log)
    assert proc.returncode == 0, log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    return json.loads(out.read_text())


def judge(name: str, runner: str, on: dict, off: dict, tp: int = 1) -> dict:
    worst, mean, count = agreement.compare(on["requests"], off["requests"])
    fraction = on["decode_steps_cascade"] / max(on["decode_steps_planned"], 1)
    ok = agreement.agrees(worst, mean, count)
    if name.startswith(CASCADE_WORKLOADS):
        ok = ok and fraction >= 0.9
    return {"workload": name, "runner": runner, "tensor_parallel_size": tp,
            "max_abs_dlogprob": worst, "mean_abs_dlogprob": mean, "compared_tokens": count,
            "cascade_step_fraction": fraction, "fallbacks": on["fallbacks"],
            "outcome": "pass" if ok else "fail"}


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_cascade_engine_matches_flat_engine(model_dir, tmp_path, runner):
    on = run_engine(model_dir, tmp_path / "on.json", plugin=True, runner=runner)
    off = run_engine(model_dir, tmp_path / "off.json", plugin=False, runner=runner)
    rows = [{**judge(name, runner, on["workloads"][name], off["workloads"][name]),
             **{k: on.get(k) for k in GRAPH_KEYS}} for name in off["workloads"]]
    RESULTS.extend(rows)
    failed = [r for r in rows if r["outcome"] != "pass"]
    assert not failed, json.dumps(failed, indent=1)
    # Planning and running a step never waits for the GPU (async scheduling stays useful).
    assert on["sync_violations"] == [], on["sync_violations"]
    if on["executors"] == ["fa3"]:  # its decode steps ran from whole-step CUDA graphs
        assert on["full_graph_replays"] > 0, {k: on[k] for k in GRAPH_KEYS}
    if kernel := os.environ.get("CASCADE_TEST_KERNEL"):
        assert on["executors"] == [kernel], on["executors"]


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_layer_graphs_match_flat_engine(model_dir, tmp_path, runner):
    """CASCADE_FULL_GRAPHS=0: vLLM's piecewise path with the executor's per-layer CUDA graphs
    (what tensor parallelism, LoRA and weight offloading get); same agreement with the
    plugin-off engine, the per-layer graphs replayed and no whole-step graph."""
    on = run_engine(model_dir, tmp_path / "on.json", plugin=True, runner=runner,
                    knobs=(("CASCADE_FULL_GRAPHS", "0"),))
    off = run_engine(model_dir, tmp_path / "off.json", plugin=False, runner=runner)
    rows = [{**judge(name, runner, on["workloads"][name], off["workloads"][name]),
             "full_graphs": 0, **{k: on.get(k) for k in GRAPH_KEYS}} for name in off["workloads"]]
    RESULTS.extend(rows)
    failed = [r for r in rows if r["outcome"] != "pass"]
    assert not failed, json.dumps(failed, indent=1)
    assert on["sync_violations"] == [], on["sync_violations"]
    assert on["full_graph_captures"] == 0, {k: on[k] for k in GRAPH_KEYS}
    if on["executors"] == ["fa3"]:
        assert on["graph_replays"] > 0, {k: on[k] for k in GRAPH_KEYS}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="tensor parallelism needs two GPUs")
@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_tensor_parallel_engine_matches_flat_engine(model_dir, tmp_path, runner):
    """Workloads (a) and (d) with tensor_parallel_size=2: each rank plans its own heads' step."""
    extra = ("--workloads", "a_,d_", "--tp", "2")
    on = run_engine(model_dir, tmp_path / "on.json", plugin=True, runner=runner, extra=extra)
    off = run_engine(model_dir, tmp_path / "off.json", plugin=False, runner=runner, extra=extra)
    rows = [{**judge(name, runner, on["workloads"][name], off["workloads"][name], tp=2),
             "executors": on.get("executors")} for name in off["workloads"]]
    RESULTS.extend(rows)
    assert len(rows) == 2, rows
    failed = [r for r in rows if r["outcome"] != "pass"]
    assert not failed, json.dumps(failed, indent=1)
    assert on["full_graph_captures"] == 0, on  # whole-step graphs are for TP=1 only


def test_a_corrupted_plan_fails_the_engine_comparison(model_dir, tmp_path):
    only_a = ("--workloads", "a_")
    on = run_engine(model_dir, tmp_path / "bad.json", plugin=True, runner="v2",
                    extra=(*only_a, "--corrupt"))
    off = run_engine(model_dir, tmp_path / "off.json", plugin=False, runner="v2", extra=only_a)
    name = "a_one_8k_prefix_x64"
    row = judge(name, "v2", on["workloads"][name], off["workloads"][name])
    RESULTS.append({**row, "workload": f"{name} (corrupted plan: must fail)"})
    assert row["outcome"] == "fail", row


def teardown_module() -> None:
    out = os.environ.get("CASCADE_RESULTS_DIR")
    if out and RESULTS:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "correctness.json").write_text(json.dumps(RESULTS, indent=1))
