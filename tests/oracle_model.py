"""The engine oracle's model: a small random Llama whose outputs a one-page KV error visibly moves.

The tiny Llama with transformers' plain initialisation (std 0.02) makes a poor oracle: its
attention is nearly uniform and its logits nearly flat (the chosen token's logprob is about -8,
the top-2 margin mostly below 0.1), so a plan with every page id shifted by one moved the
engine comparison's mean |Δ logprob| to 0.0215 against a tolerance of 0.02, over a few percent of
the positions. This model keeps the plain initialisation and changes three things:

* ``q_proj`` and ``k_proj`` scaled by :data:`QK_SCALE`: attention logits spread with a standard
  deviation of about 1.8 instead of 0.2, so a query's attention gathers on the few keys it
  matches best and a page that holds them changes the output (sharper, 4x, was noisier between
  two correct kernels for no more teeth);
* ``lm_head`` scaled by :data:`LM_HEAD_SCALE`: logits spread (standard deviation about 2.7), the
  chosen token's logprob is about -3 and the top-2 margin exceeds 0.1 at ~85% of positions;
* a logit offset that softmax ignores: hidden dimension 0 holds the constant
  :data:`OFFSET_INPUT` in every token's embedding (no layer writes to it) and every ``lm_head`` row
  reads it with weight ``-OFFSET_WEIGHT``, so all logits of a position drop by the same amount and
  the top one sits near 0..6 instead of ~10. vLLM computes logprobs from bf16 logits; one bf16
  step of a logit in [8, 16) is 0.0625, of one in [2, 4) 0.0156: small logits keep a single
  rounding flip far below the 0.1 per-token tolerance.

``tests/test_oracle_model.py`` proves on the CPU that this model has teeth (a one-page KV error
moves the chosen-token logprobs by more than ten times the tolerance, two correct attention
computations stay well within it) and ``tests/gpu/conftest.py`` saves it for the engine tests.
:func:`build_mixed` makes a sliding-window variant the same way; its teeth (the window ignored
on its sliding layers) are proven by ``tests/test_sliding_window_model.py``;
:func:`build_gpt_oss_dense` a gpt-oss one with sinks, whose teeth (a sink dropped or counted
twice) and vLLM class are checked by ``tests/test_gpt_oss_dense_model.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 32000,
    "max_position_embeddings": 16384, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
SEED = 0
QK_SCALE = 3.0
LM_HEAD_SCALE = 6.0
OFFSET_INPUT, OFFSET_WEIGHT = 0.05, 30.0
PAGE_SIZE = 16  # vLLM's KV block size on the engine tests: one page is 16 tokens


def _sharpen(model: Any) -> Any:
    """The three changes above, in place, on a float32 Llama-family model (Llama, Ministral:
    same module names); returned in bfloat16, as it is saved."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)
            # Nothing writes hidden dimension 0: it stays OFFSET_INPUT at every position.
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
    return _offset_logits(model)


def _offset_logits(model: Any, head_scale: float = LM_HEAD_SCALE,
                   offset_weight: float = OFFSET_WEIGHT) -> Any:
    """The logit offset and the spread logits (the last two changes above), in place; the model
    returned in bfloat16, as it is saved."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = OFFSET_INPUT
        model.lm_head.weight.mul_(head_scale)
        model.lm_head.weight[:, 0] = -offset_weight
    return model.to(torch.bfloat16)


def build() -> Any:
    """The model in bfloat16, as it is saved (deterministic: seeded initialisation)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    return _sharpen(LlamaForCausalLM(LlamaConfig(**CONFIG)).float().eval())


def save(out: str | Path) -> str:
    """Build the model and ``save_pretrained`` it (bf16 safetensors and config) into ``out``."""
    build().save_pretrained(out)
    return str(out)


# The sliding-window oracle: the same shape and sharpening, four layers of which the even ones
# attend to the last WINDOW tokens only and the odd ones to all (Ministral / Gemma-2 style:
# ``layer_types`` and ``sliding_window`` in the config). transformers runs it as
# MinistralForCausalLM; vLLM as its MistralForCausalLM (the Llama code, which reads
# ``layer_types``): the saved config names that architecture, model_type "ministral".
WINDOW = 512  # tokens: 32 pages; the engine test's shared prefix is four times longer
MIXED_CONFIG: dict[str, Any] = {
    **{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")},
    "num_hidden_layers": 4, "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}
MIXED_ARCHITECTURE = "MistralForCausalLM"  # vLLM's class for it (it has no Ministral class)


def build_mixed(window: bool = True) -> Any:
    """The sliding-window oracle in bfloat16 (seeded); ``window=False``: the same weights with
    every layer attending to all tokens (what a sliding layer run without its window computes)."""
    import torch
    from transformers import MinistralConfig, MinistralForCausalLM

    config = dict(MIXED_CONFIG)
    if not window:
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    torch.manual_seed(SEED)
    return _sharpen(MinistralForCausalLM(MinistralConfig(**config)).float().eval())


def save_mixed(out: str | Path) -> str:
    """Build the sliding-window oracle and save it into ``out`` as vLLM loads it."""
    build_mixed().save_pretrained(out)
    path = Path(out) / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "architectures": [MIXED_ARCHITECTURE]}, indent=1))
    return str(out)


