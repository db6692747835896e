"""Tests and benchmarks only: gpt-oss's attention stack with a dense MLP per layer, as a vLLM
model.

vLLM's own gpt-oss (``vllm.model_executor.models.gpt_oss``) routes every layer's MLP through
its fused-MoE kernels (``torch.ops._moe_C``), which some vLLM builds lack (the GPU validation
machine's). :class:`GptOssDenseForCausalLM` is vLLM's GptOssForCausalLM with that block
replaced: the attention (``OAIAttention``: sinks, a 128-token window on the even layers, YaRN
RoPE, q/k/v/o biases; layer names ``model.layers.N.attn.attn``), the norms, the embedding, the
head and the logits processor are vLLM's, through the subclass hooks vLLM gives them
(``TransformerBlock.mlp_cls``, ``GptOssModel.block_cls``). The MLP is gpt-oss's expert
computed densely: ``down((up + 1) * glu(gate))`` with gpt-oss's clamped SwiGLU, in torch.

It reads the checkpoint ``tests/oracle_model.py`` writes (``save_gpt_oss_dense``): gpt-oss's
tensor names for the attention, the norms, the embedding and the head, and
``mlp.{gate,up,down}_proj.{weight,bias}`` for each layer's MLP. Every checkpoint tensor must
name a parameter and every parameter must be loaded (a mismatch fails the load).
``sitecustomize.py`` beside this module registers it with vLLM's ``ModelRegistry``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM, GptOssModel, TransformerBlock
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

# Checkpoint name -> vLLM's parameter: q/k/v into qkv_proj, gate/up into gate_up_proj.
STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
           (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
           (".gate_up_proj", ".up_proj", 1))


class DenseMLP(nn.Module):
    """gpt-oss's expert as one dense MLP: gate and up projections (one merged linear), the
    clamped SwiGLU (float32), the down projection; biases on all three."""

    def __init__(self, vllm_config: VllmConfig, layer_idx: int, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.limit = float(getattr(config, "swiglu_limit", 7.0))
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=True,
            quant_config=vllm_config.quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=True,
            quant_config=vllm_config.quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.float().chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        out, _ = self.down_proj(((up + 1) * gate * torch.sigmoid(gate * self.alpha)).to(x.dtype))
        return out


class DenseBlock(TransformerBlock):
    mlp_cls = DenseMLP


class GptOssDenseModel(GptOssModel):
    block_cls = DenseBlock

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            for param_name, shard_name, shard in STACKED:
                if shard_name in name:
                    name = name.replace(shard_name, param_name)
                    param = params[name]
                    param.weight_loader(param, weight, shard)
                    break
            else:
                param = params[name]  # a tensor the model has no parameter for: KeyError
                if name.endswith(".sinks"):  # one per head: this rank's heads
                    weight = weight.narrow(0, get_tensor_model_parallel_rank() * len(param),
                                           len(param))
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
            loaded.add(name)
        return loaded


class GptOssDenseForCausalLM(GptOssForCausalLM):
    """vLLM's GptOssForCausalLM (its forward, logits and interfaces) around
    :class:`GptOssDenseModel`."""

    is_3d_moe_weight: ClassVar[bool] = False
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_substr={".self_attn.": ".attn."},
        orig_to_new_suffix={".embed_tokens.weight": ".embedding.weight"})

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        # GptOssForCausalLM.__init__'s body with the dense model: calling it would build the
        # MoE model too, and register its attention layers' names a first time.
        nn.Module.__init__(self)
        self.vllm_config = vllm_config
        self.config = vllm_config.model_config.hf_config
        self.model = GptOssDenseModel(vllm_config=vllm_config,
                                      prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(self.config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)
        if missing := {name for name, _ in self.named_parameters()} - loaded:
            raise ValueError(f"parameters the checkpoint does not hold: {sorted(missing)}")
        return loaded
