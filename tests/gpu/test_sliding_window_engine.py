"""Engine level with a model that mixes sliding-window and full-attention layers: no layer the
cascade cannot serve runs it, in either KV-cache layout vLLM gives such a model, and the answers
are plugin-off vLLM's.

The model is the sliding-window oracle (``oracle_model.save_mixed``): the oracle's shape and
sharpening, four layers, 0 and 2 attending to the last 512 tokens, 1 and 3 to all; vLLM runs it
as its MistralForCausalLM. The workload shares a cached 2K prefix, four windows long, over 32
requests: a sliding layer run as a windowless cascade would read 1.5K tokens it must not, which
moves the chosen-token logprobs by ~70 times the mean tolerance (measured in transformers on the
CPU by ``tests/test_sliding_window_model.py``, which also reads vLLM's grouping of its layers).

vLLM 0.26 lays out such a model's KV cache one of two ways; the V1 model runner, on the H200:

* without the hybrid KV cache manager (``--no-hybrid-kv-cache``): one KV-cache group, in which
  the runner gives the sliding layers and the full layers a metadata builder each. The sliding
  layers' builder runs flat (said once, naming layers 0 and 2); the full layers' builder runs
  cascade. (Model Runner V2 keeps one builder for all four, which then runs flat: the CPU test
  reads that from vLLM's own grouping.)
* with it (vLLM's default on a GPU): a group of the sliding layers and one of the full layers.
  The sliding layers' builder runs flat (said once); the steps are planned from the full
  layers' group, which runs cascade (``integration/kv_groups.py``), on V1 and V2.

Two more oracles take the same workload in vLLM's default hybrid layout: Gemma 3's text stack
(five sliding layers to one full layer, a KV-cache group per kind), with the plugin's defaults,
and gpt-oss's attention stack (alternating 128-token windows, a sink per head on every layer),
with ``CASCADE_UNVERIFIED=1`` (sinks need it), in a dense stand-in for gpt-oss,
GptOssDenseForCausalLM: vLLM's gpt-oss attention,
norms, embedding and head with a dense MLP in place of the mixture of experts, so that it runs
where vLLM's build has no fused-MoE kernels (``tests/gpu/gpt_oss_dense``, registered in every
engine process through that folder's ``sitecustomize``).

The tests assert which layers run flat and whether any step ran cascade in each layout, so that a
change in either (vLLM's layout, the plugin's choice) shows here. The engines run vLLM's
FLASH_ATTN backend: its FlashInfer backend refuses sliding-window layers on SM90 (vLLM 0.26,
``FlashInferMetadataBuilder``). Three engines judge the plugin by ``engine_oracle.judge``: the
plugin on, and two correct kernels with it off, FLASH_ATTN (the comparison) and TRITON_ATTN;
the plugin in the hybrid layout is judged against the same two. No CUDA graphs
(``--eager``): what is tested is which layers the cascade serves, and graphs replay the same
kernels.
"""

from __future__ import annotations

import json

import pytest

import engine_oracle
import oracle_model
from gpu import engines
from gpu.engines import Engine

WORKLOAD = "x_sliding_2k_prefix_x32"
ONLY = ("--workloads", WORKLOAD, "--eager")
UNIFIED = (*ONLY, "--no-hybrid-kv-cache")
# Gemma 3's five sliding-window groups each hold a window plus two steps' tokens (vLLM 0.26:
# (512 - 1 + 2 x 2048) / 16 + 1 = 289 blocks) beside the full layer's 9,216 tokens (576): a
# request of max_model_len needs 2,021 blocks, more than the driver's default cache.
GEMMA3 = (*ONLY, "--num-blocks", "3072")
RUNNER = "v1"
ATTN = "model.layers.{}.self_attn.attn"
RESULTS: list[dict] = []


