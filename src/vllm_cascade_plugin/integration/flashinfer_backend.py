"""Thin subclasses of vLLM's FlashInfer backend classes.

Imported only in vLLM workers, when the Attention layers resolve the FLASHINFER backend path that
:func:`vllm_cascade_plugin.register` put in vLLM's registry. What they share with the
FlashAttention backend's subclasses is in :mod:`.builder`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from typing_extensions import override
from vllm.v1.attention.backends.flashinfer import (
    FlashInferBackend,
    FlashInferImpl,
    FlashInferMetadata,
    FlashInferMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from .. import stats
from ..config import CascadeConfig
from . import compat, hooks
from .builder import (
    CascadeBuilder,
    CascadeImpl,
    KernelArgs,
    check_scales,
    default_scale,
    fp8_kv,
    kv_dtype,
    layer_impls,
    unsupported_reason,
    usable_scale,
)

logger = logging.getLogger("vllm.cascade_plugin")

__all__ = ["CascadeFlashInferBackend", "CascadeFlashInferImpl", "CascadeFlashInferMetadata",
           "CascadeFlashInferMetadataBuilder", "default_scale", "unsupported_reason",
           "usable_scale"]


@dataclass
class CascadeFlashInferMetadata(FlashInferMetadata):
    """vLLM's FlashInfer metadata plus, on cascade steps, the planned executor.

    vLLM's flat plans (its FlashInfer wrappers) are what a layer falls back to. The builder
    defers them to :meth:`flat_metadata` (``flat_build``): building them first reads
    ``seq_lens_cpu``, which on Model Runner V2 is a device-to-host copy that waits for the GPU
    to finish the previous step, and would stall the host every cascade step.
    """

    cascade: Any = None  # a kernels executor (FlashInfer or FA3), planned for this step
    cascade_max_page: int = -1  # largest block id the plan reads
    # Query rows the executor runs: the step's tokens, or vLLM's padded token count for a
    # graphed decode step (whose graphs then serve every batch of that padded size).
    cascade_rows: int = 0
    # vLLM's build() of this step's flat metadata, called on first use; None: this object is it.
    flat_build: Callable[[], FlashInferMetadata] | None = field(default=None, repr=False)
    _flat: FlashInferMetadata | None = field(default=None, init=False, repr=False)

    def flat_metadata(self) -> FlashInferMetadata:
        """This step's metadata for vLLM's flat FlashInfer forward (built once, when needed)."""
        if self.flat_build is None:
            return self
        if self._flat is None:
            self._flat = self.flat_build()
        return self._flat


class CascadeFlashInferMetadataBuilder(CascadeBuilder, FlashInferMetadataBuilder):
    """Builds vLLM's metadata every step and, on cascade steps, plans the cascade executor."""

    backend_name: ClassVar[str] = "FLASHINFER"
    default_kernel: ClassVar[str] = "flashinfer"

    @override
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any):
        check_scales(vllm_config, layer_names)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        impls = [i for i in layer_impls(vllm_config, layer_names).values() if i is not None]
        fp8 = fp8_kv(vllm_config, kv_cache_spec)
        # FP8: the query reaches the impl in the model's dtype (vLLM quantises it inside
        # FlashInfer's forward), except where the layer quantises it (SM100, refused below).
        q_dtype = vllm_config.model_config.dtype if fp8 else self.q_data_type_decode
        args = KernelArgs(self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                          self.sm_scale, self.logits_soft_cap, q_dtype,
                          kv_dtype(vllm_config, kv_cache_spec), window_left=self.window_left)
        reason = unsupported_reason(vllm_config, kv_cache_spec, impls, layer_names)
        if reason is None and fp8 and any(getattr(i, "supports_quant_query_input", False)
                                          for i in impls):
            reason = ("FP8 KV cache with a query the layers quantise to FP8 (FlashInfer's "
                      "TRT-LLM path, SM100): the cascade's FlashInfer levels take a 16-bit "
                      "query only")
        self._setup_cascade(kv_cache_spec, layer_names, vllm_config, args, reason)

    def _choose_cascade_kernel(self, requested: str) -> tuple[str | None, str]:
        try:
            from ..execution.kernels import choose_kernel

            return choose_kernel(requested, compat.flashinfer_kv_layout(self))
        except Exception as exc:  # never fail the engine's start over a kernel choice
            return "flashinfer", (f"cascade kernels: FlashInfer, because choosing them failed "
                                  f"({type(exc).__name__}: {exc}; CASCADE_KERNEL={requested})")

    def _new_cascade_executor(self, config: CascadeConfig) -> Any:
        from ..execution.kernels import make_executor

        return make_executor(self._cascade_kernel, self._get_workspace_buffer(),
                             compat.flashinfer_kv_layout(self), max_levels=config.max_levels,
                             fused_decode=config.fused_decode, cuda_graphs=self._cuda_graphs)

    @override
    def build(self, *args: Any, **kwargs: Any) -> FlashInferMetadata:
        common_prefix_len, cm, fast_build = compat.build_arguments(args, kwargs)
        # vLLM's flat metadata, the fallback of every layer, only if a layer needs it.
        flat_build = functools.partial(compat.call_build, super().build, cm, fast_build,
                                       common_prefix_len)
        # Flat unless this builder's layers can run cascade and the step's plan is for them and
        # for exactly this batch (StepSession.step_for says which, and counts a mismatch).
        step = self._cascade_step(cm, fast_build)
        cascade = None if step is None else self._cascade_fields(step)
        if cascade is None:
            return flat_build()
        try:
            values = self._unplanned_fields(cm)
        except Exception as exc:  # vLLM's build now, as below; the step still runs cascade
            stats.log_once("metadata fields error", "vllm-cascade-plugin: filling in vLLM's "
                           "FlashInfer metadata failed (%s: %s); cascade steps build vLLM's "
                           "flat metadata up front instead (logged once).",
                           type(exc).__name__, exc, level=logging.WARNING)
            values = None
        if values is None:  # a release whose metadata we cannot fill in: vLLM's build now
            metadata = flat_build()
            values = {f.name: getattr(metadata, f.name) for f in fields(metadata)}
            return CascadeFlashInferMetadata(**values, **cascade)
        return CascadeFlashInferMetadata(**values, **cascade, flat_build=flat_build)

    def _unplanned_fields(self, cm: Any) -> dict[str, Any] | None:
        """vLLM's FlashInfer metadata fields for this batch without its flat plans (host data
        only), or None when this release has a required field we do not know."""
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
            split_decodes_and_prefills(cm, decode_threshold=self.reorder_batch_threshold,
                                       require_uniform=True))
        known = {
            "num_actual_tokens": cm.num_actual_tokens, "slot_mapping": cm.slot_mapping,
            "q_data_type_prefill": self.q_data_type_prefill,
            "q_data_type_decode": self.q_data_type_decode, "num_decodes": num_decodes,
            "num_decode_tokens": num_decode_tokens, "num_prefills": num_prefills,
            "num_prefill_tokens": num_prefill_tokens, "causal": getattr(cm, "causal", True),
            "prefill": None, "decode": None, "use_cascade": False, "cascade_wrapper": None,
        }
        # kv_cache_layout: a builder property in the releases whose metadata has the field.
        layout = {"kv_cache_layout": lambda: self.kv_cache_layout}  # type: ignore[attr-defined]
        return compat.dataclass_values(FlashInferMetadata, known, layout)


class CascadeFlashInferImpl(CascadeImpl, FlashInferImpl):
    """FlashInfer attention that runs cascade steps and tolerates a layer without a ``scale``."""

    def __init__(self, num_heads: int, head_size: int, scale: Any, *args: Any, **kwargs: Any):
        # The layer name is unknown here; the builder, which knows it, warns (check_scales).
        self.cascade_scale_given = scale
        if not usable_scale(scale):
            scale = default_scale(head_size)
        super().__init__(num_heads, head_size, scale, *args, **kwargs)

    @override
    def forward(self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                attn_metadata: Any, output: Any, output_scale: Any = None,
                output_block_scale: Any = None) -> Any:
        if self._run_cascade(layer, query, kv_cache, attn_metadata, output, output_scale,
                             output_block_scale):
            return output
        if isinstance(attn_metadata, CascadeFlashInferMetadata):
            attn_metadata = attn_metadata.flat_metadata()
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def _make_kv_views(self, kv_cache: Any, attn_metadata: Any) -> tuple[Any, Any]:
        return compat.kv_cache_views(kv_cache, self.head_size, self, attn_metadata)


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


hooks.install()
