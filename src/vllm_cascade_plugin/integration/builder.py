"""What the plugin's metadata builders and attention impls share, whichever vLLM backend they
extend (FlashInfer: :mod:`.flashinfer_backend`; FlashAttention: :mod:`.flash_attn_backend`).

A builder registers its layers' settings with the step session once (:class:`CascadeBuilder`),
then on each step takes the session's plan if it was made for exactly its batch and plans the
executor with it; an impl runs that executor instead of vLLM's kernel (:class:`CascadeImpl`).
Everything else is the vLLM parent's. Imported only in vLLM workers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

from .. import stats
from ..config import CascadeConfig, load_config
from ..execution.common import STAGING
from ..planning.cost import AttentionShape, CostModel, cost_model_for
from ..step import BuilderSettings, StepPlan, session
from . import compat, hooks_step, support
from .hooks_graphs import full_graphs_reason

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


def layer_impls(vllm_config: Any, layer_names: list[str]) -> dict[str, Any]:
    """The impl of each of ``layer_names``' attention layers (None where a layer has none)."""
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)  # type: ignore[type-abstract]
    return {name: getattr(layer, "impl", None) for name, layer in layers.items()}


def check_scales(vllm_config: Any, layer_names: list[str]) -> None:
    """Warn once per layer whose impl had no usable ``scale``; make sure it has the default."""
    for name, impl in layer_impls(vllm_config, layer_names).items():
        if impl is None:
            continue
        given = getattr(impl, "cascade_scale_given", getattr(impl, "scale", None))
        if usable_scale(given) and usable_scale(getattr(impl, "scale", None)):
            continue
        impl.scale = default_scale(int(getattr(impl, "head_size", 0)))
        if name not in _scale_warned:
            _scale_warned.add(name)
            logger.warning(
                "vllm-cascade-plugin: attention layer %s has no usable softmax scale (got %r); "
                "using head_dim ** -0.5 = %.6g (head_dim=%d).", name, given, impl.scale,
                int(getattr(impl, "head_size", 0)))


def fp8_kv(vllm_config: Any, kv_cache_spec: Any) -> bool:
    """Whether this KV-cache group stores vLLM's FP8 e4m3 (as bytes: uint8) under
    ``CASCADE_FP8_KV``; a group vLLM leaves unquantised (``kv_cache_dtype_skip_layers``) is
    not."""
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    return (load_config().fp8_kv and cache_dtype in support.FP8_KV
            and kv_cache_spec.dtype in (torch.uint8, torch.float8_e4m3fn))


def kv_dtype(vllm_config: Any, kv_cache_spec: Any) -> Any:
    """The dtype the executors read the cache as: e4m3 for an FP8 group, else the spec's."""
    return torch.float8_e4m3fn if fp8_kv(vllm_config, kv_cache_spec) else kv_cache_spec.dtype


def fp8_layer_reason(vllm_config: Any, layer_names: list[str]) -> str | None:
    """Why the FP8 cascade cannot serve these layers' scales, or None: it reads one scale per
    layer for each of q, K and V, fixed before serving."""
    if compat.dynamic_kv_scales(vllm_config):
        return ("FP8 KV cache with --calculate-kv-scales: vLLM computes the scales in the first "
                "forward pass; the cascade is set up for fixed scales (from the checkpoint, or "
                "1.0): drop --calculate-kv-scales to run it")
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)  # type: ignore[type-abstract]
    for name, layer in layers.items():
        for scale in ("_q_scale", "_k_scale", "_v_scale"):
            value = getattr(layer, scale, None)
            if value is None or getattr(value, "numel", lambda: 0)() != 1:
                shape = None if value is None else tuple(value.shape)
                return (f"FP8 KV cache with {scale} of shape {shape} on layer {name}: the "
                        "cascade reads per-layer (scalar) scales only; per-head or per-token "
                        "scales are not supported")
            if getattr(layer, f"{scale}_float", None) is None:
                return f"FP8 KV cache: layer {name} keeps no host copy {scale}_float"
    return None


