"""Engine level: vLLM's LLM with the plugin on vs. off, same prompts, both model runners, judged
against two correct kernels.

The model is the oracle model (``tests/oracle_model.py``): a small random Llama with sharp
attention and spread logits. On the CPU (``tests/test_oracle_model.py``) a one-page KV error of a
256-token prefix moves its chosen-token logprobs by ~40 times the mean tolerance while two
correct kernels stay within a third of it; one page is a smaller share of a longer prefix (~3
times the tolerance at 4K on the CPU), and the one-page row below measures it at 8K. Each
configuration runs in its own process (the plugin registers at startup), once per session.

Every workload runs on three engines: the plugin on (FlashInfer wrapped), the plugin off with
FlashInfer, and the plugin off with FlashAttention. A row of ``correctness.json``
(``engine_oracle.judge``) compares the plugin with plugin-off FlashInfer by
``vllm_cascade_plugin.agreement``: chosen-token logprobs within 0.02 on average and 0.1 at most,
position by position up to each completion's first diverging token, where the top-2 margin
exceeds 0.1 in both; at least half the generated positions compared; and a mean deviation at
most 1.5 times the two plugin-off kernels' on the same workload in the same run
(``reference_mean_abs_dlogprob``). Beam search compares the finished beams and their cumulative
logprobs the same way. A plan with every page id shifted by one must fail by a wide margin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine_oracle

HERE = Path(__file__).parent
GRAPH_KEYS = ("graph_captures", "graph_replays", "full_graph_captures", "full_graph_replays")
FLASH_ATTN = "FLASH_ATTN"
RESULTS: list[dict] = []
_RUNS: dict[tuple, dict] = {}  # one engine per configuration per session, shared by the tests


def run_engine(model_dir: str, out: Path, *, plugin: bool, runner: str,
               extra: tuple[str, ...] = (), knobs: tuple[tuple[str, str], ...] = (),
               backend: str = "FLASHINFER") -> dict:
    if backend != "FLASHINFER":
        extra = (*extra, "--backend", backend)
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
    # The plugin's own log lines (what it said it does, and why), for the tests to read.
    plugin_lines = [line for line in log.splitlines() if "vllm-cascade-plugin:" in line]
    return {**json.loads(out.read_text()), "plugin_log": plugin_lines}


def judged(model_dir: str, tmp_path: Path, on: dict, runner: str, extra: tuple[str, ...] = (),
           tp: int = 1) -> list[dict]:
    """Every workload of ``on`` judged against the plugin-off FlashInfer and FlashAttention
    engines of the same runner and ``extra`` arguments (run once per session)."""
    off = run_engine(model_dir, tmp_path / "off.json", plugin=False, runner=runner, extra=extra)
    reference = run_engine(model_dir, tmp_path / "fa.json", plugin=False, runner=runner,
                           extra=extra, backend=FLASH_ATTN)
    assert on["workloads"].keys() <= off["workloads"].keys() == reference["workloads"].keys()
    return [engine_oracle.judge(name, runner, on["workloads"][name], off["workloads"][name],
                                reference["workloads"][name], tp=tp) for name in on["workloads"]]


def check(rows: list[dict]) -> None:
    RESULTS.extend(rows)
    # Two correct kernels must agree first: otherwise the model, not the plugin, is at fault.
    bad_reference = [r for r in rows if r["reference_outcome"] != "pass"]
    assert not bad_reference, json.dumps(bad_reference, indent=1)
    failed = [r for r in rows if r["outcome"] != "pass"]
    assert not failed, json.dumps(failed, indent=1)


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_cascade_engine_matches_flat_engine(sharp_model_dir, tmp_path, runner):
    on = run_engine(sharp_model_dir, tmp_path / "on.json", plugin=True, runner=runner)
    rows = [{**row, **{k: on.get(k) for k in GRAPH_KEYS}}
            for row in judged(sharp_model_dir, tmp_path, on, runner)]
    check(rows)
    # Planning and running a step never waits for the GPU (async scheduling stays useful).
    assert on["sync_violations"] == [], on["sync_violations"]
    if on["executors"] == ["fa3"]:  # its decode steps ran from whole-step CUDA graphs
        assert on["full_graph_replays"] > 0, {k: on[k] for k in GRAPH_KEYS}
    if kernel := os.environ.get("CASCADE_TEST_KERNEL"):
        assert on["executors"] == [kernel], on["executors"]


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_layer_graphs_match_flat_engine(sharp_model_dir, tmp_path, runner):
    """CASCADE_FULL_GRAPHS=0: vLLM's piecewise path with the executor's per-layer CUDA graphs
    (what tensor parallelism, LoRA and weight offloading get); same agreement with the
    plugin-off engine, the per-layer graphs replayed and no whole-step graph."""
    on = run_engine(sharp_model_dir, tmp_path / "on.json", plugin=True, runner=runner,
                    knobs=(("CASCADE_FULL_GRAPHS", "0"),))
    rows = [{**row, "full_graphs": 0, **{k: on.get(k) for k in GRAPH_KEYS}}
            for row in judged(sharp_model_dir, tmp_path, on, runner)]
    check(rows)
    assert on["sync_violations"] == [], on["sync_violations"]
    assert on["full_graph_captures"] == 0, {k: on[k] for k in GRAPH_KEYS}
    if on["executors"] == ["fa3"]:
        assert on["graph_replays"] > 0, {k: on[k] for k in GRAPH_KEYS}


@pytest.mark.parametrize("backend", ["FLASHINFER", FLASH_ATTN])
def test_fp8_kv_cache_engine_matches_flat_fp8_engine(sharp_model_dir, tmp_path, backend):
    """``--kv-cache-dtype fp8`` on both sides: the plugin with CASCADE_FP8_KV=1 against the
    plugin off, same backend, same FP8 cache (unit scales: the dummy checkpoint has none), by
    the engine comparison's rule; every step that could ran as cascade, with no fallback."""
    extra = ("--kv-cache-dtype", "fp8")
    on = run_engine(sharp_model_dir, tmp_path / "on.json", plugin=True, runner="v2",
                    extra=extra, knobs=(("CASCADE_FP8_KV", "1"),), backend=backend)
    off = run_engine(sharp_model_dir, tmp_path / "off.json", plugin=False, runner="v2",
                     extra=extra, backend=backend)
    reference = run_engine(sharp_model_dir, tmp_path / "ref.json", plugin=False, runner="v2",
                           extra=extra, backend=FLASH_ATTN if backend != FLASH_ATTN
                           else "FLASHINFER")
    rows = [{**engine_oracle.judge(name, "v2", on["workloads"][name], off["workloads"][name],
                                   reference["workloads"][name]), "kv_cache_dtype": "fp8",
             "backend": backend} for name in on["workloads"]]
    check(rows)
    assert any(w["steps_cascade"] > 0 for w in on["workloads"].values()), on["workloads"]
    assert not any(w["fallbacks"] for w in on["workloads"].values()), on["workloads"]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="tensor parallelism needs two GPUs")
