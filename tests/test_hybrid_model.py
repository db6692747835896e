"""The recurrent-hybrid oracle (``oracle_hybrid.build``): what vLLM makes of it, and its teeth.

``tests/gpu/test_hybrid_engine.py`` runs it in vLLM with the plugin on and off. What that test
expects rests on facts checked here on the CPU:

* vLLM 0.26 builds the saved folder as its ``GraniteMoeHybridForCausalLM`` with Mamba2 mixers
  where transformers has them (layers 0 and 2, ``model.layers.N.mixer``) and attention at 1
  and 3; prefix caching is off unless asked for (a hybrid's default), and with it the Mamba
  state is cached every page (``mamba_cache_mode`` "all") and a page is
  ``oracle_hybrid.PAGE_SIZE`` tokens for the FLASH_ATTN backend, as the GPU worker sizes it
  once the model is loaded (``Platform._align_hybrid_block_size``; vLLM 0.33 and later cache
  in "align" mode by default, on smaller pages: the CPU suite checks what each release does);
  vLLM's KV-cache grouping (``get_kv_cache_configs``, hybrid manager on) gives the Mamba state
  one group and the attention layers another, of the kinds the plugin's
  ``integration/kv_groups.py`` plans beside each other under ``CASCADE_UNVERIFIED=1``.
* A one-page KV error in the attention layers (the prefix's page ``p`` read as page ``p + 1``,
  the error of a plan with a shifted page id, on pages of ``PAGE_SIZE`` tokens: the Mamba state
  untouched) moves the chosen-token logprobs by more than ten times the engine rule's mean
  tolerance, fifteen times two correct attention kernels' deviation and five times what
  computing the whole model in float32 instead of bf16 does. Measured: 0.27 to 0.30 for pages
  0, 3 and 6 (teacher-forced, where the top-2 margin exceeds 0.1); two kernels 0.0125 (the
  engine rule, over 85% of the positions); float32 0.024; the top logit below 6.4.

The runs are transformers' (``GraniteMoeHybridForCausalLM``, its PyTorch Mamba2 scan) in
bfloat16, vLLM's dtype: the prefix is prefilled once into transformers' hybrid cache, as vLLM's
prefix cache holds it, and every request continues from a copy. The two correct kernels are
``test_oracle_model``'s bf16 emulations of FlashAttention (128- and 48-key tiles), here inside a
bf16 model: their deviation is what the engine test's two plugin-off kernels show. Measured that
way, the Llama engine oracle's two kernels differ by 0.013 on a 2K prefix; on the H200 its
FLASH_ATTN and FlashInfer engines differ by 0.013 to 0.017 (``correctness.json``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import oracle_hybrid
import vllm_cpu
from test_oracle_model import (
    GENERATED,
    KERNELS,
    SUFFIX,
    _forward,
    _greedy,
    flash_attention,
    records,
    scores,
    teacher_forced_delta,
)
from vllm_cascade_plugin.face import agreement, families

HERE = Path(__file__).parent
PREFIX, REQUESTS, PAGE = 2048, 8, oracle_hybrid.PAGE_SIZE  # the engine test's prefix: 8 pages
PAGES = (0, 3, 6)  # first, middle and last-but-one page (page 7's neighbour is a request's own)
MIXERS = [f"model.layers.{i}.mixer" for i in (0, 2)]  # vLLM's names of the layers
ATTENTION = [f"model.layers.{i}.self_attn.attn" for i in (1, 3)]
TILE128, TILE48 = "hybrid_bf16_tile128", "hybrid_bf16_tile48"


def vllm_layout(model_dir: str) -> dict:
    """Run in a child process (it starts torch.distributed): vLLM's defaults for the model, and
    with prefix caching its layers as vLLM's GraniteMoeHybrid decoder layers build them, the
    page size the GPU worker gives them for the FLASH_ATTN backend, and the KV-cache groups."""
    import tempfile

    vllm_cpu.use_cpu_platform()
    import vllm.v1.utils
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import granitemoehybrid
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    from vllm_cascade_plugin.integration import compat

    vllm.v1.utils.PIN_MEMORY = False

    def engine_config(**args):  # the engine driver's arguments (tests/gpu/engine_driver.py)
        with vllm_cpu.triton_for_the_cpu_platform():
            return EngineArgs(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
                              block_size=16, enforce_eager=True, max_model_len=9216,
                              max_num_batched_tokens=2048, **args).create_engine_config()

    default = engine_config()
    out: dict = {"vllm": vllm.__version__,
                 "default_prefix_caching": default.cache_config.enable_prefix_caching,
                 "default_mamba_cache_mode": default.cache_config.mamba_cache_mode}
    config = engine_config(enable_prefix_caching=True)
    from vllm.v1.attention.backends import utils

    if hasattr(utils, "resolve_kv_cache_layout"):  # vLLM 0.29+: the engine core resolves it
        utils.resolve_kv_cache_layout(config, [["NHD"]])
    cache = config.cache_config
    cache.mamba_ssm_cache_dtype = "auto"  # the CPU platform makes it float32 on AMX machines
    hf = config.model_config.hf_config
    out.update(architecture=config.model_config.architectures[0],
               mamba_cache_mode=cache.mamba_cache_mode)
    mlp = granitemoehybrid.GraniteMoeSharedMLP
    # The decoder layers without their MLP, whose SiluAndMul binds a compiled op (torch.ops._C)
    # this CPU build of vLLM has not: the KV-cache specs come from the mixers.
    granitemoehybrid.GraniteMoeSharedMLP = lambda *args, **kwargs: torch.nn.Identity()
    try:
        with set_current_vllm_config(config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tempfile.mktemp()}")
            initialize_model_parallel(1, 1)
            for i, kind in enumerate(hf.layer_types):
                granitemoehybrid.ALL_DECODER_LAYER_TYPES[kind](
                    hf, i, config.model_config, cache, prefix=f"model.layers.{i}")
            # What the GPU worker does once the model is loaded: Platform.
            # update_block_size_for_backend with the FLASH_ATTN backend (block size 16 kept).
            Platform._align_hybrid_block_size(config, FlashAttentionBackend)
    finally:
        granitemoehybrid.GraniteMoeSharedMLP = mlp
    out.update(block_size=cache.block_size, mamba_block_size=cache.mamba_block_size)
    layers = config.compilation_config.static_forward_context
    specs = {name: layer.get_kv_cache_spec(config) for name, layer in layers.items()}
    out["specs"] = {name: type(spec).__name__ for name, spec in specs.items()}
    out["page_bytes"] = sorted({spec.page_size_bytes for spec in specs.values()})
    kv = vllm_cpu.kv_cache_config(config, specs)
    out["groups"] = [{"layers": g.layer_names, "spec": type(g.kv_cache_spec).__name__,
                      "kind": compat.kv_cache_kind(g.kv_cache_spec),
                      "block_size": g.kv_cache_spec.block_size} for g in kv.kv_cache_groups]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return oracle_hybrid.save(tmp_path_factory.mktemp("hybrid-oracle"))


@pytest.fixture(scope="module")
def layout(model_dir: str) -> dict:
    return vllm_cpu.in_child("import json, sys, test_hybrid_model as t; "
                             "print('@@' + json.dumps(t.vllm_layout(sys.argv[1])))", model_dir)


def test_vllm_builds_mamba_mixers_and_attention_where_transformers_has_them(model_dir, layout):
    from transformers import GraniteMoeHybridForCausalLM

    hf = GraniteMoeHybridForCausalLM.from_pretrained(model_dir)
    assert [layer.self_attn is not None for layer in hf.model.layers] == [False, True] * 2
    assert layout["architecture"] == oracle_hybrid.ARCHITECTURE
    assert layout["specs"] == {**dict.fromkeys(MIXERS, "MambaSpec"),
                               **dict.fromkeys(ATTENTION, "FullAttentionSpec")}
    # and `vllm-cascade check` reads the saved config the same way
    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert families.layer_kinds(config) == [families.RECURRENT, families.FULL] * 2


def test_prefix_caching_caches_the_mamba_state_at_page_boundaries(layout):
    """vLLM 0.26 (the GPU tests'): a hybrid's prefix caching is off by default (``EngineArgs.
    _set_default_chunked_prefill_and_prefix_caching_args``); asked for, the Mamba state of
    every page boundary is cached ("all": GraniteMoeHybrid supports it) and the attention page
    grows to the Mamba chunk size. vLLM 0.33 and later: on by default, in "align" mode (the
    state of a step's last token, where it ends a page), the page sized to the state alone.
    Either way every layer's page holds the same bytes (the Mamba state padded to it)."""
    block = layout["block_size"]
    if layout["vllm"].startswith("0.26."):
        assert layout["default_prefix_caching"] is False
        assert layout["default_mamba_cache_mode"] == "none"
        assert layout["mamba_cache_mode"] == "all"
        assert block == PAGE
    else:
        assert layout["default_prefix_caching"] is True
        assert layout["default_mamba_cache_mode"] == layout["mamba_cache_mode"] == "align"
        assert block % 16 == 0 and block < PAGE  # FLASH_ATTN's kernel blocks: multiples of 16
    assert layout["mamba_block_size"] == block
    assert layout["page_bytes"] == [block * 2 * 2 * 128 * 2]  # one page size for every layer


def test_the_mamba_state_and_the_attention_layers_are_a_kv_cache_group_each(layout):
    from vllm_cascade_plugin.integration import compat

    block = layout["block_size"]
    assert layout["groups"] == [
        {"layers": MIXERS, "spec": "MambaSpec", "kind": compat.RECURRENT, "block_size": block},
        {"layers": ATTENTION, "spec": "FullAttentionSpec", "kind": "full attention",
         "block_size": block}]


def _typed(attend):
    """A ``test_oracle_model`` kernel (float32 out) for a bf16 model: its output in q's dtype."""
    def typed(module, query, *args, **kwargs):
        out, weights = attend(module, query, *args, **kwargs)
        return out.to(query.dtype), weights
    return typed


def _batched(cache, n: int):
    """``n`` copies of a one-request cache: transformers' Mamba layers (LinearAttentionLayer)
    have no ``batch_repeat_interleave`` of their own."""
    cache = copy.deepcopy(cache)
    for layer in cache.layers:
        if not hasattr(layer, "recurrent_states"):
            layer.batch_repeat_interleave(n)
            continue
        for states in (layer.conv_states, layer.recurrent_states):
            for i, state in states.items():
                if state is not None:
                    states[i] = state.repeat_interleave(n, 0)
    return cache


def _prefix_cache(model, prefix: list[int]):
    return _forward(model, torch.tensor([prefix]), logits_to_keep=1)[1]


def _scored(model, cache, suffixes: list[list[int]], generated: list[list[int]]) -> dict:
    """Teacher-forced: each generated position's logits (rounded to bf16, as vLLM's) and
    log-softmax."""
    ids = torch.tensor([s + g for s, g in zip(suffixes, generated, strict=True)])
    logits, _ = _forward(model, ids, _batched(cache, len(suffixes)))
    return scores(logits[:, SUFFIX - 1:SUFFIX - 1 + GENERATED])


def _shift_page(cache, page: int):
    """The cache as a plan with the attention group's page ``page`` shifted by one reads it:
    the next page's K/V in its place, in both attention layers; the Mamba state untouched."""
    cache = copy.deepcopy(cache)
    rows, neighbour = slice(page * PAGE, (page + 1) * PAGE), slice((page + 1) * PAGE,
                                                                   (page + 2) * PAGE)
    shifted = 0
    for layer in cache.layers:
        if isinstance(getattr(layer, "keys", None), torch.Tensor):
            for t in (layer.keys, layer.values):
                t[:, :, rows] = t[:, :, neighbour].clone()
            shifted += 1
    assert shifted == len(ATTENTION)
    return cache


@pytest.fixture(scope="module")
def runs(model_dir: str) -> dict:
    from transformers import AttentionInterface, GraniteMoeHybridForCausalLM

    AttentionInterface.register(TILE128, _typed(flash_attention(128)))
    AttentionInterface.register(TILE48, _typed(flash_attention(48)))
    AttentionInterface.register("oracle_fp32", KERNELS["oracle_fp32"])
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = GraniteMoeHybridForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 31900, PREFIX).tolist()
    suffixes = [rng.integers(100, 31900, SUFFIX).tolist() for _ in range(REQUESTS)]
    out: dict = {}
    with torch.no_grad():
        for name in (TILE128, TILE48):
            model.set_attn_implementation(name)
            cache = _prefix_cache(model, prefix)
            if name == TILE128:
                generated = _greedy(model, cache, suffixes, GENERATED, _batched)
                for page in PAGES:
                    out[page] = _scored(model, _shift_page(cache, page), suffixes, generated)
            out[name] = _scored(model, cache, suffixes, generated)
        # The same weights computed in float32 throughout, attention unrounded.
        fp32 = model.float()
        fp32.set_attn_implementation("oracle_fp32")
        out["fp32"] = _scored(fp32, _prefix_cache(fp32, prefix), suffixes, generated)
    return out


def test_two_correct_kernels_agree_within_the_tolerance(runs):
    """In a bf16 model, as in the engine: well within the mean tolerance, over most positions
    (the engine test's reference must pass ``engine_oracle``'s absolute bounds)."""
    dev = agreement.measure(records(runs[TILE48]), records(runs[TILE128]))
    assert dev.fraction >= 0.5, dev
    assert dev.mean <= 0.75 * agreement.MEAN_TOL, dev
    assert dev.worst <= agreement.MAX_TOL, dev


def test_the_top_logit_stays_small_so_one_bf16_rounding_flip_is_small(runs):
    top = runs[TILE128]["logits"].amax(-1)
    assert float(top.abs().max()) < 8.0  # one bf16 step of a logit below 8: at most 1/32


@pytest.mark.parametrize("page", PAGES)
def test_a_one_page_kv_error_moves_the_logprobs_ten_tolerances(runs, page):
    reference = runs[TILE128]
    kernels = agreement.measure(records(runs[TILE48]), records(reference))
    moved = teacher_forced_delta(runs[page], reference)
    assert moved >= 10 * agreement.MEAN_TOL, moved
    assert moved >= 15 * teacher_forced_delta(runs[TILE48], reference)
    # and far more than the whole model computed in float32 instead of bf16 moves them
    assert moved >= 5 * teacher_forced_delta(runs["fp32"], reference)
    assert not agreement.agrees_with_reference(
        agreement.measure(records(runs[page]), records(reference)), kernels)
