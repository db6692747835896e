"""The recurrent-hybrid oracle: a small Mamba2 / attention hybrid whose outputs a one-page KV error
in its attention layers visibly moves.

The architecture is IBM's Granite 4.0-H (``GraniteMoeHybridForCausalLM``, Bamba's successor:
vLLM 0.23 dropped Bamba itself) in its dense form, as Granite 4.0-H Micro: no experts
(``num_local_experts`` 0), a SwiGLU MLP after every mixer, no positional encoding in attention
(``position_embedding_type`` None: the Mamba layers carry the order). Four layers: Mamba2 mixers
0 and 2, full attention 1 and 3. vLLM runs the Mamba2 mixers with Triton kernels
(``model_executor/layers/mamba/mamba_mixer2.py``: ``ops/causal_conv1d.py``, ``ops/ssd_*.py``,
``ops/mamba_ssm.py``'s ``selective_state_update``, ``ops/layernorm_gated.py``) and the MLP and
norms with the compiled ops a Llama already needs (``_C.silu_and_mul``, ``_C.rms_norm``): no
fused-MoE kernel, no ``_C.relu_squared`` (NemotronH's MLP), no ``selective_scan_fwd`` (Mamba1).

Sharpened as the engine oracle (``oracle_model``): ``q_proj`` and ``k_proj`` scaled by
:data:`QK_SCALE`, hidden dimension 0 written by no layer, and the logit offset and spread of
``oracle_model._offset_logits``; two more changes:

* ``o_proj`` scaled by :data:`ATTN_OUT_SCALE`: the two attention layers, not the mixers and MLPs
  around them, decide the tokens, so that a wrong attention page moves the logprobs;
* the final norm's weight at dimension 0 set to :data:`OFFSET_GAIN`: this stack's final hidden
  state is larger than the Llama oracle's, and the shared offset alone would leave the top logit
  near 9 (one bf16 step of a logit in [8, 16) is 0.0625); with it the top logit sits near 3.

The Mamba2 state is sized so that vLLM's attention page, which it enlarges until a page of a
layer holds as many bytes as a layer's Mamba state (rounded up to the Mamba chunk size under
prefix caching), is :data:`PAGE_SIZE` tokens: the engine test's 2K shared prefix is eight pages.
``tests/test_hybrid_model.py`` reads vLLM's layout of the saved model and measures its teeth on
the CPU; ``tests/gpu/conftest.py`` saves it for ``tests/gpu/test_hybrid_engine.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oracle_model import SEED, _offset_logits

MAMBA, ATTENTION = "linear_attention", "full_attention"  # transformers' layer_types
LAYER_TYPES = [MAMBA, ATTENTION, MAMBA, ATTENTION]
HYBRID_CONFIG: dict[str, Any] = {
    "hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,  # head_dim 128
    "num_hidden_layers": len(LAYER_TYPES), "layer_types": LAYER_TYPES,
    "num_local_experts": 0, "shared_intermediate_size": 1024, "intermediate_size": 1024,
    "position_embedding_type": None, "attention_multiplier": 128 ** -0.5,
    "mamba_n_heads": 16, "mamba_d_head": 64, "mamba_d_state": 64, "mamba_n_groups": 1,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
    # transformers' default upper limit is infinity, which config.json cannot hold as a number
    "time_step_limit": (0.0, 1e4),
    "vocab_size": 32000, "max_position_embeddings": 16384, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
ARCHITECTURE = "GraniteMoeHybridForCausalLM"
# A Mamba layer's state: 16 heads x 64 x 64 SSM values and 3 x 1,152 convolution values, bf16:
# 137,984 bytes, 135 tokens of a layer's attention KV (2 x 2 heads x 128 x 2 bytes a token);
# vLLM rounds the page up to the Mamba chunk size (256) under prefix caching ("all" mode).
PAGE_SIZE = 256
QK_SCALE = 3.5
ATTN_OUT_SCALE = 2.0
OFFSET_GAIN = 3.0


def build() -> Any:
    """The hybrid oracle in bfloat16 (seeded), as transformers' GraniteMoeHybridForCausalLM."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(SEED)
    model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**HYBRID_CONFIG)).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.self_attn is not None:
                layer.self_attn.q_proj.weight.mul_(QK_SCALE)
                layer.self_attn.k_proj.weight.mul_(QK_SCALE)
                layer.self_attn.o_proj.weight.mul_(ATTN_OUT_SCALE)
                mixer_out = layer.self_attn.o_proj.weight
            else:
                mixer_out = layer.mamba.out_proj.weight
            # Nothing writes hidden dimension 0: it stays OFFSET_INPUT at every position.
            mixer_out[0] = 0
            layer.shared_mlp.output_linear.weight[0] = 0
        model.model.norm.weight[0] = OFFSET_GAIN
    return _offset_logits(model)


def save(out: str | Path) -> str:
    """Build the hybrid oracle and save it into ``out`` as vLLM loads it."""
    build().save_pretrained(out)
    return str(out)