def _reasons(vllm_config: Any, kv_cache_spec: Any, impls: list[Any],
             layer_names: list[str]) -> Iterator[str | None]:
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    config = load_config()
    fp8 = config.fp8_kv
    if not getattr(vllm_config.cache_config, "enable_prefix_caching", True):
        yield support.PREFIX_CACHING_OFF
    speculative = vllm_config.speculative_config
    if speculative is not None:
        yield support.speculative_reason(
            getattr(speculative, "method", None),
            getattr(vllm_config.scheduler_config, "async_scheduling", None), config.unverified)
    yield support.parallel_reason(parallel.tensor_parallel_size, config.unverified)
    yield support.sinks_reason(any(getattr(i, "sinks", None) is not None for i in impls),
                               config.unverified)
    yield support.kv_cache_dtype_reason(getattr(vllm_config.cache_config, "cache_dtype", None),
                                        fp8)
    yield next(filter(None, (support.kv_cache_dtype_reason(getattr(i, "kv_cache_dtype", None),
                                                           fp8) for i in impls)), None)
    if kv_cache_spec.dtype != model.dtype and not fp8_kv(vllm_config, kv_cache_spec):
        yield f"quantised KV cache ({kv_cache_spec.dtype})"
    for applies, reason in (
        (getattr(parallel, "decode_context_parallel_size", 1) > 1, "decode context parallelism"),
        (getattr(parallel, "prefill_context_parallel_size", 1) > 1,
         "prefill context parallelism"),
        (parallel.pipeline_parallel_size > 1, "pipeline parallelism"),
        # Metadata is built per microbatch, so a step plan never matches it.
        (getattr(parallel, "use_ubatching", False), "microbatching (dual-batch overlap)"),
        (getattr(model, "is_encoder_decoder", False), "encoder-decoder model"),
        (getattr(model, "is_mm_prefix_lm", False),
         "bidirectional attention over multimodal prefixes"),
        (getattr(model, "rswa_window", None) is not None, "reference sliding-window attention"),
        (compat.batch_invariant(), "batch-invariant mode (VLLM_BATCH_INVARIANT)"),
        # AttentionType is a str enum: equal to its value.
        (any(getattr(i, "attn_type", "decoder") != "decoder" for i in impls),
         "attention other than decoder self-attention"),
        (any(getattr(i, "sliding_window", (-1, -1)) not in ((-1, -1), None) for i in impls),
         "sliding-window attention"),
        (any(getattr(i, "alibi_slopes", None) is not None for i in impls), "ALiBi"),
        (len({getattr(i, "logits_soft_cap", None) for i in impls}) > 1,
         "layers with different logit soft-caps"),
        (len({getattr(i, "scale", None) for i in impls}) > 1, "layers with different scales"),
        (len({getattr(i, "num_heads", None) for i in impls}) > 1,
         "layers with different head counts"),
    ):
        if applies:
            yield reason
    if fp8_kv(vllm_config, kv_cache_spec):
        yield fp8_layer_reason(vllm_config, layer_names)


def unsupported_reason(vllm_config: Any, kv_cache_spec: Any, impls: list[Any],
                       layer_names: list[str] | None = None) -> str | None:
    """Why cascade cannot serve these layers in this engine configuration, or None."""
    return next(filter(None, _reasons(vllm_config, kv_cache_spec, impls, layer_names or [])),
                None)


