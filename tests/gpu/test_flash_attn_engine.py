"""Engine level through vLLM's default backend, FLASH_ATTN: the plugin on vs. off, same prompts.

The same driver, model (std-0.02 random weights) and tolerances as ``test_engine.py``
(``vllm_cascade_plugin.agreement``), with ``--backend FLASH_ATTN``: the plugin-off engine is vLLM's
own FlashAttention path, so every comparison is against what a user gets without the plugin.
Needs a Hopper GPU (the FLASH_ATTN backend's cascade runs on FlashAttention 3). Also ngram
speculative decoding (V1 runner, vLLM's only one for ngram), whose verification steps (1 + k
query tokens per row) run cascade. Written on a CPU machine; not yet run on a GPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import engine_oracle
from gpu.test_engine import run_engine
from vllm_cascade_plugin import agreement

FA = ("--backend", "FLASH_ATTN")
RESULTS: list[dict] = []


def judge(name: str, runner: str, on: dict, off: dict) -> dict:
    """The plugin in FLASH_ATTN against vLLM's own FLASH_ATTN, by the absolute agreement rule;
    the cascade workloads must also run cascade on most decode steps."""
    worst, mean, count = agreement.compare(on["requests"], off["requests"])
    fraction = on["decode_steps_cascade"] / max(on["decode_steps_planned"], 1)
    ok = agreement.agrees(worst, mean, count)
    if name.startswith(engine_oracle.CASCADE_WORKLOADS):
        ok = ok and fraction >= engine_oracle.MIN_CASCADE_STEPS
    return {"workload": name, "runner": runner, "max_abs_dlogprob": worst,
            "mean_abs_dlogprob": mean, "compared_tokens": count,
            "cascade_step_fraction": fraction, "fallbacks": on["fallbacks"],
            "outcome": "pass" if ok else "fail"}


def _failed(rows: list[dict]) -> list[dict]:
    RESULTS.extend({**row, "backend": "FLASH_ATTN"} for row in rows)
    return [r for r in rows if r["outcome"] != "pass"]


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_flash_attn_cascade_engine_matches_vllms_flash_attn(model_dir, tmp_path, runner):
    on = run_engine(model_dir, tmp_path / "on.json", plugin=True, runner=runner, extra=FA)
    off = run_engine(model_dir, tmp_path / "off.json", plugin=False, runner=runner, extra=FA)
    rows = [judge(name, runner, on["workloads"][name], off["workloads"][name])
            for name in off["workloads"]]
    failed = _failed(rows)
    assert not failed, json.dumps(failed, indent=1)
    assert on["executors"] == ["fa3"], on["executors"]  # FLASH_ATTN's cascade: FA3 only
    assert on["sync_violations"] == [], on["sync_violations"]
    assert on["full_graph_replays"] > 0, on  # decode steps ran from whole-step graphs


def test_flash_attn_without_sharing_every_step_stays_vllms(model_dir, tmp_path):
    only = (*FA, "--workloads", "x_no_sharing")
    on = run_engine(model_dir, tmp_path / "on.json", plugin=True, runner="v2", extra=only)
    off = run_engine(model_dir, tmp_path / "off.json", plugin=False, runner="v2", extra=only)
    (name,) = off["workloads"]
    row = judge(name, "v2", on["workloads"][name], off["workloads"][name])
    assert not _failed([row]), row
    counts = on["workloads"][name]
    assert counts["steps_planned"] > 0 and counts["steps_cascade"] == 0, counts
    assert counts["fallbacks"] == {}, counts


def test_flash_attn_corrupted_plan_fails_the_comparison(model_dir, tmp_path):
    only = (*FA, "--workloads", "a_")
    on = run_engine(model_dir, tmp_path / "bad.json", plugin=True, runner="v2",
                    extra=(*only, "--corrupt"))
    off = run_engine(model_dir, tmp_path / "off.json", plugin=False, runner="v2", extra=only)
    name = "a_one_8k_prefix_x64"
    row = judge(name, "v2", on["workloads"][name], off["workloads"][name])
    RESULTS.append({**row, "workload": f"{name} (corrupted plan: must fail)",
                    "backend": "FLASH_ATTN"})
    assert row["outcome"] == "fail", row


def test_ngram_speculative_decoding_verification_steps_run_cascade(model_dir, tmp_path):
    """vLLM's ngram speculative decoding (3 draft tokens, synchronous scheduling, V1 runner) with
    the plugin on and off: same tokens within the tolerances, and verification steps ran as
    cascade."""
    spec = (*FA, "--ngram", "3", "--workloads", "a_,x_ngram")
    on = run_engine(model_dir, tmp_path / "on.json", plugin=True, runner="v1", extra=spec)
    off = run_engine(model_dir, tmp_path / "off.json", plugin=False, runner="v1", extra=spec)
    rows = []
    for name in off["workloads"]:
        worst, mean, count = agreement.compare(on["workloads"][name]["requests"],
                                               off["workloads"][name]["requests"])
        rows.append({"workload": f"{name} (ngram, 3 drafts)", "runner": "v1",
                     "max_abs_dlogprob": worst, "mean_abs_dlogprob": mean,
                     "compared_tokens": count, "fallbacks": on["workloads"][name]["fallbacks"],
                     "outcome": "pass" if agreement.agrees(worst, mean, count) else "fail"})
    failed = _failed(rows)
    assert not failed, json.dumps(failed, indent=1)
    assert on["verification_steps"] > 0, on  # ngram proposed drafts
    assert on["verification_steps_cascade"] > 0, on
    assert on["sync_violations"] == [], on["sync_violations"]


def teardown_module() -> None:
    out = os.environ.get("CASCADE_RESULTS_DIR")
    if out and RESULTS:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "correctness_flash_attn.json").write_text(json.dumps(RESULTS, indent=1))