def _judged_run(model_dir: str, extra: tuple[str, ...], layout: str,
                knobs: tuple[tuple[str, str], ...] = (), runner: str = RUNNER,
                reference: tuple[str, ...] = UNIFIED,
                pythonpath: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """The plugin-on engine in ``layout`` (with ``knobs``, on ``runner``), judged against
    plugin-off FLASH_ATTN and TRITON_ATTN (V1, one KV-cache group unless ``reference`` says
    otherwise, run side by side with it); none of its steps waited for the GPU. Returns its
    result and the workload's counters. ``pythonpath``: folders first on every engine's path
    (a test-only model's registration)."""
    off = Engine(model_dir, False, RUNNER, "FLASH_ATTN", reference, pythonpath=pythonpath)
    on, flat, triton = engines.run(
        off.with_(plugin=True, extra=extra, knobs=knobs, runner=runner), off,
        off.with_(backend="TRITON_ATTN"))
    row = engine_oracle.judge(WORKLOAD, runner, on["workloads"][WORKLOAD],
                              flat["workloads"][WORKLOAD], triton["workloads"][WORKLOAD])
    row = {**row, "backend": "FLASH_ATTN", "reference_backend": "TRITON_ATTN",
           "kv_cache_layout": layout}
    RESULTS.append(row)
    # Two correct kernels must agree first: otherwise the model, not the plugin, is at fault.
    assert row["reference_outcome"] == "pass", json.dumps(row, indent=1)
    assert row["outcome"] == "pass", json.dumps(row, indent=1)
    assert on["sync_violations"] == [], on["sync_violations"]
    return on, on["workloads"][WORKLOAD]


def _flat_lines(on: dict) -> list[str]:
    """The plugin's lines saying which layers run flat for their sliding windows."""
    return [line for line in on["plugin_log"]
            if "cascade attention is off for" in line and "sliding-window attention" in line]


def test_one_kv_cache_group_runs_sliding_layers_flat_full_layers_cascade_and_matches_vllm(
        sliding_model_dir):
    on, counts = _judged_run(sliding_model_dir, UNIFIED, "one KV-cache group")
    [line] = _flat_lines(on)  # once, for the sliding layers' builder alone
    assert "for 2 attention layer(s)" in line, line
    assert ATTN.format(0) in line and ATTN.format(2) in line, line
    assert ATTN.format(1) not in line and ATTN.format(3) not in line, line
    assert "vLLM's flat FLASH_ATTN attention" in line, line
    assert counts["steps_cascade"] > 0, counts  # the full layers' builder ran cascade
    assert counts["fallbacks"] == {}, counts


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_hybrid_kv_cache_runs_the_full_layers_group_as_cascade_by_default(
        sliding_model_dir, runner):
    """vLLM's default hybrid KV cache with the plugin's defaults: steps are planned from the
    full-attention layers' group (its own block table; on V2 its CPU mirror), which runs
    cascade; the sliding layers' builder runs flat, said once; vLLM's answers."""
    on, counts = _judged_run(sliding_model_dir, ONLY, f"hybrid on {runner}, full-attention "
                             "group planned", (), runner)
    assert counts["steps_cascade"] > 0, counts
    assert counts["fallbacks"] == {}, counts
    [line] = _flat_lines(on)  # once, for the sliding layers' builder alone
    assert "for 2 attention layer(s)" in line, line
    assert ATTN.format(0) in line and ATTN.format(2) in line, line
    assert ATTN.format(1) not in line and ATTN.format(3) not in line, line


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_gpt_oss_attention_with_sinks_runs_its_full_layers_as_cascade(
        gpt_oss_dense_model_dir, runner):
    """gpt-oss's attention stack (``oracle_model.build_gpt_oss_dense``: 128-token sliding layers
    between full ones, a sink per head on every layer, one dense MLP per layer) as
    GptOssDenseForCausalLM, vLLM's gpt-oss with a dense MLP for its experts, with vLLM's
    default hybrid KV cache: with ``CASCADE_UNVERIFIED=1`` the full layers' group runs cascade,
    each layer's sinks applied to its merged output; the sliding layers run flat; the answers
    are plugin-off vLLM's (FLASH_ATTN, and TRITON_ATTN as the second correct kernel, both with
    their sinks). Every engine, plugin on and off, has the model's registration on its path."""
    on, counts = _judged_run(gpt_oss_dense_model_dir, ONLY,
                             f"gpt-oss (dense stand-in) hybrid on {runner}, sinks",
                             (("CASCADE_UNVERIFIED", "1"),), runner, reference=ONLY,
                             pythonpath=(str(oracle_model.GPT_OSS_DENSE_SITE),))
    assert counts["steps_cascade"] > 0, counts
    assert counts["fallbacks"] == {}, counts
    [line] = _flat_lines(on)  # the sliding (even) layers' builder, once
    gpt_oss_attn = "model.layers.{}.attn.attn"  # vLLM's names of gpt-oss's attention layers
    assert gpt_oss_attn.format(0) in line and gpt_oss_attn.format(2) in line, line
    assert gpt_oss_attn.format(1) not in line and gpt_oss_attn.format(3) not in line, line


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_gemma3_runs_its_full_attention_layer_as_cascade_under_the_hybrid_kv_cache(
        gemma3_model_dir, runner):
    """Gemma 3's text stack (``oracle_model.build_gemma3``: five 512-token sliding-window
    layers to one full-attention layer, QK-norm, two RoPE bases) as vLLM's Gemma3ForCausalLM
    with its default hybrid KV cache, a group per layer kind, and the plugin's defaults: the
    full-attention layer's group runs cascade, the sliding-window layers flat; vLLM's answers."""
    on, counts = _judged_run(gemma3_model_dir, GEMMA3, f"gemma3 hybrid on {runner}", (),
                             runner, reference=GEMMA3)
    assert counts["steps_cascade"] > 0, counts
    assert counts["fallbacks"] == {}, counts
    lines = " ".join(_flat_lines(on))  # the sliding layers' builders, one line each at most
    assert all(ATTN.format(i) in lines for i in range(5)), lines
    assert ATTN.format(5) not in lines, lines


def teardown_module() -> None:
    engines.write_results("correctness_sliding_window", RESULTS)
