"""Thin subclasses of vLLM's FlashInfer backend classes.

Imported only in vLLM workers, when the Attention layers resolve the FLASHINFER backend path that
:func:`vllm_cascade_plugin.register` put in vLLM's registry.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from typing_extensions import override
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backends.flashinfer import (
    FlashInferBackend,
    FlashInferImpl,
    FlashInferMetadata,
    FlashInferMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from . import compat, hooks, stats
from .config import load_config
from .cost import AttentionShape, cost_model_for
from .fullgraph import unsupported_reason as full_graphs_reason
from .step import BuilderSettings, session

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


def unsupported_reason(vllm_config: Any, kv_cache_spec: Any, impls: list[Any]) -> str | None:
    """Why cascade cannot run for this model and engine configuration, or None."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    reasons = (
        (vllm_config.speculative_config is not None, "speculative decoding"),
        (getattr(parallel, "decode_context_parallel_size", 1) > 1, "decode context parallelism"),
        (getattr(parallel, "prefill_context_parallel_size", 1) > 1,
         "prefill context parallelism"),
        (parallel.pipeline_parallel_size > 1, "pipeline parallelism"),
        # Metadata is built per microbatch, so a step plan never matches it.
        (getattr(parallel, "use_ubatching", False), "microbatching (dual-batch overlap)"),
        (getattr(model, "is_encoder_decoder", False), "encoder-decoder model"),
        (kv_cache_spec.dtype != model.dtype, f"quantised KV cache ({kv_cache_spec.dtype})"),
        (any(getattr(i, "kv_cache_dtype", "auto") not in ("auto", "bfloat16", "float16")
             for i in impls), "quantised KV cache"),
        (any(getattr(i, "sliding_window", (-1, -1)) not in ((-1, -1), None) for i in impls),
         "sliding-window attention"),
        (any(getattr(i, "alibi_slopes", None) is not None for i in impls), "ALiBi"),
        (any(getattr(i, "sinks", None) is not None for i in impls), "attention sinks"),
        (len({getattr(i, "logits_soft_cap", None) for i in impls}) > 1,
         "layers with different logit soft-caps"),
        (len({getattr(i, "scale", None) for i in impls}) > 1, "layers with different scales"),
    )
    for applies, reason in reasons:
        if applies:
            return reason
    return None


class CascadeFlashInferMetadataBuilder(FlashInferMetadataBuilder):
    """Builds vLLM's metadata every step and, on cascade steps, plans the cascade executor."""

    @override
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any):
        _check_scales(vllm_config, layer_names)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._cascade_executor: Any = None
        impls = [layer.impl for layer in get_layers_from_vllm_config(
            vllm_config, AttentionLayerBase, layer_names).values()]  # type: ignore[type-abstract]
        reason = unsupported_reason(vllm_config, kv_cache_spec, impls)
        if reason is None:
            from .kernels import unsupported_reason as kernel_reason

            reason = kernel_reason(self.num_qo_heads, self.num_kv_heads, self.head_dim,
                                   self.q_data_type_decode, kv_cache_spec.dtype,
                                   window_left=self.window_left)
        config = load_config()
        self._cuda_graphs = config.cuda_graphs and compat.vllm_uses_cuda_graphs(vllm_config)
        self._cascade_kernel = "flashinfer"
        if reason is None and config.enabled:
            try:
                from .kernels import choose_kernel

                self._cascade_kernel, line = choose_kernel(config.kernel,
                                                           compat.flashinfer_kv_layout(self))
            except Exception as exc:  # never fail the engine's start over a kernel choice
                line = (f"cascade kernels: FlashInfer, because choosing them failed "
                        f"({type(exc).__name__}: {exc}; CASCADE_KERNEL={config.kernel})")
            fell_back = config.kernel == "fa3" and self._cascade_kernel != "fa3"
            (logger.warning if fell_back else logger.info)("vllm-cascade-plugin: %s", line)
            if self._cascade_kernel == "fa3" and config.fused_decode:
                self._warm_up_decode_level(kv_cache_spec.dtype)
        shape = AttentionShape(self.num_qo_heads, self.num_kv_heads, self.head_dim,
                               kv_cache_spec.dtype.itemsize, num_layers=len(layer_names))
        # FA3 with decode-step graphs: a decode step costs what the graphs make it once its graph
        # layout has been seen (the graphs are captured the first time it runs), the eager cost
        # before that. Whole-step graphs where this engine can use them, else one per layer.
        graphs = self._cuda_graphs and config.fused_decode
        full = config.full_graphs and full_graphs_reason(vllm_config) is None
        # This builder's own: another attention group's builder (other layers of the same
        # KV-cache group, e.g. sliding-window ones) may differ in any of them.
        self._settings = BuilderSettings(
            config, shape, self.page_size, reason,
            cost_model=cost_model_for(self._cascade_kernel, decode_graphs=False),
            steady_cost_model=cost_model_for(self._cascade_kernel, graphs, full),
            capture_sizes=compat.cudagraph_capture_sizes(vllm_config),
            page_bytes=kv_cache_spec.page_size_bytes * len(layer_names))
        session.register(layer_names, self._settings)

    @override
    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> FlashInferMetadata:
        cm = common_attn_metadata
        # Flat unless this builder's layers can run cascade and the step's plan is for them and
        # for exactly this batch (StepSession.step_for says which, and counts a mismatch).
        step = None
        if not fast_build and self._settings.unsupported is None:
            step = session.step_for(self._settings, cm.query_start_loc_cpu.numpy(),
                                    cm.num_actual_tokens, compat.host_seq_lens(cm))
        if step is None:
            return super().build(common_prefix_len, cm, fast_build)
        try:
            executor = self._executor()
            executor.plan(step.plan, num_qo_heads=self.num_qo_heads,
                          num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                          page_size=self.page_size, sm_scale=self.sm_scale,
                          logits_soft_cap=self.logits_soft_cap,
                          q_dtype=self.q_data_type_decode, kv_dtype=self.kv_cache_spec.dtype,
                          device=self.device, padded_rows=session.padded_tokens)
        except Exception as exc:
            stats.record_fallback("kernel planning error", f"{type(exc).__name__}: {exc}")
            return super().build(common_prefix_len, cm, fast_build)
        stats.record_cascade(step.plan.stats.pages_flat, step.plan.stats.pages_cascade,
                             step.decode)
        cascade = {"cascade": executor, "cascade_max_page": step.plan.stats.max_page,
                   "cascade_rows": executor.rows}
        # vLLM's flat metadata, the fallback of every layer, only if a layer needs it.
        flat_build = functools.partial(super().build, common_prefix_len, cm, fast_build)
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

    def _warm_up_decode_level(self, kv_dtype: Any) -> None:
        """Compile the FA3 executor's fused decode kernel now rather than in the first cascade
        decode step (a stall while Triton compiles, which vLLM's JIT monitor warns about)."""
        import torch

        if torch.device(self.device).type != "cuda":
            return
        try:
            from . import decode_level

            if decode_level.unsupported_reason(self.num_qo_heads, self.num_kv_heads,
                                               self.head_dim) is None:
                decode_level.warm_up(self.num_qo_heads, self.num_kv_heads, self.head_dim,
                                     self.page_size, kv_dtype, torch.device(self.device),
                                     softcap=self.logits_soft_cap or 0.0)
        except Exception as exc:  # the first decode step compiles it instead
            logger.warning("vllm-cascade-plugin: compiling the fused decode kernel at startup "
                           "failed (%s: %s); the first cascade decode step compiles it",
                           type(exc).__name__, exc)

    def _executor(self) -> Any:
        if self._cascade_executor is None:
            from .kernels import make_executor

            config = self._settings.config
            self._cascade_executor = make_executor(
                self._cascade_kernel, self._get_workspace_buffer(),
                compat.flashinfer_kv_layout(self), max_levels=config.max_levels,
                fused_decode=config.fused_decode, cuda_graphs=self._cuda_graphs)
        return self._cascade_executor