@dataclass(frozen=True)
class KernelArgs:
    """What the executor's ``plan`` needs of a builder's layers (see ``kernels``)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float
    logits_soft_cap: float | None
    q_dtype: Any
    kv_dtype: Any
    window_left: int = -1  # the layers' sliding window (-1: none)


class CascadeBuilder:
    """Mixed into a vLLM metadata builder, before the vLLM class: the plugin's part of it.

    The subclass calls :meth:`_setup_cascade` at the end of its ``__init__`` and asks
    :meth:`_cascade_fields` in ``build()``; it names its backend and says how it picks and makes
    its executor (:meth:`_choose_cascade_kernel`, :meth:`_new_cascade_executor`).
    """

    backend_name: ClassVar[str] = ""
    default_kernel: ClassVar[str] = ""  # the executor kind before (or without) a choice
    device: Any  # the vLLM builder's
    _cascade_executor: Any = None
    _cascade_kernel: str = ""
    _cuda_graphs: bool = False
    _kernel_args: KernelArgs
    _settings: BuilderSettings

    def _choose_cascade_kernel(self, requested: str) -> tuple[str | None, str]:
        """(executor kind, or None where none can run; a line saying which and why)."""
        raise NotImplementedError

    def _new_cascade_executor(self, config: CascadeConfig) -> Any:
        raise NotImplementedError

    def _cost_models(self, kernel: str, graphs: bool, full: bool) -> tuple[CostModel, CostModel]:
        """(eager, steady) calibrations of ``kernel``'s executor for this backend."""
        return (cost_model_for(kernel, decode_graphs=False),
                cost_model_for(kernel, graphs, full))

    def _split_cost_model(self, graphs: bool, args: KernelArgs) -> CostModel | None:
        """The executor's cost of a mixed step run split (its decode rows as cascade, the others
        flat), or None where it does not split mixed steps."""
        return None

    def _setup_cascade(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                       args: KernelArgs, reason: str | None) -> None:
        """Decide whether cascade can serve these layers, with which executor, and register
        them with the step session. Never raises: a failure here keeps the layers flat."""
        self._kernel_args = args
        self._cascade_kernel = self.default_kernel
        config = load_config()
        steady: CostModel | None = None
        layer_graphs: CostModel | None = None
        split: CostModel | None = None
        eager, page_bytes = CostModel(), 0
        capture_sizes: tuple[int, ...] = ()
        try:
            reason = self._pick_kernel(config, args, reason)
            self._cuda_graphs = config.cuda_graphs and compat.vllm_uses_cuda_graphs(vllm_config)
            # FA3 with decode-step graphs: a decode step costs what the graphs make it once its
            # graph layout has been seen (they are captured the first time it runs), the eager
            # cost before that. Whole-step graphs where this engine can use them, else per layer.
            graphs = self._cuda_graphs and config.fused_decode
            full = config.full_graphs and full_graphs_reason(vllm_config) is None
            eager, steady = self._cost_models(self._cascade_kernel, graphs, full)
            if full:  # where the engine turns out to have several KV-cache groups
                layer_graphs = self._cost_models(self._cascade_kernel, graphs, False)[1]
            split = None if reason is not None else self._split_cost_model(graphs, args)
            page_bytes = kv_cache_spec.page_size_bytes * len(layer_names)
            capture_sizes = compat.cudagraph_capture_sizes(vllm_config)
        except Exception as exc:  # never fail the engine's start over the plugin's setup
            reason = f"setting up the cascade failed ({type(exc).__name__}: {exc})"
        shape = AttentionShape(args.num_qo_heads, args.num_kv_heads, args.head_dim,
                               args.kv_dtype.itemsize, num_layers=len(layer_names))
        # This builder's own: another attention group's builder (other layers of the same
        # KV-cache group, e.g. sliding-window ones) may differ in any of them.
        self._settings = BuilderSettings(
            config, shape, args.page_size, reason, cost_model=eager, steady_cost_model=steady,
            capture_sizes=capture_sizes, page_bytes=page_bytes, backend=self.backend_name,
            split_cost_model=split, layer_graphs_cost_model=layer_graphs,
            layers=frozenset(layer_names))
        session.register(layer_names, self._settings)

    def _pick_kernel(self, config: CascadeConfig, args: KernelArgs,
                     reason: str | None) -> str | None:
        """Choose the executor (``_cascade_kernel``) where cascade can serve the layers; the
        reason it cannot, or None."""
        if reason is None:
            from ..execution.kernels import unsupported_reason as kernel_reason

            reason = kernel_reason(args.num_qo_heads, args.num_kv_heads, args.head_dim,
                                   args.q_dtype, args.kv_dtype, window_left=args.window_left)
        if reason is not None or not config.enabled:
            return reason
        kernel, line = self._choose_cascade_kernel(config.kernel)
        if kernel is None:
            return line
        self._cascade_kernel = kernel
        fell_back = config.kernel == "fa3" and kernel != "fa3"
        (logger.warning if fell_back else logger.info)(
            "vllm-cascade-plugin: the %s backend carries cascade attention; %s",
            self.backend_name, line)
        if kernel == "fa3" and args.kv_dtype == torch.float8_e4m3fn \
                and args.q_dtype != torch.bfloat16:
            return (f"FP8 KV cache with a {args.q_dtype} model: FlashAttention 3 writes FP8 "
                    "attention's output in bf16 only")
        if kernel == "fa3" and config.fused_decode:
            self._warm_up_decode_level(args.kv_dtype)
        return None

    def _cascade_step(self, common_attn_metadata: Any, fast_build: bool) -> StepPlan | None:
        """The session's plan if this builder may run it on this batch, else None (flat)."""
        cm = common_attn_metadata
        if fast_build or self._settings.unsupported is not None:
            return None
        step = session.step_for(self._settings, cm.query_start_loc_cpu.numpy(),
                                cm.num_actual_tokens, compat.host_seq_lens(cm))
        if step is None or not hooks_step.runs_as_planned(cm):
            return None
        return step

    def _split_rows(self, step: StepPlan, metadata: Any) -> Any:
        """A mixed step's rows of several query tokens, for an executor that runs them flat
        beside its decode rows' cascade (``execution.fa3_split``), from vLLM's ``metadata``."""
        raise NotImplementedError(f"the {self.backend_name} backend does not split mixed steps")

    def _cascade_fields(self, step: StepPlan, metadata: Any = None) -> dict[str, Any] | None:
        """The cascade fields of this step's metadata (``metadata``: vLLM's, built), the
        executor planned; None: the step runs flat (counted)."""
        args = self._kernel_args
        start, cpu = time.perf_counter(), time.thread_time()
        staged, launched = STAGING.seconds, STAGING.launch_seconds
        try:
            executor = self._executor()
            tokens = step.plan.stats.num_tokens
            split = None if step.decode_rows is None else self._split_rows(step, metadata)
            # A split step's cascade runs its decode rows alone, padded as a decode step of as
            # many rows would be.
            padded = session.padded_tokens if split is None else session.padded(tokens)
            extra = {} if split is None else {"split": split}
            executor.plan(step.plan, num_qo_heads=args.num_qo_heads,
                          num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                          page_size=args.page_size, sm_scale=args.sm_scale,
                          logits_soft_cap=args.logits_soft_cap, q_dtype=args.q_dtype,
                          kv_dtype=args.kv_dtype, device=self.device,
                          padded_rows=padded, graphs=session.graphable(tokens), **extra)
        except Exception as exc:
            stats.record_fallback("kernel planning error", f"{type(exc).__name__}: {exc}")
            return None
        finally:
            stats.record_builder(time.perf_counter() - start, STAGING.seconds - staged,
                                 time.thread_time() - cpu, STAGING.launch_seconds - launched)
        stats.record_cascade(step.plan.stats.pages_flat, step.plan.stats.pages_cascade,
                             step.decode)
        return {"cascade": executor, "cascade_max_page": step.plan.stats.max_page,
                "cascade_rows": executor.rows}

    def _warm_up_decode_level(self, kv_dtype: Any) -> None:
        """Compile the FA3 executor's fused decode kernel now rather than in the first cascade
        decode step (a stall while Triton compiles, which vLLM's JIT monitor warns about)."""
        if torch.device(self.device).type != "cuda":
            return
        args = self._kernel_args
        try:
            from ..execution import decode_level

            if decode_level.unsupported_reason(args.num_qo_heads, args.num_kv_heads,
                                               args.head_dim) is None:
                fp8 = kv_dtype == torch.float8_e4m3fn
                decode_level.warm_up(args.num_qo_heads, args.num_kv_heads, args.head_dim,
                                     args.page_size, args.q_dtype if fp8 else kv_dtype,
                                     torch.device(self.device),
                                     softcap=args.logits_soft_cap or 0.0,
                                     kv_dtype=kv_dtype if fp8 else None)
        except Exception as exc:  # the first decode step compiles it instead
            logger.warning("vllm-cascade-plugin: compiling the fused decode kernel at startup "
                           "failed (%s: %s); the first cascade decode step compiles it",
                           type(exc).__name__, exc)

    def _executor(self) -> Any:
        if self._cascade_executor is None:
            executor = self._new_cascade_executor(self._settings.config)
            if hasattr(executor, "graph_rows"):  # graphed steps' buffers sized for the largest
                executor.graph_rows = session.largest_graph_rows()
            self._cascade_executor = executor
        return self._cascade_executor


