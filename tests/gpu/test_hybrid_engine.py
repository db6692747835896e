"""Engine level with a recurrent hybrid: Mamba2 mixers beside full-attention layers. Under
``CASCADE_UNVERIFIED=1`` the attention layers' KV-cache group runs cascade while the Mamba state
stays vLLM's, and the answers are plugin-off vLLM's; without it every step runs flat.

The model is the hybrid oracle (``oracle_hybrid.save``): Granite 4.0-H's dense stack (vLLM's
GraniteMoeHybridForCausalLM, no experts) at a small size, Mamba2 mixers at layers 0 and 2, full
attention (no positional encoding) at 1 and 3, sharpened like the other oracles. On the CPU
(``tests/test_hybrid_model.py``, transformers in bf16) one attention page of its 2K prefix read
as its neighbour moves the chosen-token logprobs by ~0.27-0.30, 14 times the mean tolerance and
22 times the deviation of two correct attention kernels (0.0125).

What vLLM 0.26 does with such a model, read in its source (and checked on the CPU by
``tests/test_hybrid_model.py``):

* prefix caching is off by default for a hybrid (``EngineArgs.
  _set_default_chunked_prefill_and_prefix_caching_args``: ``is_prefix_caching_supported and
  not is_hybrid``); the engine driver asks for it (``enable_prefix_caching=True``);
* with it, ``MambaModelConfig.verify_and_update_config`` (``model_executor/models/config.py``)
  sets ``mamba_cache_mode`` to "all" for a model that ``SupportsMambaPrefixCaching`` (Granite
  4.0-H does; "align" otherwise): the Mamba state is cached at every block boundary, and a
  prefix hits the cache in whole blocks;
* once the model is loaded the worker calls ``Platform.update_block_size_for_backend``
  (``platforms/interface.py``): ``_align_hybrid_block_size`` makes the attention page at least
  a layer's Mamba state in bytes, rounded up (mode "all") to ``lcm(mamba_chunk_size, the
  backend's kernel block alignment)``: 256 tokens here (135 tokens' worth of state, chunk 256,
  FLASH_ATTN's and TRITON_ATTN's multiples of 16), ``mamba_block_size`` the same, the Mamba
  page padded to the attention page's bytes. The 2K shared prefix is eight such pages;
* the hybrid KV-cache manager (its default) keeps the two Mamba mixers' state in one KV-cache
  group (``MambaSpec``) and the two attention layers in another (``FullAttentionSpec``); the
  Mamba2 layers run vLLM's Mamba2 backend, never the plugin's builders;
* Model Runner V2 runs hybrids (``v1/worker/gpu/model_states/mamba_hybrid.py``).

So each step has two KV-cache groups: without ``CASCADE_UNVERIFIED=1`` it runs flat (counted
as the fallback "more than one KV cache group"); with it the plugin plans the attention group
from its own block table (``integration/kv_groups.py``) and that group's builder runs cascade on
256-token pages. Three engines judge the plugin by ``engine_oracle.judge``: the plugin on, and
two correct kernels with it off, FLASH_ATTN (the comparison) and TRITON_ATTN, on the same runner;
a plan with one page of each shared prefix read as its neighbour (``--corrupt-one-page``) must
fail widely. No CUDA graphs (``--eager``), as the sliding-window engine tests.

Besides Triton (the Mamba2 kernels: ``layers/mamba/ops``) the model needs only the compiled ops a
Llama needs, ``torch.ops._C.rms_norm`` and ``torch.ops._C.silu_and_mul``: no fused-MoE kernel,
no ``_C.relu_squared`` (NemotronH's MLP), no ``_C.selective_scan_fwd`` (Mamba1, Jamba). The
tests skip, saying which, where one is missing.
"""

from __future__ import annotations

import json

import pytest

import engine_oracle
from gpu import engines
from gpu.engines import Engine

WORKLOAD = "x_sliding_2k_prefix_x32"  # a cached 2K prefix x 32 requests: eight 256-token pages
ONLY = ("--workloads", WORKLOAD, "--eager")
UNVERIFIED = (("CASCADE_UNVERIFIED", "1"),)
ATTN = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
COMPILED_OPS = ("_C.rms_norm", "_C.silu_and_mul")  # torch.ops.<namespace>.<op>
RESULTS: list[dict] = []