# The gpt-oss oracle: gpt-oss's attention stack at a small size (layers alternating 128-token
# sliding windows and full attention, attention sinks on every layer, biases, YaRN RoPE, a
# mixture of experts whose router picks the same experts for every token) with the Llama
# oracle's logit offset and spread, and a gentler sharpening of the attention logits
# (GPT_OSS_QK_SCALE): at the Llama oracle's QK_SCALE, two correct GPU kernels (FLASH_ATTN and
# TRITON_ATTN, with their sinks) differed by about twice the engine rule's mean tolerance on it.
# The engine test runs its one-expert variant, the dense oracle below. Its sinks take a
# median of about a tenth of a full-attention head's softmax and half of a sliding one's
# (from a few hundredths to most of it): a sink dropped or counted twice moves every output.
GPT_OSS_CONFIG: dict[str, Any] = {
    "hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 32000,
    "max_position_embeddings": 131072, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}
GPT_OSS_SINKS = (2.0, 7.0)  # each head's sink drawn uniformly from this range
GPT_OSS_QK_SCALE = 1.75


def build_gpt_oss(**changes: Any) -> Any:
    """The gpt-oss oracle in bfloat16 (seeded), as transformers' GptOssForCausalLM;
    ``changes``: config entries that replace :data:`GPT_OSS_CONFIG`'s."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(SEED)
    model = GptOssForCausalLM(GptOssConfig(**{**GPT_OSS_CONFIG, **changes})).float().eval()
    low, high = GPT_OSS_SINKS
    with torch.no_grad():
        for layer in model.model.layers:
            attn, experts = layer.self_attn, layer.mlp.experts
            attn.q_proj.weight.mul_(GPT_OSS_QK_SCALE)
            attn.k_proj.weight.mul_(GPT_OSS_QK_SCALE)
            attn.sinks.copy_(low + (high - low) * torch.rand(attn.sinks.shape))
            # Nothing writes hidden dimension 0: it stays OFFSET_INPUT at every position.
            attn.o_proj.weight[0] = 0
            attn.o_proj.bias[0] = 0
            experts.down_proj[:, :, 0] = 0
            experts.down_proj_bias[:, 0] = 0
            # Every token routed to the same two experts: a routing choice is discontinuous,
            # and two correct kernels' rounding would flip it at some tokens.
            layer.mlp.router.weight.zero_()
            layer.mlp.router.bias.copy_(torch.arange(layer.mlp.router.bias.numel(), 0, -1))
    return _offset_logits(model)


# The dense gpt-oss oracle: the gpt-oss oracle with one expert, which every token takes with
# weight 1, saved as a dense MLP per layer (gate, up and down projections with biases, gpt-oss's
# clamped SwiGLU). vLLM runs it as GptOssDenseForCausalLM (tests/gpu/gpt_oss_dense: vLLM's own
# gpt-oss attention, norms, embedding and head around that MLP), which needs no fused-MoE
# kernels; transformers runs the same weights as GptOssForCausalLM (:func:`load_gpt_oss_dense`).
GPT_OSS_DENSE = {"num_local_experts": 1, "num_experts_per_tok": 1}
GPT_OSS_DENSE_ARCHITECTURE = "GptOssDenseForCausalLM"
GPT_OSS_DENSE_SITE = Path(__file__).parent / "gpu" / "gpt_oss_dense"  # on the engines' path
EXPERT = "mlp.experts."


def build_gpt_oss_dense() -> Any:
    """The dense gpt-oss oracle in bfloat16 (seeded), as transformers' GptOssForCausalLM with
    its one expert."""
    return build_gpt_oss(**GPT_OSS_DENSE)


def dense_state(state: dict[str, Any]) -> dict[str, Any]:
    """The one-expert model's tensors as the dense checkpoint holds them: each layer's router
    dropped, its expert as ``mlp.{gate,up,down}_proj.{weight,bias}`` ([out, in], as nn.Linear;
    gpt-oss interleaves gate and up columns: gate the even ones, up the odd ones)."""
    out = {k: v for k, v in state.items() if ".mlp." not in k}
    for key in (k for k in state if k.endswith(EXPERT + "gate_up_proj")):
        layer = key.removesuffix(EXPERT + "gate_up_proj")
        [gate_up], [gate_up_bias] = state[key], state[key + "_bias"]
        [down], [down_bias] = state[layer + EXPERT + "down_proj"], \
            state[layer + EXPERT + "down_proj_bias"]
        for name, weight, bias in (("gate", gate_up[:, ::2], gate_up_bias[::2]),
                                   ("up", gate_up[:, 1::2], gate_up_bias[1::2]),
                                   ("down", down, down_bias)):
            out[f"{layer}mlp.{name}_proj.weight"] = weight.t().contiguous()
            out[f"{layer}mlp.{name}_proj.bias"] = bias.contiguous()
    return out


def save_gpt_oss_dense(out: str | Path) -> str:
    """Build the dense gpt-oss oracle and save it into ``out`` as vLLM's
    GptOssDenseForCausalLM loads it (config.json of model type gpt_oss, one safetensors file)."""
    from safetensors.torch import save_file

    model = build_gpt_oss_dense()
    Path(out).mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    path = Path(out) / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "architectures": [GPT_OSS_DENSE_ARCHITECTURE],
                                "dtype": "bfloat16"}, indent=1))
    save_file(dense_state(model.state_dict()), str(Path(out) / "model.safetensors"),
              metadata={"format": "pt"})
    return str(out)


def load_gpt_oss_dense(folder: str | Path) -> Any:
    """The saved dense gpt-oss oracle as transformers' GptOssForCausalLM (bf16 weights, the
    dense MLP put back as its one expert, the router's one choice at weight 1)."""
    import torch
    from safetensors.torch import load_file
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig.from_pretrained(folder)
    state = load_file(str(Path(folder) / "model.safetensors"))
    model = GptOssForCausalLM(config).to(torch.bfloat16).eval()
    full = {k: v for k, v in state.items() if ".mlp." not in k}
    for i in range(config.num_hidden_layers):
        mlp = f"model.layers.{i}.mlp."
        gate, up, down = (state[f"{mlp}{p}_proj.weight"].t() for p in ("gate", "up", "down"))
        gate_bias, up_bias, down_bias = (state[f"{mlp}{p}_proj.bias"]
                                         for p in ("gate", "up", "down"))
        # Columns interleaved again: gate, up, gate, up...
        full[mlp + "experts.gate_up_proj"] = torch.stack([gate, up], -1).flatten(-2)[None]
        full[mlp + "experts.gate_up_proj_bias"] = torch.stack([gate_bias, up_bias], -1) \
            .flatten()[None]
        full[mlp + "experts.down_proj"] = down[None]
        full[mlp + "experts.down_proj_bias"] = down_bias[None]
        router = model.model.layers[i].mlp.router  # one expert: chosen with weight 1 whatever
        full[mlp + "router.weight"] = torch.zeros_like(router.weight)
        full[mlp + "router.bias"] = torch.zeros_like(router.bias)
    model.load_state_dict(full, strict=True)
    return model


