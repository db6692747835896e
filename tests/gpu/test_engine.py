"""Engine level: vLLM's LLM with the plugin on vs. off, same prompts, both model runners, judged
against two correct kernels.

The model is the oracle model (``tests/oracle_model.py``): a small random Llama with sharp
attention and spread logits. On the CPU (``tests/test_oracle_model.py``) a one-page KV error of a
256-token prefix moves its chosen-token logprobs by ~40 times the mean tolerance while two
correct kernels stay within a third of it; one page is a smaller share of a longer prefix (~3
times the tolerance at 4K on the CPU), and the one-page row below measures it at 8K. Each
configuration runs in its own process (the plugin registers at startup), once, shared by every
test that needs it (``tests/gpu/engines.py``).

Every workload runs on three engines, side by side: the plugin on (FlashInfer wrapped), the
plugin off with FlashInfer, and the plugin off with FlashAttention (for the plugin in vLLM's
FLASH_ATTN backend, ``test_flash_attn_engine.py``, the two swap). A row of ``correctness.json``
(``engine_oracle.judge``) compares the plugin with plugin-off FlashInfer by
``vllm_cascade_plugin.face.agreement``: chosen-token logprobs position by position up to each
completion's first diverging token, where the top-2 margin exceeds 0.1 in both; a mean and a
largest deviation at most 1.5 times the two plugin-off kernels' on the same workload in the same
run (``reference_mean_abs_dlogprob``, ``reference_max_abs_dlogprob``; the mean floored at 0.002,
the largest at 0.1) and a mean within 0.02; at least half the generated positions compared, or
two thirds as many as the two kernels' own comparison reaches where that is less. Beam search
compares the finished beams and their cumulative logprobs. A plan with every page id shifted by
one must fail by a wide margin (``engine_oracle.fails_widely``), one wrong page must fail.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import engine_oracle
from gpu import engines
from gpu.engines import Engine

GRAPH_KEYS = ("graph_captures", "graph_replays", "full_graph_captures", "full_graph_replays")
FLASH_ATTN = "FLASH_ATTN"
RESULTS: list[dict] = []
SECOND_KERNEL = {"FLASHINFER": FLASH_ATTN, FLASH_ATTN: "FLASHINFER"}


def plugin_on(model_dir: str, runner: str = "v2", backend: str = "FLASHINFER",
              extra: tuple[str, ...] = (), knobs: tuple[tuple[str, str], ...] = ()) -> Engine:
    return Engine(model_dir, True, runner, backend, extra, knobs)


def judged(on: Engine, tp: int = 1, off_extra: tuple[str, ...] | None = None,
           quantised: bool = False) -> tuple[dict, list[dict]]:
    """``on``'s result and every workload of it judged against the plugin-off engine of the same
    backend, runner and arguments (``off_extra``: other arguments) and the plugin-off engine of
    the other backend (the second correct kernel); the three run side by side. ``quantised``:
    an FP8 KV cache (``engine_oracle.judge``)."""
    off = on.with_(plugin=False, knobs=(), extra=on.extra if off_extra is None else off_extra)
    reference = off.with_(backend=SECOND_KERNEL[on.backend])
    ran, flat, second = engines.run(on, off, reference)
    assert ran["workloads"].keys() <= flat["workloads"].keys() == second["workloads"].keys()
    return ran, [engine_oracle.judge(name, on.runner, ran["workloads"][name],
                                     flat["workloads"][name], second["workloads"][name], tp=tp,
                                     quantised=quantised)
                 for name in ran["workloads"]]


def check(rows: list[dict]) -> None:
    RESULTS.extend(rows)
    # Two correct kernels must agree first: otherwise the model, not the plugin, is at fault.
    bad_reference = [r for r in rows if r["reference_outcome"] != "pass"]
    assert not bad_reference, json.dumps(bad_reference, indent=1)
    failed = [r for r in rows if r["outcome"] != "pass"]
    assert not failed, json.dumps(failed, indent=1)


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_cascade_engine_matches_flat_engine(sharp_model_dir, runner):
    on, rows = judged(plugin_on(sharp_model_dir, runner))
    check([{**row, **{k: on.get(k) for k in GRAPH_KEYS}} for row in rows])
    # Planning and running a step never waits for the GPU (async scheduling stays useful).
    assert on["sync_violations"] == [], on["sync_violations"]
    if on["executors"] == ["fa3"]:  # its decode steps ran from whole-step CUDA graphs
        assert on["full_graph_replays"] > 0, {k: on[k] for k in GRAPH_KEYS}
    if kernel := os.environ.get("CASCADE_TEST_KERNEL"):
        assert on["executors"] == [kernel], on["executors"]


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_layer_graphs_match_flat_engine(sharp_model_dir, runner):
    """CASCADE_FULL_GRAPHS=0: vLLM's piecewise path with the executor's per-layer CUDA graphs
    (what tensor parallelism, LoRA and weight offloading get); same agreement with the
    plugin-off engine, the per-layer graphs replayed and no whole-step graph."""
    on, rows = judged(plugin_on(sharp_model_dir, runner, knobs=(("CASCADE_FULL_GRAPHS", "0"),)))
    check([{**row, "full_graphs": 0, **{k: on.get(k) for k in GRAPH_KEYS}} for row in rows])
    assert on["sync_violations"] == [], on["sync_violations"]
    assert on["full_graph_captures"] == 0, {k: on[k] for k in GRAPH_KEYS}
    if on["executors"] == ["fa3"]:
        assert on["graph_replays"] > 0, {k: on[k] for k in GRAPH_KEYS}


@pytest.mark.parametrize("backend", ["FLASHINFER", FLASH_ATTN])
def test_fp8_kv_cache_engine_matches_flat_fp8_engine(sharp_model_dir, backend):
    """``--kv-cache-dtype fp8`` on all three engines: the plugin with CASCADE_FP8_KV=1 against
    the plugin off, same backend, same FP8 cache (unit scales: the dummy checkpoint has none),
    and the other backend's flat FP8 path as the second kernel. FP8 rounding moves the oracle
    model's logprobs beyond the bf16 tolerances for two correct kernels too (by 0.05-0.08 on
    average on the H200), so the plugin is judged relative to them alone (mean, largest and
    coverage); every step that could ran as cascade, with no fallback. Eager (``--eager``):
    what FP8 changes is the kernels' arithmetic, which CUDA graphs replay unchanged."""
    on, rows = judged(plugin_on(sharp_model_dir, backend=backend,
                                extra=("--kv-cache-dtype", "fp8", "--eager"),
                                knobs=(("CASCADE_FP8_KV", "1"),)), quantised=True)
    check([{**row, "kv_cache_dtype": "fp8", "backend": backend} for row in rows])
    assert any(w["steps_cascade"] > 0 for w in on["workloads"].values()), on["workloads"]
    assert not any(w["fallbacks"] for w in on["workloads"].values()), on["workloads"]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="tensor parallelism needs two GPUs")
