"""Every vLLM and FlashInfer version difference the plugin knows about, in one package (where
vLLM keeps the FlashAttention 3 kernels the FA3 executor runs:
:mod:`~vllm_cascade_plugin.execution.vllm_kernels`): this module, how releases differ inside a
vLLM worker; :mod:`.releases`, which releases the plugin runs on and what their patched methods
read like; :mod:`.sources`, reading parameters from source files.

Import-light at the top (stdlib only): the functions import vLLM and torch lazily. Feature
detection beats version comparison wherever both are possible.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

from . import sources
from .releases import V1_RUNNER_MODULE


def v1_model_runner() -> bool:
    """Whether the installed vLLM has Model Runner V1 (0.26-0.33; 0.34 removed it, and with it
    ``CudagraphDispatcher``): its hooks are installed only then."""
    return sources.module_file(V1_RUNNER_MODULE) is not None


def flashinfer_kv_layout(builder: Any) -> str:
    """FlashInfer's layout string ("NHD"/"HND") of the KV cache a FlashInfer builder serves.

    0.26-0.28: ``get_kv_cache_layout()``; 0.29+: the builder's resolved ``KVCacheLayout`` through
    ``get_flashinfer_layout_string``, which is how vLLM's own builder plans its wrappers.
    """
    from vllm.v1.attention.backends import utils

    if hasattr(utils, "get_flashinfer_layout_string"):
        return str(utils.get_flashinfer_layout_string(builder.kv_cache_layout))
    return str(utils.get_kv_cache_layout())


def kv_cache_views(kv_cache: Any, head_size: int, impl: Any, attn_metadata: Any) -> tuple[Any, Any]:
    """(K, V) views of one layer's packed KV cache, as vLLM's own FlashInfer forward makes them.

    The cache's logical shape is ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` in every
    supported release; a permutation puts it in memory order (NHD: ``[blocks, block_size, heads,
    2 * head_size]``) and the last dim splits into K and V (strided, zero-copy views). Where the
    permutation comes from: the metadata's ``kv_cache_layout`` (0.31+), the impl's
    ``kv_cache_layout`` property (0.29-0.30), ``get_kv_cache_stride_order()`` (0.26-0.28).
    """
    from vllm.utils.torch_utils import canonicalize_singleton_dim_strides

    layout = getattr(attn_metadata, "kv_cache_layout", None) or getattr(
        impl, "kv_cache_layout", None)
    if layout is not None:
        order = layout.layer_view_order
    else:
        from vllm.v1.attention.backends.flashinfer import FlashInferBackend

        order = FlashInferBackend.get_kv_cache_stride_order()
    packed = canonicalize_singleton_dim_strides(kv_cache.permute(*order))
    k, v = packed.split(head_size, dim=-1)
    return k, v


def flash_attn_kv_cache_views(kv_cache: Any, head_size: int) -> tuple[Any, Any]:
    """(K, V) views of one layer's packed KV cache, as vLLM's own FlashAttention forward makes
    them in 0.26-0.33: the logical ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``
    cache transposed to ``[blocks, block_size, heads, 2 * head_size]`` (whatever the memory
    layout: FlashAttention reads strided pages), split into K and V, size-1 dims' strides
    canonicalised (FA3's TMA needs 16-byte aligned strides)."""
    from vllm.utils.torch_utils import canonicalize_singleton_dim_strides

    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return canonicalize_singleton_dim_strides(k), canonicalize_singleton_dim_strides(v)


def build_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, Any, bool]:
    """``(common_prefix_len, common_attn_metadata, fast_build)`` of a call of a metadata
    builder's ``build()``, by position or keyword: ``build(common_prefix_len,
    common_attn_metadata, fast_build=False)`` as 0.26-0.33 call it (0.33 documents
    ``common_prefix_len`` as deprecated and always 0), or ``build(common_attn_metadata,
    fast_build=False)`` as a release without it would. A missing prefix length is 0."""
    named = dict(kwargs)
    prefix = named.pop("common_prefix_len", None)
    metadata = named.pop("common_attn_metadata", None)
    fast = named.pop("fast_build", None)
    if named:
        raise TypeError(f"build() got unexpected keyword arguments {sorted(named)}")
    rest = list(args)
    if prefix is None and rest and isinstance(rest[0], int) and not isinstance(rest[0], bool):
        prefix = rest.pop(0)
    if metadata is None and rest:
        metadata = rest.pop(0)
    if fast is None and rest:
        fast = rest.pop(0)
    if metadata is None or rest:
        raise TypeError(f"build() takes (common_prefix_len, common_attn_metadata, fast_build), "
                        f"got {len(args)} positional and {sorted(kwargs)} keyword arguments")
    return int(prefix or 0), metadata, bool(fast)