@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_tensor_parallel_engine_matches_flat_engine(sharp_model_dir, tmp_path, runner):
    """Workloads (a) and (d) with tensor_parallel_size=2: each rank plans its own heads' step."""
    extra = ("--workloads", "a_,d_", "--tp", "2")
    on = run_engine(sharp_model_dir, tmp_path / "on.json", plugin=True, runner=runner,
                    extra=extra)
    rows = [{**row, "executors": on.get("executors")}
            for row in judged(sharp_model_dir, tmp_path, on, runner, extra=extra, tp=2)]
    assert len(rows) == 2, rows
    check(rows)
    assert on["full_graph_captures"] == 0, on  # whole-step graphs are for TP=1 only


# The corrupted runs do workload (a) only; it runs first in every engine, so the full plugin-off
# runs' results for it are what a run of (a) alone would give: they are the references.
ONLY_A = ("--workloads", "a_")
A = "a_one_8k_prefix_x64"


def test_a_corrupted_plan_fails_the_engine_comparison_widely(sharp_model_dir, tmp_path):
    on = run_engine(sharp_model_dir, tmp_path / "bad.json", plugin=True, runner="v2",
                    extra=(*ONLY_A, "--corrupt"))
    [row] = judged(sharp_model_dir, tmp_path, on, "v2")
    RESULTS.append({**row, "workload": f"{A} (corrupted plan: must fail)",
                    "corrupted": "every page"})
    assert engine_oracle.fails_widely(row), row


def test_a_one_page_error_is_measured(sharp_model_dir, tmp_path):
    """One page of the 8K prefix (its middle one) read as its neighbour: recorded, and it must
    fail the comparison. The CPU test proves ten tolerances for a 256-token prefix; one page of
    8K holds 1/512 of the context, so this row says how far that reaches at the engine's size."""
    on = run_engine(sharp_model_dir, tmp_path / "bad1.json", plugin=True, runner="v2",
                    extra=(*ONLY_A, "--corrupt-one-page"))
    [row] = judged(sharp_model_dir, tmp_path, on, "v2")
    RESULTS.append({**row, "workload": f"{A} (one page corrupted: must fail)",
                    "corrupted": "one page"})
    assert row["outcome"] == "fail", row


def teardown_module() -> None:
    out = os.environ.get("CASCADE_RESULTS_DIR")
    if out and RESULTS:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "correctness.json").write_text(json.dumps(RESULTS, indent=1))
