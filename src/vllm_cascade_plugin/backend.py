"""Thin subclasses of vLLM's FlashInfer backend classes.

Imported only in vLLM workers, when the Attention layers resolve the FLASHINFER backend path that
:func:`vllm_cascade_plugin.register` put in vLLM's registry.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from typing_extensions import override
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backends.flashinfer import (
    FlashInferBackend,
    FlashInferImpl,
    FlashInferMetadataBuilder,
)

logger = logging.getLogger("vllm.cascade_plugin")

_scale_warned: set[str] = set()


def usable_scale(scale: Any) -> bool:
    """A softmax scale we can hand to a kernel: a finite, positive real number."""
    if isinstance(scale, bool):
        return False
    try:
        value = float(scale)
    except (TypeError, ValueError):
        return False
    return math.isfinite(value) and value > 0


def default_scale(head_size: int) -> float:
    return float(head_size) ** -0.5


class CascadeFlashInferImpl(FlashInferImpl):
    """FlashInfer attention that tolerates a model layer without a usable ``scale``."""

    def __init__(self, num_heads: int, head_size: int, scale: Any, *args: Any, **kwargs: Any):
        # The layer name is unknown here; the builder, which knows it, warns (see _check_scales).
        self.cascade_scale_given = scale
        if not usable_scale(scale):
            scale = default_scale(head_size)
        super().__init__(num_heads, head_size, scale, *args, **kwargs)


def _check_scales(vllm_config: Any, layer_names: list[str]) -> None:
    """Warn once per layer whose impl had no usable ``scale``; make sure it has the default."""
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)  # type: ignore[type-abstract]
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        if impl is None:
            continue
        given = getattr(impl, "cascade_scale_given", getattr(impl, "scale", None))
        if usable_scale(given) and usable_scale(getattr(impl, "scale", None)):
            continue
        head_size = int(getattr(impl, "head_size", getattr(layer, "head_size", 0)))
        impl.scale = default_scale(head_size)
        if name not in _scale_warned:
            _scale_warned.add(name)
            logger.warning(
                "vllm-cascade-plugin: attention layer %s has no usable softmax scale (got %r); "
                "using head_dim ** -0.5 = %.6g (head_dim=%d).", name, given, impl.scale, head_size)


class CascadeFlashInferMetadataBuilder(FlashInferMetadataBuilder):
    @override
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any):
        _check_scales(vllm_config, layer_names)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)


class CascadeFlashInferBackend(FlashInferBackend):
    """Registered over ``AttentionBackendEnum.FLASHINFER``; keeps the name ``FLASHINFER``."""

    @staticmethod
    @override
    def get_impl_cls() -> type[FlashInferImpl]:
        return CascadeFlashInferImpl

    @staticmethod
    @override
    def get_builder_cls() -> type[FlashInferMetadataBuilder]:
        return CascadeFlashInferMetadataBuilder
