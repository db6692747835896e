"""Thin subclasses of vLLM's FlashAttention backend classes: cascade in vLLM's default backend.

Imported only in vLLM workers, when the Attention layers resolve the FLASH_ATTN backend path that
:func:`vllm_cascade_plugin.register` put in vLLM's registry. A step without a plan is vLLM's own:
the builder returns vLLM's metadata and the impl runs vLLM's forward, and the builder keeps vLLM's
CUDA-graph support level (``ALWAYS`` with FA3: FULL graphs for every flat batch). A cascade step
runs the FA3 executor on the same paged KV cache; it needs FlashAttention 3 (Hopper), where vLLM
picks this backend by default. vLLM's flat FlashAttention metadata is built on every step, cascade
or not: it reads no host copy of device data (unlike FlashInfer's, see
:mod:`.flashinfer_backend`), and it is what a layer that falls back runs with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from typing_extensions import override
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)

from .. import stats
from ..config import CascadeConfig
from ..planning.cost import CostModel, cost_model_for, flash_attn_flat
from ..step import StepPlan
from . import compat, hooks
from .builder import (
    CascadeBuilder,
    CascadeImpl,
    KernelArgs,
    kv_dtype,
    layer_impls,
    unsupported_reason,
    usable_scale,
)

__all__ = ["CascadeFlashAttentionBackend", "CascadeFlashAttentionImpl",
           "CascadeFlashAttentionMetadata", "CascadeFlashAttentionMetadataBuilder"]


@dataclass
class CascadeFlashAttentionMetadata(FlashAttentionMetadata):
    """vLLM's FlashAttention metadata of the step (every field as vLLM built it) plus the
    planned executor."""

    cascade: Any = None  # the FA3 executor, planned for this step
    cascade_max_page: int = -1  # largest block id the plan reads
    cascade_rows: int = 0  # query rows the executor runs (a graphed decode step: padded)


def flash_attn_reason(vllm_config: Any, kv_cache_spec: Any, impls: list[Any],
                      layer_names: list[str] | None = None) -> str | None:
    """Why cascade cannot serve these FlashAttention layers, or None."""
    if not impls:
        return "no attention layers with an impl"
    if not all(usable_scale(getattr(i, "scale", None)) for i in impls):
        # vLLM's FlashAttention takes the scale as given (the flat path stays vLLM's own).
        return "a layer without a usable softmax scale"
    return unsupported_reason(vllm_config, kv_cache_spec, impls, layer_names)


class CascadeFlashAttentionMetadataBuilder(CascadeBuilder, FlashAttentionMetadataBuilder):
    """vLLM's FlashAttention metadata every step; on cascade steps the FA3 executor, planned."""

    backend_name: ClassVar[str] = "FLASH_ATTN"
    default_kernel: ClassVar[str] = "fa3"

    @override
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        impls = [i for i in layer_impls(vllm_config, layer_names).values() if i is not None]
        first = impls[0] if impls else None
        window = getattr(kv_cache_spec, "sliding_window", None)
        args = KernelArgs(
            num_qo_heads=int(getattr(first, "num_heads", self.num_heads_q)),
            num_kv_heads=int(getattr(first, "num_kv_heads", self.num_heads_kv)),
            head_dim=int(getattr(first, "head_size", self.headdim)),
            page_size=int(kv_cache_spec.block_size),
            sm_scale=float(getattr(first, "scale", 1.0)),
            # vLLM's FlashAttention impl keeps "no soft-cap" as 0.
            logits_soft_cap=float(getattr(first, "logits_soft_cap", 0) or 0) or None,
            # An FP8 cache: its query arrives FP8 (the layer quantises it) or 16-bit (FA4's
            # SM90 path in 0.33); the executor takes either, and this is the output's dtype.
            q_dtype=vllm_config.model_config.dtype, kv_dtype=kv_dtype(vllm_config, kv_cache_spec),
            window_left=-1 if window is None else int(window) - 1)
        self._setup_cascade(kv_cache_spec, layer_names, vllm_config, args,
                            flash_attn_reason(vllm_config, kv_cache_spec, impls, layer_names))

    def _choose_cascade_kernel(self, requested: str) -> tuple[str | None, str]:
        if requested == "flashinfer":
            return None, ("CASCADE_KERNEL=flashinfer: the FLASH_ATTN backend's cascade runs on "
                          "FlashAttention 3 only (FlashInfer's kernels: --attention-backend "
                          "FLASHINFER)")
        from ..execution import kernels

        # The views the executor reads are FlashAttention's own, in NHD index order whatever
        # the cache's memory layout (compat.flash_attn_kv_cache_views).
        reason = kernels.fa3_unsupported_reason("NHD")
        if reason is not None:
            return None, f"the FLASH_ATTN backend's cascade needs FlashAttention 3: {reason}"
        return "fa3", f"cascade kernels: FlashAttention 3 (CASCADE_KERNEL={requested})"

    def _new_cascade_executor(self, config: CascadeConfig) -> Any:
        from ..execution import kernels

        return kernels.make_executor("fa3", None, "NHD", max_levels=config.max_levels,  # type: ignore[arg-type]
                                     fused_decode=config.fused_decode,
                                     cuda_graphs=self._cuda_graphs)

    def _cost_models(self, kernel: str, graphs: bool, full: bool) -> tuple[CostModel, CostModel]:
        # The flat side is FlashAttention 3 here (cost.flash_attn_flat).
        eager, steady = super()._cost_models(kernel, graphs, full)
        return flash_attn_flat(eager), flash_attn_flat(steady)

    def _split_cost_model(self, graphs: bool, args: KernelArgs) -> CostModel | None:
        # Mixed steps split where the decode rows' cascade replays its per-layer graphs: the
        # FA3 executor with fused decode and CUDA graphs, on a 16-bit cache (fa3_split).
        if self._cascade_kernel != "fa3" or not graphs or args.kv_dtype != args.q_dtype:
            return None
        return flash_attn_flat(cost_model_for("fa3", split=True))

    @override
    def build(self, *args: Any, **kwargs: Any) -> FlashAttentionMetadata:
        common_prefix_len, cm, fast_build = compat.build_arguments(args, kwargs)
        metadata = compat.call_build(super().build, cm, fast_build, common_prefix_len)
        step = self._cascade_step(cm, fast_build)
        if step is None:
            return metadata
        if metadata.causal is not True or getattr(metadata, "mm_prefix_range_tensor", None) \
                is not None or getattr(metadata, "mm_prefix_query_range_tensor", None) is not None:
            stats.record_fallback("batch not causal throughout")
            return metadata
        cascade = self._cascade_fields(step, metadata)
        if cascade is None:
            return metadata
        values = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)
                  if f.init}
        return CascadeFlashAttentionMetadata(**values, **cascade)

    def _split_rows(self, step: StepPlan, metadata: Any) -> Any:
        from ..execution.fa3_split import flat_rows

        assert step.decode_rows is not None
        return flat_rows(metadata.query_start_loc, metadata.block_table, metadata.max_query_len,
                         metadata.max_seq_len, step.query_start_loc, step.seq_lens,
                         step.decode_rows, self.device)

    @override
    def update_block_table(self, metadata: Any, blk_table: Any, slot_mapping: Any) -> Any:
        # vLLM copies one KV-cache group's metadata for another with that group's block table:
        # a plan is for the first group's block ids only.
        new = super().update_block_table(metadata, blk_table, slot_mapping)
        if isinstance(new, CascadeFlashAttentionMetadata) and new.cascade is not None:
            new.cascade = None
        return new


class CascadeFlashAttentionImpl(CascadeImpl, FlashAttentionImpl):
    """vLLM's FlashAttention impl that runs a cascade step's executor when it has one."""

    @override
    def forward(self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                attn_metadata: Any, output: Any, output_scale: Any = None,
                output_block_scale: Any = None) -> Any:
        if self._run_cascade(layer, query, kv_cache, attn_metadata, output, output_scale,
                             output_block_scale):
            return output
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def _make_kv_views(self, kv_cache: Any, attn_metadata: Any) -> tuple[Any, Any]:
        return compat.flash_attn_kv_cache_views(kv_cache, self.head_size)


class CascadeFlashAttentionBackend(FlashAttentionBackend):
    """Registered over ``AttentionBackendEnum.FLASH_ATTN``; keeps the name ``FLASH_ATTN``."""

    @staticmethod
    @override
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return CascadeFlashAttentionImpl

    @staticmethod
    @override
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return CascadeFlashAttentionMetadataBuilder


hooks.install()