def hybrid_kernels_missing() -> str | None:
    """Why this vLLM build cannot run the hybrid oracle (a compiled op or Triton missing), or
    None."""
    import torch

    try:
        import vllm._custom_ops  # noqa: F401  (loads vLLM's compiled extensions)
        from vllm.triton_utils import HAS_TRITON
    except ImportError as exc:
        return f"vLLM's custom ops cannot be imported ({exc})"
    if not HAS_TRITON:
        return "Triton is not available: vLLM's Mamba2 kernels (layers/mamba/ops) are Triton"
    missing = [f"torch.ops.{name}" for name in COMPILED_OPS
               if not hasattr(getattr(torch.ops, name.split(".")[0]), name.split(".")[1])]
    if missing:
        return f"this vLLM build lacks {', '.join(missing)}, which Granite 4.0-H's layers need"
    return None


@pytest.fixture
def hybrid_model(hybrid_model_dir: str) -> str:
    if reason := hybrid_kernels_missing():
        pytest.skip(reason)
    return hybrid_model_dir


def _judged_run(model_dir: str, runner: str, label: str,
                knobs: tuple[tuple[str, str], ...] = UNVERIFIED,
                extra: tuple[str, ...] = ()) -> tuple[dict, dict, dict]:
    """The plugin-on engine (``knobs``, ``extra`` beside ``ONLY``) judged against plugin-off
    FLASH_ATTN and TRITON_ATTN on the same runner, the three side by side: its result, the
    workload's counters and the judged row (kept for ``correctness_hybrid.json``)."""
    off = Engine(model_dir, False, runner, "FLASH_ATTN", ONLY)
    on, flat, triton = engines.run(off.with_(plugin=True, extra=(*ONLY, *extra), knobs=knobs),
                                   off, off.with_(backend="TRITON_ATTN"))
    row = engine_oracle.judge(WORKLOAD, runner, on["workloads"][WORKLOAD],
                              flat["workloads"][WORKLOAD], triton["workloads"][WORKLOAD])
    row = {**row, "workload": f"{WORKLOAD} ({label})", "backend": "FLASH_ATTN",
           "reference_backend": "TRITON_ATTN", "model": "hybrid oracle (GraniteMoeHybrid)"}
    RESULTS.append(row)
    # Two correct kernels must agree first: otherwise the model, not the plugin, is at fault.
    assert row["reference_outcome"] == "pass", json.dumps(row, indent=1)
    assert on["sync_violations"] == [], on["sync_violations"]
    return on, on["workloads"][WORKLOAD], row


def _off_lines(on: dict) -> list[str]:
    """The plugin's lines saying that cascade is off for some attention layers or the model."""
    return [line for line in on["plugin_log"] if "cascade attention is off for" in line]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_unverified_paths_run_the_attention_group_as_cascade_beside_the_mamba_state(
        hybrid_model, runner):
    """``CASCADE_UNVERIFIED=1``: steps are planned from the attention layers' group (its own
    block table of 256-token pages; on V2 its CPU mirror) and run cascade; the Mamba state is
    vLLM's; the answers are plugin-off vLLM's."""
    on, counts, row = _judged_run(hybrid_model, runner, f"Mamba2 hybrid on {runner}, attention "
                                  "group planned")
    assert row["outcome"] == "pass", json.dumps(row, indent=1)
    assert counts["steps_cascade"] > 0, counts
    assert counts["decode_steps_cascade"] > 0, counts
    assert counts["fallbacks"] == {}, counts
    assert _off_lines(on) == [], on["plugin_log"]  # both attention layers may run cascade


def test_without_unverified_paths_every_step_runs_flat_and_matches_vllm(hybrid_model):
    """The default: a step of two KV-cache groups runs flat, counted as a fallback (the plugin
    was live and saw the steps)."""
    _, counts, row = _judged_run(hybrid_model, "v1", "Mamba2 hybrid, default: flat", knobs=())
    assert row["outcome"] == "pass", json.dumps(row, indent=1)
    assert counts["steps_cascade"] == 0, counts
    assert counts["fallbacks"].get("more than one KV cache group", 0) > 0, counts


def test_a_one_page_error_in_the_attention_group_fails_widely(hybrid_model):
    """The middle page of the shared prefix (page 4 of 8, 256 tokens) read as its neighbour in
    every cascade step: the comparison must fail by a wide margin (``engine_oracle.
    fails_widely``), as the CPU test's one-page errors do (compared over ~10% of the positions,
    the engine rule's mean ~0.2)."""
    _, counts, row = _judged_run(hybrid_model, "v1", "one page corrupted: must fail",
                                 extra=("--corrupt-one-page",))
    row["corrupted"] = "one page"
    assert counts["steps_cascade"] > 0, counts
    assert engine_oracle.fails_widely(row), json.dumps(row, indent=1)


def teardown_module() -> None:
    engines.write_results("correctness_hybrid", RESULTS)
