"""Engine level through vLLM's default backend, FLASH_ATTN: the plugin on vs. off, same prompts.

The same driver, oracle model (sharp attention: a one-page error shows) and rule as
``test_engine.py`` (``engine_oracle.judge``), with ``--backend FLASH_ATTN``: the plugin-off
engine is vLLM's own FlashAttention path, so every comparison is against what a user gets
without the plugin, and plugin-off FlashInfer is the second correct kernel. Needs a Hopper GPU
(the FLASH_ATTN backend's cascade runs on FlashAttention 3). Also ngram speculative decoding (V1
runner, vLLM's only one for ngram), whose verification steps (1 + k query tokens per row) run
cascade.
"""

from __future__ import annotations

import json

import pytest

import engine_oracle
from gpu import engines
from gpu.test_engine import FLASH_ATTN, ONLY_A, judged, plugin_on
from vllm_cascade_plugin.face import agreement

RESULTS: list[dict] = []


def _failed(rows: list[dict]) -> list[dict]:
    RESULTS.extend({**row, "backend": FLASH_ATTN} for row in rows)
    return [r for r in rows if r["outcome"] != "pass" or r.get("reference_outcome") == "fail"]


@pytest.mark.parametrize(("runner", "mixed"), [("v2", "split"), ("v1", "split"),
                                               ("v2", "whole")],
                         ids=["v2", "v1", "v2-mixed-steps-whole"])
def test_flash_attn_cascade_engine_matches_vllms_flash_attn(sharp_model_dir, runner, mixed):
    """Every step that shares as cascade (CASCADE_POLICY=always); mixed prefill+decode steps
    split (CASCADE_SPLIT_MIXED=1, the engines' setting), or planned whole, the default."""
    knobs = (("CASCADE_SPLIT_MIXED", "0"),) if mixed == "whole" else ()
    on, rows = judged(plugin_on(sharp_model_dir, runner, backend=FLASH_ATTN, knobs=knobs))
    if mixed == "whole":
        rows = [{**row, "workload": f"{row['workload']} (mixed steps whole)"} for row in rows]
    failed = _failed(rows)
    assert not failed, json.dumps(failed, indent=1)
    assert on["executors"] == ["fa3"], on["executors"]  # FLASH_ATTN's cascade: FA3 only
    assert on["sync_violations"] == [], on["sync_violations"]
    assert on["full_graph_replays"] > 0, on  # decode steps ran from whole-step graphs


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_flash_attn_without_sharing_every_step_stays_vllms(sharp_model_dir, runner):
    """No prompt shared: every step planned flat, no fallback (both runners' hooks know the
    steps after the pre-check's proof unshared from the requests' first block ids, read from
    vLLM's own structures: V2's mirror, V1's persistent batch, there with its switch
    CASCADE_UNVERIFIED), the outputs vLLM's."""
    knobs = (("CASCADE_UNVERIFIED", "1"),) if runner == "v1" else ()
    on, [row] = judged(plugin_on(sharp_model_dir, runner, backend=FLASH_ATTN,
                                 extra=("--workloads", "x_no_sharing"), knobs=knobs))
    assert not _failed([row]), row
    counts = on["workloads"][row["workload"]]
    assert counts["steps_planned"] > 0 and counts["steps_cascade"] == 0, counts
    assert counts["fallbacks"] == {}, counts


def test_flash_attn_corrupted_plan_fails_the_comparison_widely(sharp_model_dir):
    _, [row] = judged(plugin_on(sharp_model_dir, backend=FLASH_ATTN,
                                extra=(*ONLY_A, "--corrupt")), off_extra=())
    RESULTS.append({**row, "workload": f"{row['workload']} (corrupted plan: must fail)",
                    "backend": FLASH_ATTN})
    assert engine_oracle.fails_widely(row), row


def test_ngram_speculative_decoding_verification_steps_run_cascade(sharp_model_dir):
    """vLLM's ngram speculative decoding (3 draft tokens, synchronous scheduling, V1 runner) with
    the plugin on and off: same tokens within the tolerances, and verification steps ran as
    cascade."""
    on_engine = plugin_on(sharp_model_dir, "v1", backend=FLASH_ATTN,
                          extra=("--ngram", "3", "--workloads", "a_,x_ngram"))
    on, off = engines.run(on_engine, on_engine.with_(plugin=False, knobs=()))
    rows = []
    for name in off["workloads"]:
        deviation = agreement.measure(on["workloads"][name]["requests"],
                                      off["workloads"][name]["requests"])
        ok = agreement.agrees(deviation.worst, deviation.mean, deviation.compared)
        rows.append({"workload": f"{name} (ngram, 3 drafts)", "runner": "v1",
                     "max_abs_dlogprob": deviation.worst, "mean_abs_dlogprob": deviation.mean,
                     "compared_tokens": deviation.compared,
                     "compared_fraction": deviation.fraction,
                     "fallbacks": on["workloads"][name]["fallbacks"],
                     "outcome": "pass" if ok else "fail"})
    failed = _failed(rows)
    assert not failed, json.dumps(failed, indent=1)
    assert on["verification_steps"] > 0, on  # ngram proposed drafts
    assert on["verification_steps_cascade"] > 0, on
    assert on["sync_violations"] == [], on["sync_violations"]


def teardown_module() -> None:
    engines.write_results("correctness_flash_attn", RESULTS)