# The Gemma 3 oracle: Gemma 3's text stack at a small size (five 512-token sliding-window layers
# to one full-attention layer, QK-norm, pre- and post-norms, two RoPE bases) with the same
# sharpening. Its QK-norm normalises q and k after their projections, so the logits are spread
# through q_norm's weight instead (Gemma's RMSNorm multiplies by 1 + weight).
GEMMA3_CONFIG: dict[str, Any] = {
    "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
    "query_pre_attn_scalar": 128, "sliding_window": WINDOW, "vocab_size": 32000,
    "max_position_embeddings": 16384, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
GEMMA3_Q_NORM = 1.8  # q_norm's 1 + weight: logits spread with a standard deviation of ~1.8
# Its head spreads the logits half as far as the other oracles' (and its offset is smaller, to
# keep the top logit near 1): run wholly in bf16, as vLLM runs it, this six-layer stack with
# post-norms carries two correct attention kernels' rounding into the logprobs further than the
# Llama oracle does (with LM_HEAD_SCALE, 0.024 mean |Δlogprob| between two bf16 tilings on the
# CPU, FLASH_ATTN against TRITON_ATTN 0.023 on an H100: beyond the engine rule's 0.02).
GEMMA3_HEAD_SCALE, GEMMA3_OFFSET_WEIGHT = LM_HEAD_SCALE / 2, 13.2


def build_gemma3() -> Any:
    """The Gemma 3 oracle in bfloat16 (seeded), as transformers' Gemma3ForCausalLM."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(SEED)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3_CONFIG)).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(GEMMA3_Q_NORM - 1)
            # Nothing writes hidden dimension 0 (the post-norms keep a 0 there).
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
    return _offset_logits(model, GEMMA3_HEAD_SCALE, GEMMA3_OFFSET_WEIGHT)


def save_gemma3(out: str | Path) -> str:
    """Build the Gemma 3 oracle and save it into ``out`` as vLLM loads it."""
    build_gemma3().save_pretrained(out)
    return str(out)