@functools.cache
def _build_takes_prefix(build: Callable[..., Any]) -> bool:
    """False only for a ``build`` that names ``common_attn_metadata`` and not
    ``common_prefix_len`` (a wrapper taking ``*args`` is called the 0.26-0.33 way)."""
    parameters = inspect.signature(build).parameters
    return "common_prefix_len" in parameters or "common_attn_metadata" not in parameters


def call_build(build: Callable[..., Any], common_attn_metadata: Any, fast_build: bool,
               common_prefix_len: int = 0) -> Any:
    """Call a vLLM builder's bound ``build`` as its signature takes it: with the deprecated
    ``common_prefix_len`` where it has the parameter (0.26-0.33), else without."""
    if _build_takes_prefix(getattr(build, "__func__", build)):
        return build(common_prefix_len, common_attn_metadata, fast_build)
    return build(common_attn_metadata, fast_build)


def batch_invariant() -> bool:
    """Whether vLLM runs batch-invariant kernels (``VLLM_BATCH_INVARIANT``, 0.26-0.33)."""
    try:
        from vllm import envs

        return bool(getattr(envs, "VLLM_BATCH_INVARIANT", False))
    except Exception:
        return False


def v2_block_ids_written(tables: Any, group: int, block_ids: list[int]) -> list[int]:
    """The ids Model Runner V2's ``BlockTables.append_block_ids`` writes for ``block_ids``.

    0.26-0.31 split each KV block into ``blocks_per_kv_block`` kernel blocks; 0.32+ write the ids
    as given, or the null block 0 while ``redirect_writes_to_null_block`` is set (elastic EP).
    """
    if getattr(tables, "redirect_writes_to_null_block", False):
        return [0] * len(block_ids)
    per_kv_block = getattr(tables, "blocks_per_kv_block", None)
    if per_kv_block is not None and per_kv_block[group] > 1:
        n = per_kv_block[group]
        return [b * n + k for b in block_ids for k in range(n)]
    return list(block_ids)


@functools.cache
def _sort_takes_draft_tokens() -> bool:
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    return "draft_tokens" in inspect.signature(sort_batch_req_ids).parameters


def v2_batch_order(runner: Any, scheduler_output: Any) -> list[str]:
    """A step's request ids in Model Runner V2's batch order, sorted as vLLM sorts them.

    0.28+ take the step's draft tokens too (verification rows first). A step whose every
    request has the decode query length and no draft tokens keeps the scheduler's order (vLLM's
    sort is stable and its key the same for every request: tests/integration/test_hooks.py
    checks this on the installed vLLM), read without sorting.
    """
    so = scheduler_output
    tokens = so.num_scheduled_tokens
    if not getattr(so, "scheduled_spec_decode_tokens", None) and set(tokens.values()) == {
            runner.decode_query_len}:
        return list(tokens)
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    sort: Callable[..., list[str]] = sort_batch_req_ids  # its parameters differ by release
    if _sort_takes_draft_tokens():
        return sort(so.num_scheduled_tokens, so.scheduled_spec_decode_tokens,
                    runner.decode_query_len)
    return sort(so.num_scheduled_tokens, runner.decode_query_len)


def rewritten_req_ids(scheduler_output: Any) -> list[str]:
    """The requests whose block ids the V1 runner writes anew this step: those scheduled new,
    and those resumed from preemption (``resumed_req_ids``, a set in 0.26-0.33); every other
    scheduled request's ids are only appended to."""
    resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
    return [*(req.req_id for req in scheduler_output.scheduled_new_reqs), *resumed]


# Arguments of Model Runner V2's ``CudaGraphManager.dispatch`` through which a batch matches a
# FULL decode graph: ``uniform_token_count`` (0.26+) and ``max_query_len`` (0.28+, varlen decode
# graphs). A cascade step passes None for each one the installed release has.
V2_FULL_GRAPH_ARGUMENTS = ("uniform_token_count", "max_query_len")


def host_seq_lens(common_attn_metadata: Any) -> Any:
    """The batch's sequence lengths (numpy) as vLLM's builders get them, read from host memory
    only, or None where the metadata has none.

    ``seq_lens_cpu_upper_bound`` (0.26-0.33, both model runners): exact, except on the draft
    rows of asynchronous speculative decoding, which the plugin refuses. Else ``_seq_lens_cpu``
    (0.26-0.29, the V1 runner's host copy). Never ``seq_lens_cpu``: up to 0.29 a property that
    copies ``seq_lens`` from the device when no host copy was given (Model Runner V2 gives none),
    which waits for the GPU; gone from 0.30.
    """
    cm = common_attn_metadata
    lens = getattr(cm, "seq_lens_cpu_upper_bound", None)
    if lens is None:
        lens = getattr(cm, "_seq_lens_cpu", None)
    if lens is None:
        return None
    return lens.numpy() if hasattr(lens, "numpy") else lens


