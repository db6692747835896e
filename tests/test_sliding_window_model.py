"""The sliding-window oracle (``oracle_model.build_mixed``): what vLLM makes of it, and its teeth.

``tests/gpu/test_sliding_window_engine.py`` runs it in vLLM with the plugin on and off. What that
test expects rests on two facts checked here on the CPU:

* vLLM builds the saved model folder as its ``MistralForCausalLM`` with the window on the same
  layers as transformers' MinistralForCausalLM (layers 0 and 2, ``WINDOW`` tokens; 1 and 3 full),
  and lays out its KV cache one of two ways (vLLM's own ``get_kv_cache_configs`` and, where it
  has it, the GPU model runner's attention grouping, ``init_attn_backend``): with the hybrid KV
  cache manager (vLLM's default on a GPU), one KV-cache group of sliding layers and one of full
  ones; without it, one KV-cache group and one attention group, so one metadata builder for all
  four layers, whose spec carries the window.
* Ignoring the window on the sliding layers moves the chosen-token logprobs by far more than the
  engine rule's tolerance, while two correct kernels (bf16 emulations with different tilings)
  stay well within it: a sliding layer given a windowless cascade cannot pass the GPU test. The
  teeth are measured in transformers (float32 compute, bf16 weights as saved), teacher-forced
  on the greedy tokens of transformers' own SDPA attention; the shared prefix is twice the
  window.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import oracle_model
import vllm_cpu
from test_oracle_model import KERNELS, assert_far_beyond_kernels, greedy_ids, records, scored_last
from vllm_cascade_plugin.face import agreement

HERE = Path(__file__).parent
PREFIX, SUFFIX, REQUESTS, GENERATED = 2 * oracle_model.WINDOW, 16, 4, 16
SLIDING, FULL = [0, 2], [1, 3]
ATTN = "model.layers.{}.self_attn.attn"


def vllm_layout(model_dir: str) -> dict:
    """Run in a child process (it starts torch.distributed): the model's attention layers as
    vLLM's MistralAttention builds them, and the KV-cache and attention groups vLLM forms from
    their specs with the hybrid KV cache manager on and off."""
    import tempfile

    vllm_cpu.use_cpu_platform()
    import vllm.v1.utils
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.mistral import MistralAttention

    try:
        from vllm.v1.worker.gpu.attn_utils import init_attn_backend
    except ImportError:
        init_attn_backend = None

    vllm.v1.utils.PIN_MEMORY = False
    with vllm_cpu.triton_for_the_cpu_platform():
        config = EngineArgs(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
                            block_size=oracle_model.PAGE_SIZE, enforce_eager=True,
                            max_model_len=4096, enable_prefix_caching=True).create_engine_config()
    from vllm.v1.attention.backends import utils

    if hasattr(utils, "resolve_kv_cache_layout"):  # vLLM 0.29+: the engine core resolves it
        utils.resolve_kv_cache_layout(config, [["NHD"]])
    hf = config.model_config.hf_config
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
        for i in range(hf.num_hidden_layers):  # as LlamaDecoderLayer makes them
            MistralAttention(config=hf, hidden_size=hf.hidden_size,
                             num_heads=hf.num_attention_heads,
                             num_kv_heads=hf.num_key_value_heads,
                             max_position_embeddings=hf.max_position_embeddings,
                             cache_config=config.cache_config,
                             prefix=f"model.layers.{i}.self_attn")
    layers = config.compilation_config.static_forward_context
    out: dict = {"architecture": config.model_config.architectures[0],
                 "windows": {name: layer.sliding_window for name, layer in layers.items()}}
    specs = {name: layer.get_kv_cache_spec(config) for name, layer in layers.items()}
    for hybrid in (True, False):
        config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
        kv = vllm_cpu.kv_cache_config(config, specs)
        key = "hybrid" if hybrid else "unified"
        out[key] = [{"layers": g.layer_names, "spec": type(g.kv_cache_spec).__name__,
                     "window": getattr(g.kv_cache_spec, "sliding_window", None)}
                    for g in kv.kv_cache_groups]
        if init_attn_backend is None:
            out["no_attention_groups"] = "no vllm.v1.worker.gpu.attn_utils.init_attn_backend"
            continue
        try:
            with set_current_vllm_config(config):
                groups = init_attn_backend(kv, config, torch.device("cpu"))[0]
        except ValueError as exc:  # 0.33: the CPU backend's pages are multiples of 32 tokens
            out["no_attention_groups"] = f"init_attn_backend on the CPU: {exc}"
            continue
        out[f"{key}_attention_groups"] = [
            [{"layers": a.layer_names,
              "window": getattr(a.kv_cache_spec, "sliding_window", None)} for a in group]
            for group in groups]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    return oracle_model.save_mixed(tmp_path_factory.mktemp("sliding-oracle"))


@pytest.fixture(scope="module")
def layout(model_dir: str) -> dict:
    return vllm_cpu.in_child("import json, sys, test_sliding_window_model as t; "
                             "print('@@' + json.dumps(t.vllm_layout(sys.argv[1])))", model_dir)


def test_vllm_gives_the_window_to_the_layers_transformers_does(model_dir, layout):
    from transformers import MinistralForCausalLM

    hf = MinistralForCausalLM.from_pretrained(model_dir)
    assert layout["architecture"] == oracle_model.MIXED_ARCHITECTURE
    expected = {ATTN.format(i): layer.self_attn.sliding_window
                for i, layer in enumerate(hf.model.layers)}
    assert layout["windows"] == expected
    assert {expected[ATTN.format(i)] for i in SLIDING} == {oracle_model.WINDOW}
    assert {expected[ATTN.format(i)] for i in FULL} == {None}


def test_hybrid_kv_cache_manager_puts_sliding_and_full_layers_in_two_kv_cache_groups(layout):
    assert layout["hybrid"] == [
        {"layers": [ATTN.format(i) for i in SLIDING], "spec": "SlidingWindowSpec",
         "window": oracle_model.WINDOW},
        {"layers": [ATTN.format(i) for i in FULL], "spec": "FullAttentionSpec", "window": None}]


def test_without_it_one_kv_cache_group_and_one_builder_hold_every_layer(layout):
    everything = [ATTN.format(i) for i in range(4)]
    assert layout["unified"] == [
        {"layers": everything, "spec": "FullAttentionSpec", "window": oracle_model.WINDOW}]
    if "no_attention_groups" in layout:
        pytest.skip(layout["no_attention_groups"])
    assert layout["unified_attention_groups"] == [
        [{"layers": everything, "window": oracle_model.WINDOW}]]
    assert layout["hybrid_attention_groups"] == [
        [{"layers": [ATTN.format(i) for i in SLIDING], "window": oracle_model.WINDOW}],
        [{"layers": [ATTN.format(i) for i in FULL], "window": None}]]


@pytest.fixture(scope="module")
def runs(model_dir: str) -> dict:
    from transformers import AttentionInterface, MinistralForCausalLM

    for name, attend in KERNELS.items():
        AttentionInterface.register(name, attend)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = MinistralForCausalLM.from_pretrained(model_dir).float().eval()
    model.set_attn_implementation("sdpa")
    out: dict = {}
    with torch.no_grad():
        # Greedy, by transformers' own attention, masks and (sliding-window) KV cache.
        ids = greedy_ids(model, PREFIX, SUFFIX, REQUESTS, GENERATED)
        out["sdpa"] = scored_last(model, ids, GENERATED)
        for name in ("oracle_tile128", "oracle_tile48"):
            model.set_attn_implementation(name)
            out[name] = scored_last(model, ids, GENERATED)
        # The same weights, every layer attending to all tokens: the window ignored.
        windowless = oracle_model.build_mixed(window=False).float().eval()
        windowless.load_state_dict(model.state_dict())
        windowless.set_attn_implementation("oracle_tile128")
        out["windowless"] = scored_last(windowless, ids, GENERATED)
    return out


def test_two_correct_kernels_with_the_window_agree_well_within_the_tolerance(runs):
    """The bf16 emulations (128- and 48-key tiles) within half the tolerance; transformers'
    SDPA (float32, its own window mask, no bf16 rounding inside) within the tolerance: the
    emulation's window is transformers'."""
    reference = records(runs["oracle_tile128"])
    for other, share in (("oracle_tile48", 0.5), ("sdpa", 1.0)):
        dev = agreement.measure(records(runs[other]), reference)
        assert dev.fraction >= 0.6, (other, dev)
        assert dev.mean <= agreement.MEAN_TOL * share, (other, dev)
        assert dev.worst <= agreement.MAX_TOL * share, (other, dev)


def test_ignoring_the_window_moves_the_logprobs_ten_tolerances(runs):
    assert_far_beyond_kernels(runs["windowless"], runs["oracle_tile128"], runs["oracle_tile48"])