class CascadeFlashInferImpl(FlashInferImpl):
    """FlashInfer attention that runs cascade steps and tolerates a layer without a ``scale``."""

    def __init__(self, num_heads: int, head_size: int, scale: Any, *args: Any, **kwargs: Any):
        # The layer name is unknown here; the builder, which knows it, warns (see _check_scales).
        self.cascade_scale_given = scale
        if not usable_scale(scale):
            scale = default_scale(head_size)
        super().__init__(num_heads, head_size, scale, *args, **kwargs)
        # (cache identity, K view, V view): the layer's cache is the same tensor every step, and
        # making the views costs more host time than the rest of a graphed layer's Python.
        self._cascade_kv_views: tuple[Any, Any, Any] | None = None

    @override
    def forward(self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                attn_metadata: Any, output: Any, output_scale: Any = None,
                output_block_scale: Any = None) -> Any:
        executor = getattr(attn_metadata, "cascade", None)
        if executor is not None and output_scale is None and output_block_scale is None:
            n = attn_metadata.cascade_rows
            try:
                k_cache, v_cache = self._kv_views(kv_cache, attn_metadata)
                if attn_metadata.cascade_max_page >= k_cache.shape[0]:  # before any kernel reads
                    stats.record_fallback("block id out of range", f"block "
                                          f"{attn_metadata.cascade_max_page} of {k_cache.shape[0]}")
                elif n > query.shape[0] or n > output.shape[0]:
                    stats.record_fallback("padded rows beyond the step's tensors",
                                          f"{n} rows planned, {query.shape[0]} given")
                else:
                    executor.run(query[:n], k_cache, v_cache, output[:n])
                    return output
            except Exception as exc:  # this layer runs flat; both paths compute the same thing
                stats.record_fallback("kernel error", f"{type(exc).__name__}: {exc}")
        if isinstance(attn_metadata, CascadeFlashInferMetadata):
            attn_metadata = attn_metadata.flat_metadata()
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def _kv_views(self, kv_cache: Any, attn_metadata: Any) -> tuple[Any, Any]:
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(),
               getattr(attn_metadata, "kv_cache_layout", None))
        cached = self._cascade_kv_views
        if cached is None or cached[0] != key:
            cached = (key, *compat.kv_cache_views(kv_cache, self.head_size, self,
                                                  attn_metadata))
            self._cascade_kv_views = cached
        return cached[1], cached[2]


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