@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_tensor_parallel_engine_matches_flat_engine(sharp_model_dir, runner):
    """Workloads (a) and (d) with tensor_parallel_size=2: each rank plans its own heads' step."""
    on, rows = judged(plugin_on(sharp_model_dir, runner, extra=("--workloads", "a_,d_",
                                                               "--tp", "2")), tp=2)
    assert len(rows) == 2, rows
    check([{**row, "executors": on.get("executors")} for row in rows])
    assert on["full_graph_captures"] == 0, on  # whole-step graphs are for TP=1 only


# The corrupted runs do workload (a) only; it runs first in every engine, so the full plugin-off
# runs' results for it are what a run of (a) alone would give: they are the references.
ONLY_A = ("--workloads", "a_")
A = "a_one_8k_prefix_x64"


def test_a_corrupted_plan_fails_the_engine_comparison_widely(sharp_model_dir):
    _, [row] = judged(plugin_on(sharp_model_dir, extra=(*ONLY_A, "--corrupt")), off_extra=())
    RESULTS.append({**row, "workload": f"{A} (corrupted plan: must fail)",
                    "corrupted": "every page"})
    assert engine_oracle.fails_widely(row), row


def test_a_one_page_error_is_measured(sharp_model_dir):
    """One page of the 8K prefix (its middle one) read as its neighbour: recorded, and it must
    fail the comparison. The CPU test proves ten tolerances for a 256-token prefix; one page of
    8K holds 1/512 of the context, so this row says how far that reaches at the engine's size."""
    _, [row] = judged(plugin_on(sharp_model_dir, extra=(*ONLY_A, "--corrupt-one-page")),
                      off_extra=())
    RESULTS.append({**row, "workload": f"{A} (one page corrupted: must fail)",
                    "corrupted": "one page"})
    assert row["outcome"] == "fail", row


def teardown_module() -> None:
    engines.write_results("correctness", RESULTS)