class CascadeImpl:
    """Mixed into a vLLM attention impl, before the vLLM class: runs a cascade step's
    executor (:meth:`_run_cascade`); the subclass says how its backend views the KV cache."""

    head_size: int  # the vLLM impl's
    # (cache identity, K view, V view): the layer's cache is the same tensor every step, and
    # making the views costs more host time than the rest of a graphed layer's Python.
    _cascade_kv_views: tuple[Any, Any, Any] | None = None

    def _make_kv_views(self, kv_cache: Any, attn_metadata: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def _run_cascade(self, layer: Any, query: Any, kv_cache: Any, attn_metadata: Any,
                     output: Any, output_scale: Any, output_block_scale: Any) -> bool:
        """Run the step's executor into ``output``; False: the layer runs vLLM's attention
        (no cascade this step, or a failure, counted). An FP8 cache is read as e4m3 with
        ``layer``'s scales (taken each call: vLLM keeps them on the layer)."""
        executor = getattr(attn_metadata, "cascade", None)
        if executor is None or output_scale is not None or output_block_scale is not None:
            return False
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
                # gpt-oss's attention sinks (vLLM's impl keeps them), where the layer has some.
                sinks = getattr(self, "sinks", None)
                extra = {} if sinks is None else {"sinks": sinks}
                if k_cache.dtype == torch.float8_e4m3fn:
                    from ..execution.common import KvScales

                    extra["scales"] = KvScales.of_layer(layer)
                executor.run(query[:n], k_cache, v_cache, output[:n], **extra)
                return True
        except Exception as exc:  # this layer runs flat; both paths compute the same thing
            stats.record_fallback("kernel error", f"{type(exc).__name__}: {exc}")
        return False

    def _kv_views(self, kv_cache: Any, attn_metadata: Any) -> tuple[Any, Any]:
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(),
               getattr(attn_metadata, "kv_cache_layout", None))
        cached = self._cascade_kv_views
        if cached is None or cached[0] != key:
            k, v = self._make_kv_views(kv_cache, attn_metadata)
            if k.dtype == torch.uint8 and str(getattr(self, "kv_cache_dtype", "")) \
                    in support.FP8_KV:  # vLLM stores FP8 as bytes and reads it as e4m3
                k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
            cached = (key, k, v)
            self._cascade_kv_views = cached
        return cached[1], cached[2]
