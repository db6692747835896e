"""The served model folders (examples/models/, config only: ``vllm serve --load-format dummy``) as
vLLM 0.26 reads them on the CPU: the architecture it builds, each layer's kind, the attention
shape, the hybrid KV cache's Mamba mode and the attention page it sets on FLASH_ATTN; and what
``vllm-cascade check`` says of them. serve/expected.py's shapes rest on these."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.serve import configs as sc
from benchmarks.serve import expected as se
from vllm_cascade_plugin.face import families

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
MODELS = ROOT / "examples" / "models"


def vllm_view(folder: str) -> dict:
    """Run in a child process: the folder's engine config as ``vllm serve`` makes it (dummy
    weights, prefix caching), and for a Mamba hybrid the page ``Platform`` aligns on
    FLASH_ATTN from its default 16 tokens."""
    import vllm_cpu

    vllm_cpu.use_cpu_platform()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    with vllm_cpu.triton_for_the_cpu_platform():
        config = EngineArgs(model=folder, load_format="dummy", skip_tokenizer_init=True,
                            enforce_eager=True, max_model_len=8192, block_size=16,
                            enable_prefix_caching=True).create_engine_config()
    model = config.model_config
    cls, _ = ModelRegistry.resolve_model_cls(model.architectures, model_config=model)
    hf = model.hf_config
    import vllm

    out = {"vllm": vllm.__version__, "class": cls.__name__,
           "layer_types": dict(Counter(getattr(hf, "layer_types", None) or [])),
           "head_size": model.get_head_size(),
           "kv_heads": model.get_num_kv_heads(config.parallel_config),
           "sliding_window": getattr(hf, "sliding_window", None), "hybrid": model.is_hybrid,
           "mamba_cache_mode": config.cache_config.mamba_cache_mode}
    if model.is_hybrid:
        Platform._align_hybrid_block_size(config, FlashAttentionBackend)
    out["page"] = config.cache_config.block_size
    return out


@pytest.fixture(scope="module")
def views() -> dict:
    pytest.importorskip("vllm")
    code = ("import json, sys, test_serve_models_cpu as t; "
            "print('@@' + json.dumps({f: t.vllm_view(f) for f in sys.argv[1:]}))")
    folders = [str(MODELS / f) for f in ("gemma3-12b", "bamba-9b", "gpt-oss-20b-dense",
                                         "llama3-8b")]
    # The servers' registration of the architectures vLLM does not ship (the stand-in's).
    registered = [p for f in folders for p in sc.model_pythonpath(Path(f))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*registered, str(HERE), str(ROOT / "tests"), str(ROOT / "src"), str(ROOT),
         os.environ.get("PYTHONPATH", "")])}
    env.pop("CASCADE_ATTENTION", None)
    proc = subprocess.run([sys.executable, "-c", code, *folders], env=env, text=True,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("@@")]
    return {Path(k).name: v for k, v in json.loads(line[2:]).items()}


def test_gemma3_is_vllms_gemma3_text_stack_of_five_sliding_layers_to_one_full(views):
    view = views["gemma3-12b"]
    assert view["class"] == "Gemma3ForCausalLM"
    assert view["layer_types"] == {"sliding_attention": 40, "full_attention": 8}
    assert (view["head_size"], view["kv_heads"], view["sliding_window"]) == (256, 8, 1024)
    assert not view["hybrid"] and view["page"] == 16  # no recurrent layer: FLASH_ATTN's page


def test_the_mamba_hybrid_is_dense_with_prefix_caching_of_its_state_and_768_token_pages(views):
    """vLLM 0.26 dropped BambaForCausalLM (removed in 0.23); GraniteMoeHybridForCausalLM, the
    architecture that carried it on, builds Bamba-9B's shapes without experts. vLLM 0.26 (the
    device's, which the served pairs run on, and serve/expected.py's page) caches the Mamba
    state at every page boundary ("all") on pages of whole Mamba chunks, 768 tokens; 0.33 and
    later cache it in "align" mode on pages sized to the state alone, smaller."""
    view = views["bamba-9b"]
    assert view["class"] == "GraniteMoeHybridForCausalLM"
    assert view["layer_types"] == {"linear_attention": 29, "full_attention": 3}
    assert (view["head_size"], view["kv_heads"]) == (128, 8)
    assert view["hybrid"]
    if view["vllm"].startswith("0.26."):
        assert view["mamba_cache_mode"] == "all"
        assert view["page"] == 768 == se.model_of(MODELS / "bamba-9b").page
    else:  # 16-token kernel blocks whose attention bytes hold a layer's state, not whole chunks
        model = se.model_of(MODELS / "bamba-9b")
        assert view["mamba_cache_mode"] == "align"
        assert view["page"] % 16 == 0 and view["page"] % 256 != 0
        assert view["page"] * model.kv_token_bytes >= model.state_bytes


def test_the_gpt_oss_stand_in_is_gpt_oss_20bs_attention_stack_registered_with_vllm(views):
    """Its architecture is registered in the servers' processes (``serve/configs.REGISTERED``):
    gpt-oss-20b's 24 layers alternating 128-token windows and full attention, 8 KV heads of
    64; under the hybrid KV-cache manager by window, not by recurrent state."""
    view = views["gpt-oss-20b-dense"]
    assert view["class"] == "GptOssDenseForCausalLM"
    assert view["layer_types"] == {"sliding_attention": 12, "full_attention": 12}
    assert (view["head_size"], view["kv_heads"], view["sliding_window"]) == (64, 8, 128)
    assert not view["hybrid"] and view["page"] == 16
    model = se.model_of(MODELS / "gpt-oss-20b-dense")
    assert (model.full_layers, model.sliding_layers, model.window) == (12, 12, 128)


def test_check_runs_gpt_oss_full_layers_as_cascade_only_with_unverified_for_its_sinks():
    lines, can = families.model_lines(str(MODELS / "gpt-oss-20b-dense"), unverified=False)
    assert "12 full-attention, 12 sliding-window and 0 recurrent" in lines[0]
    assert can is False and "CASCADE_UNVERIFIED=1" in " ".join(lines)
    lines, can = families.model_lines(str(MODELS / "gpt-oss-20b-dense"), unverified=True)
    assert can is True


def test_llama_is_one_kind_of_layer(views):
    view = views["llama3-8b"]
    assert view["class"] == "LlamaForCausalLM" and not view["hybrid"] and view["page"] == 16


def test_check_runs_gemma3s_full_layers_as_cascade_by_default():
    lines, can = families.model_lines(str(MODELS / "gemma3-12b"), unverified=False)
    assert "8 full-attention, 40 sliding-window and 0 recurrent" in lines[0]
    assert can is True and "CASCADE_UNVERIFIED" not in lines[0]
    assert "The 8 full-attention layer(s) can run cascade" in lines[0]


def test_check_runs_bambas_attention_layers_as_cascade_only_with_unverified():
    lines, can = families.model_lines(str(MODELS / "bamba-9b"), unverified=False)
    text = lines[0]
    assert "3 full-attention, 0 sliding-window and 29 recurrent" in text
    assert can is False and "CASCADE_UNVERIFIED=1" in text
    lines, can = families.model_lines(str(MODELS / "bamba-9b"), unverified=True)
    assert can is True and "full-attention layer(s) can run cascade" in lines[0]