def vllm_uses_cuda_graphs(vllm_config: Any) -> bool:
    """Whether this engine runs with CUDA graphs: not ``enforce_eager`` and
    ``compilation_config.cudagraph_mode`` not ``NONE`` (0.26-0.33)."""
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return False
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is None or getattr(mode, "name", str(mode)) != "NONE"


def cudagraph_capture_sizes(vllm_config: Any) -> tuple[int, ...]:
    """The token counts vLLM captures CUDA graphs for and pads a step to, ascending; empty
    without CUDA graphs. A cascade step asks vLLM for a graph without a uniform token count,
    which only the token-keyed graphs match: ``compilation_config.cudagraph_capture_sizes``
    (0.26-0.33); from 0.34 ``prefill_cudagraph_capture_token_sizes`` (what 0.34 resolves for
    every batch that is not a uniform decode batch; ``cudagraph_capture_sizes`` then holds the
    decode graphs' token counts too, which a cascade step never gets)."""
    if not vllm_uses_cuda_graphs(vllm_config):
        return ()
    compilation = vllm_config.compilation_config
    sizes = getattr(compilation, "prefill_cudagraph_capture_token_sizes", None)
    if sizes is None:
        sizes = getattr(compilation, "cudagraph_capture_sizes", None) or ()
    return tuple(sorted(int(size) for size in sizes))


def kv_connector_active(vllm_config: Any) -> bool:
    """Whether this engine runs a KV connector (disaggregated prefill, KV offloading, which
    vLLM turns into a connector): ``kv_transfer_config.is_kv_transfer_instance``, a connector
    named with a role (0.26-0.33), the condition under which vLLM asks the connector whether it
    needs PIECEWISE graphs."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return transfer is not None and bool(getattr(transfer, "is_kv_transfer_instance", False))


def weight_offloading() -> bool:
    """Whether vLLM offloads weights through its global offloader (``cpu_offload_gb`` and the
    prefetch offloader; ``vllm.model_executor.offloader`` in 0.26-0.33), whose streams vLLM syncs
    around its own graph replays. False where the module does not exist (nothing offloads)."""
    try:
        from vllm.model_executor.offloader.base import NoopOffloader, get_offloader
    except ImportError:
        return False
    return not isinstance(get_offloader(), NoopOffloader)


@functools.cache
def _init_fields(cls: type) -> tuple[tuple[str, bool], ...]:
    """(name, required) of each constructor field of the dataclass ``cls``."""
    return tuple((f.name, f.default is MISSING and f.default_factory is MISSING)
                 for f in fields(cls) if f.init)


def dataclass_values(cls: type, known: dict[str, Any],
                     lazy: dict[str, Callable[[], Any]] | None = None) -> dict[str, Any] | None:
    """Constructor arguments of the dataclass ``cls``: each field's value from ``known``, else
    from calling its ``lazy`` getter; None when a field without a default has neither (or its
    getter fails). For vLLM's ``FlashInferMetadata``, whose fields differ between releases
    (``kv_cache_layout`` from 0.31; ``use_cascade`` and ``cascade_wrapper`` only while vLLM had
    cascade attention). Called every cascade step: the field list is read once per class."""
    values: dict[str, Any] = {}
    for name, required in _init_fields(cls):
        if name in known:
            values[name] = known[name]
        elif lazy and name in lazy:
            try:
                values[name] = lazy[name]()
            except Exception:
                return None
        elif required:
            return None
    return values


def dynamic_kv_scales(vllm_config: Any) -> bool:
    """Whether vLLM computes the KV scales in the first forward pass (``--calculate-kv-scales``:
    ``cache_config.calculate_kv_scales`` in 0.26, gone by 0.33, where scales come from the
    checkpoint or are 1.0)."""
    return bool(getattr(vllm_config.cache_config, "calculate_kv_scales", False))


SLIDING = "sliding-window attention"  # what kv_cache_kind calls a sliding-window group
RECURRENT = "recurrent (Mamba)"  # and a Mamba or linear-attention layers' group


def kv_cache_kind(spec: Any) -> str:
    """What a KV-cache group holds, by its spec (``vllm.v1.kv_cache_interface``): "full
    attention", :data:`SLIDING`, :data:`RECURRENT` (Mamba and linear attention: vLLM gives both
    a ``MambaSpec``), or else the spec's class name."""
    from vllm.v1 import kv_cache_interface as kv

    if isinstance(spec, kv.SlidingWindowSpec):
        return SLIDING
    if isinstance(spec, kv.MambaSpec):
        return RECURRENT
    if type(spec) is kv.FullAttentionSpec:
        return "full attention"
    return type(spec).__name__
