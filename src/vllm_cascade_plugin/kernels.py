"""GPU executors of a :class:`~vllm_cascade_plugin.planner.CascadePlan`.

Two executors with one interface (``plan`` once per engine step on the host, ``run`` per layer,
neither reads anything back from the GPU):

- :class:`FlashInferCascadeExecutor`: one FlashInfer ``BatchPrefillWithPagedKVCacheWrapper`` per
  level (planned on the host), states merged with ``flashinfer.merge_state_in_place`` (base-2
  LSE). Runs wherever vLLM's FlashInfer backend runs.
- :class:`FlashAttnCascadeExecutor`: vLLM's bundled FlashAttention 3 (``flash_attn_varlen_func``
  with a block table per level, as vLLM's own FLASH_ATTN backend and its pre-0.32 cascade call
  it), states merged with vLLM's ``merge_attn_states`` (natural-log LSE). Hopper only, NHD cache
  layout; planning is numpy and one upload, no FlashInfer plan.

:func:`make_executor` picks one (``CASCADE_KERNEL``). Only vLLM workers import this module (it
imports torch and flashinfer at the top).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flashinfer
import numpy as np
import torch

from vllm_cascade_plugin import compat, decode_level
from vllm_cascade_plugin.graphs import GraphCache
from vllm_cascade_plugin.planner import CascadeLevel, CascadePlan

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# merge_state_in_place launches blockDim = (head_dim / vec, num_qo_heads); CUDA allows 1024.
MAX_MERGE_THREADS = 1024


def unsupported_reason(
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    *,
    window_left: int = -1,
) -> str | None:
    """Why the executor cannot run this attention configuration, or None when it can.

    The caller falls back to flat attention on a reason instead of crashing in a kernel launch
    or, worse, computing wrong values silently.
    """
    if head_dim not in SUPPORTED_HEAD_DIMS:
        # FA2 prefill misbehaves for other sizes (FlashInfer #4299); FA3 compiles only these.
        return f"head_dim {head_dim} not in {SUPPORTED_HEAD_DIMS}"
    if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
        return f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    if q_dtype not in SUPPORTED_DTYPES:
        return f"query dtype {q_dtype} not in {SUPPORTED_DTYPES} (merge kernel)"
    if kv_dtype != q_dtype:
        # run() applies no k/v scales, so a quantized cache would be read unscaled.
        return f"KV cache dtype {kv_dtype} differs from query dtype {q_dtype}"
    vec = max(16 // q_dtype.itemsize, head_dim // 32)
    threads = num_qo_heads * head_dim // vec
    if threads > MAX_MERGE_THREADS:
        return f"merge kernel needs {threads} threads per block (> {MAX_MERGE_THREADS})"
    if window_left >= 0:
        # The sliding-window mask is evaluated per level segment, so cascade would be wrong.
        return "sliding-window attention"
    return None


def _check_plan(plan: CascadePlan, page_size: int, max_levels: int) -> None:
    if plan.page_size != page_size:
        raise ValueError(f"plan page size {plan.page_size} != cache page size {page_size}")
    if not 1 <= plan.num_levels <= max_levels:
        raise ValueError(f"plan has {plan.num_levels} levels; 1..{max_levels} supported")
    last = plan.levels[-1]
    if not (last.causal and last.q_is_identity):
        raise ValueError("the last level must be causal and cover the queries in step order")
    if any(level.causal for level in plan.levels[:-1]):
        raise ValueError("shared levels must not be causal")


def _pinned(array: np.ndarray, dtype: type[np.integer]) -> torch.Tensor:
    # Host tensors keep FlashInfer's plan free of device->host copies; pinned ones make the
    # non_blocking uploads (FlashInfer's and ours) truly asynchronous, and torch's pinned-memory
    # allocator does not reuse a block before its copy has run. np.require copies only when
    # needed: from_numpy warns on read-only arrays, and the planner may freeze its output.
    return torch.from_numpy(np.require(array, dtype, ("C", "W"))).pin_memory()


def _upload(array: np.ndarray, dtype: type[np.integer], device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` without waiting: pinned and non-blocking for a GPU."""
    if device.type == "cpu":  # the CPU tests of the FA3 executor
        return torch.from_numpy(np.array(array, dtype))
    return _pinned(array, dtype).to(device, non_blocking=True)


def _device_index(q_index: np.ndarray, device: torch.device) -> torch.Tensor:
    # int64: index_copy_ accepts no other index dtype.
    return _pinned(q_index, np.int64).to(device, non_blocking=True)


@dataclass(frozen=True)
class _Gather:
    """Device index and scratch views of a level whose queries are a reordered subset."""

    index: torch.Tensor  # int64 [n_q]: the level's rows in ``q``/``out``
    q: torch.Tensor  # [n_q, num_qo_heads, head_dim]: gathered queries
    out: torch.Tensor  # [n_q, num_qo_heads, head_dim]: gathered output rows, merged in place
    lse: torch.Tensor  # float32 [n_q, num_qo_heads]: gathered base-2 LSE rows, merged in place


@dataclass(frozen=True)
class _SharedLevel:
    wrapper: flashinfer.BatchPrefillWithPagedKVCacheWrapper
    out: torch.Tensor  # scratch [n_q, num_qo_heads, head_dim]: this level's partial output
    lse: torch.Tensor  # scratch float32 [n_q, num_qo_heads]: its base-2 LSE
    gather: _Gather | None  # None when the level reads ``q`` as it is (q_is_identity)


@dataclass(frozen=True)
class _Step:
    last: flashinfer.BatchPrefillWithPagedKVCacheWrapper  # the causal per-request level
    shared: tuple[_SharedLevel, ...]
    lse: torch.Tensor  # float32 [num_tokens, num_qo_heads], base 2: the running merged LSE


def _same_device(have: torch.device, want: torch.device) -> bool:
    """``cuda:0`` is ``cuda`` when device 0 is the current one (``!=`` says they differ)."""
    if have.type != want.type:
        return False
    if want.index is None and want.type == "cuda":
        return have.index == torch.cuda.current_device()
    return want.index is None or have.index == want.index


class _Scratch:
    """Device buffers reused by every layer and step; grown (never shrunk) on demand."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """A contiguous view of ``shape`` at the start of buffer ``name``.

        Views of one name share memory: give one name only to users that run one after another.
        """
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if (buf is None or buf.numel() < numel or buf.dtype != dtype
                or not _same_device(buf.device, device)):
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


_EXECUTORS: weakref.WeakSet[Any] = weakref.WeakSet()
KERNELS = ("flashinfer", "fa3")
LOG2_E = 1.4426950408889634  # FlashInfer's LSE is base 2, FlashAttention's natural


def device_bytes() -> int:
    """GPU memory the plugin holds in this process beyond vLLM's (soak tests attribute growth).

    Scratch buffers plus each FlashInfer wrapper's int workspace; the float workspace is vLLM's
    own FlashInfer buffer, shared, and not counted.
    """
    return sum(executor.device_bytes() for executor in list(_EXECUTORS))


def graph_stats() -> dict[str, int]:
    """The FA3 executors' per-layer CUDA graphs in this process: captured and replayed so far,
    and held now (each holds a little memory in the executor's graph pool)."""
    graphs = [g for g in (getattr(e, "graphs", None) for e in list(_EXECUTORS)) if g is not None]
    return {"graph_captures": sum(g.captures for g in graphs),
            "graph_replays": sum(g.replays for g in graphs),
            "graphs_held": sum(len(g) for g in graphs)}


class FlashInferCascadeExecutor:
    """Runs cascade plans with one FlashInfer batch-prefill wrapper per level.

    Parameters
    ----------
    float_workspace : torch.Tensor
        FlashInfer's float workspace (uint8, on the GPU; 128 MB recommended). All levels share it:
        they run one after another on one stream, so no two kernels use it at the same time.
    kv_layout : str
        ``"NHD"`` or ``"HND"``, the layout of the K/V caches passed to :meth:`run`.
    max_levels : int
        The most levels a plan may have; wrappers are created lazily up to this many.
    """

    def __init__(self, float_workspace: torch.Tensor, kv_layout: str = "NHD",
                 max_levels: int = 4) -> None:
        self._workspace = float_workspace
        self._kv_layout = kv_layout
        self._max_levels = max_levels
        self._wrappers: list[flashinfer.BatchPrefillWithPagedKVCacheWrapper] = []
        self._scratch = _Scratch()
        self._step: _Step | None = None
        _EXECUTORS.add(self)

    kernel = "flashinfer"

    def device_bytes(self) -> int:
        """Scratch buffers and the wrappers' int workspaces (see :func:`device_bytes`)."""
        total = self._scratch.nbytes()
        for wrapper in self._wrappers:
            buf = getattr(wrapper, "_int_workspace_buffer", None)
            total += 0 if buf is None else buf.numel() * buf.element_size()
        return total

    def plan(
        self,
        plan: CascadePlan,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        sm_scale: float,
        logits_soft_cap: float | None,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Plan every level of one engine step on the host; call once, then :meth:`run` per layer.

        Passes pinned host int32 indptr/indices/last-page-len tensors to FlashInfer (so it
        reads nothing back from the GPU), uploads the query index of every level that is not
        the identity (non-blocking) and sizes the scratch buffers, so :meth:`run` allocates
        nothing.

        Parameters
        ----------
        plan : CascadePlan
            Shared (non-causal) levels first, the causal per-request level last. The last level
            must cover every query token in step order (``q_is_identity``).
        num_qo_heads, num_kv_heads, head_dim, page_size : int
            The attention layer's shape; ``page_size`` must equal ``plan.page_size``.
        sm_scale : float
            Softmax scale applied to ``q @ k^T``.
        logits_soft_cap : float or None
            ``cap * tanh(logit / cap)`` when set (pointwise, so exact under cascade).
        q_dtype, kv_dtype : torch.dtype
            Query/output and KV-cache dtypes of the following :meth:`run` calls.
        device : torch.device
            The GPU the caches live on.
        """
        self._step = None  # a plan that fails halfway must not leave the previous step runnable
        _check_plan(plan, page_size, self._max_levels)
        *shared_levels, last_level = plan.levels
        while len(self._wrappers) < plan.num_levels:
            self._wrappers.append(
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, self._kv_layout))
        wrappers = self._wrappers[: plan.num_levels]
        for wrapper, level in zip(wrappers, plan.levels, strict=True):
            # Positional up to page_size: the keyword is head_dim_qk in FlashInfer >= 0.2.1.
            wrapper.plan(
                _pinned(level.qo_indptr, np.int32),
                _pinned(level.kv_page_indptr, np.int32),
                _pinned(level.kv_page_indices, np.int32),
                _pinned(level.kv_last_page_len, np.int32),
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
                causal=level.causal,
                sm_scale=sm_scale,
                logits_soft_cap=logits_soft_cap,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
            )
        num_tokens = int(last_level.qo_indptr[-1])
        self._step = _Step(
            last=wrappers[-1],
            shared=tuple(
                self._shared_level(wrapper, level, num_qo_heads, head_dim, q_dtype, device)
                for wrapper, level in zip(wrappers[:-1], shared_levels, strict=True)),
            lse=self._scratch.take("lse", (num_tokens, num_qo_heads), torch.float32, device),
        )

    def _shared_level(
        self,
        wrapper: flashinfer.BatchPrefillWithPagedKVCacheWrapper,
        level: CascadeLevel,
        num_qo_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> _SharedLevel:
        rows = int(level.qo_indptr[-1])
        o_shape, lse_shape = (rows, num_qo_heads, head_dim), (rows, num_qo_heads)
        gather = None
        if not level.q_is_identity:
            gather = _Gather(
                index=_device_index(level.q_index, device),
                q=self._scratch.take("gather_q", o_shape, dtype, device),
                out=self._scratch.take("gather_out", o_shape, dtype, device),
                lse=self._scratch.take("gather_lse", lse_shape, torch.float32, device),
            )
        return _SharedLevel(
            wrapper=wrapper,
            out=self._scratch.take("level_out", o_shape, dtype, device),
            lse=self._scratch.take("level_lse", lse_shape, torch.float32, device),
            gather=gather,
        )

    @property
    def lse(self) -> torch.Tensor:
        """The merged log-sum-exp of the latest :meth:`run`, overwritten by the next one.

        float32 ``[num_tokens, num_qo_heads]``, base 2 (``logsumexp(logits) / ln 2``).
        """
        if self._step is None:
            raise RuntimeError("no plan yet")
        return self._step.lse

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor) -> None:
        """Cascade attention for one layer, written into ``out``.

        Parameters
        ----------
        q : torch.Tensor
            ``[num_tokens, num_qo_heads, head_dim]``, ``q_dtype`` (fp16/bf16), step order; may be
            strided.
        k_cache, v_cache : torch.Tensor
            ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD) or
            ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND), ``kv_dtype``. May be
            strided views, e.g. vLLM's K and V halves of one packed cache.
        out : torch.Tensor
            ``[num_tokens, num_qo_heads, head_dim]``, ``q_dtype``, contiguous (the merge kernel
            requires it); overwritten.

        Notes
        -----
        The merged log-sum-exp (float32 ``[num_tokens, num_qo_heads]``, base 2 like every
        FlashInfer producer and ``merge_state_in_place``) is left in :attr:`lse`.
        """
        step = self._step
        if step is None:
            raise RuntimeError("run() before plan()")
        kv = (k_cache, v_cache)
        lse = step.lse
        step.last.run(q, kv, out=out, lse=lse, return_lse=True)
        # Levels run one after another, which is what lets them share scratch buffers.
        for level in step.shared:
            g = level.gather
            if g is None:
                level.wrapper.run(q, kv, out=level.out, lse=level.lse, return_lse=True)
                flashinfer.merge_state_in_place(out, lse, level.out, level.lse)
                continue
            torch.index_select(q, 0, g.index, out=g.q)
            level.wrapper.run(g.q, kv, out=level.out, lse=level.lse, return_lse=True)
            torch.index_select(out, 0, g.index, out=g.out)
            torch.index_select(lse, 0, g.index, out=g.lse)
            flashinfer.merge_state_in_place(g.out, g.lse, level.out, level.lse)
            out.index_copy_(0, g.index, g.out)
            lse.index_copy_(0, g.index, g.lse)


@dataclass(frozen=True, eq=False)
class _FaLevel:
    """One level on the GPU in FlashAttention's varlen + block-table form."""

    level: CascadeLevel  # what it was made from: reused while the plan holds the same object
    cu_q: torch.Tensor  # int32 [G + 1]: the level's query rows per group
    kv_lens: torch.Tensor  # int32 [G]: seqused_k
    block_table: torch.Tensor  # int32 [G, max_pages]
    max_q: int
    max_k: int
    index: torch.Tensor | None  # int64 [n_q]: the level's rows in q/out; None: q as it is
    rows: int  # n_q


@dataclass(frozen=True)
class _FaShared:
    """A shared level of one step and the scratch views :meth:`FlashAttnCascadeExecutor.run`
    uses for it (taken once per step, in ``plan``)."""

    level: _FaLevel
    out: torch.Tensor  # [n_q, heads, head_dim]: the level's partial output
    gather_q: torch.Tensor | None  # [n_q, heads, head_dim]: its queries, gathered (index only)
    gather_out: torch.Tensor | None  # [n_q, heads, head_dim]: the running state's rows


@dataclass(frozen=True)
class _FaStep:
    last: _FaLevel
    shared: tuple[_FaShared, ...]
    spare: torch.Tensor | None  # [tokens, heads, head_dim]: the other buffer of identity merges
    start_in_spare: bool  # odd identity merges: the per-request level writes ``spare`` first
    # One query per request: shared levels first, then the per-request level and the last
    # merge in one Triton kernel (``decode_level``) instead of an FA3 call and a merge.
    fused_decode: bool
    # Graphed (fused decode, CUDA graphs on): what a captured layer bakes in besides its
    # tensors' addresses (level sizes, static buffers, scratch views, scale); None: eager.
    graph_key: tuple[Any, ...] | None = None


GRAPH_PAGE_BUCKET = 16  # graphed steps pad block-table widths to a multiple of this many pages
CAPTURE_AFTER = 3  # a layer's graph is captured the 3rd time its key comes (2 eager runs first)
MAX_GRAPHS = 512  # e.g. 16 step shapes x 32 layers; beyond it every graph is dropped at once
MAX_SIGHTINGS = 4096  # keys seen but not captured yet, remembered (then forgotten all at once)

_log = logging.getLogger("vllm.cascade_plugin")


class _Graphs(GraphCache):
    """One CUDA graph per (layer, step shape) of graphed decode steps, captured once a key
    repeats and replayed instead of launching the layer's kernels from Python.

    A key holds everything a replay bakes in: the step's ``graph_key`` (level sizes, the static
    metadata buffers' and scratch views' addresses, the scale) and the layer's tensors'
    addresses and strides. A replay therefore computes exactly what the eager run would: the
    data behind those addresses (queries, KV cache, this step's metadata in the static buffers)
    is read when the graph runs. All graphs share one memory pool; that is safe because they
    run one after another on one stream and each leaves nothing in the pool that another reads
    (a graph's LSE, its only result there, stays referenced by its replay). Tests' stand-in
    ``capture`` keeps ``fn`` and its tensors, which is what a real replay does.
    """

    def __init__(self, capture: Callable[..., Any] | None = None,
                 capture_after: int = CAPTURE_AFTER, max_graphs: int = MAX_GRAPHS) -> None:
        super().__init__(capture, capture_after, max_graphs, MAX_SIGHTINGS)
        self._failed = False

    def usable(self, device: torch.device) -> bool:
        return not self._failed and (self.capture is not None or device.type == "cuda")

    def run(self, key: tuple[Any, ...], fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Replay ``key``'s graph, or run ``fn`` (capturing it when ``key`` has come often
        enough); returns ``fn``'s result either way."""
        if self._capturing():  # a graph launch into someone else's capture: not attempted
            return fn()
        replay = self._graphs.get(key)
        if replay is not None:
            self.replays += 1
            return replay()
        if self._failed or not self._due(key):
            return fn()
        try:
            replay, result = self._capture_with(fn)
        except Exception as exc:  # eager from now on; this layer runs eagerly right away
            self._failed = True
            self.clear()
            _log.warning("vllm-cascade-plugin: capturing a CUDA graph of a cascade decode step "
                         "failed (%s: %s); cascade decode steps launch their kernels eagerly "
                         "from now on (set CASCADE_CUDA_GRAPHS=0 to skip the attempt).",
                         type(exc).__name__, exc)
            return fn()
        self._graphs[key] = replay
        self.captures += 1
        return result

    def _capturing(self) -> bool:
        # Inside someone else's capture (vLLM's, or a whole-step graph), the kernels belong to
        # that graph: run them, neither replay nor capture a graph of our own.
        return self.capture is None and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class _Packed:
    """Where one level's int32 (cu_q, kv_lens, block table) and int64 (q_index) arrays start in
    a step's upload."""

    position: int
    level: CascadeLevel
    table_shape: tuple[int, int]
    at32: int
    at64: int
    max_k: int


# One level's int32 parts (cu_q, kv_lens, block table, each padded to 16 bytes), its padded
# table's shape and its largest KV length: what packing it computes.
_LevelParts = tuple[CascadeLevel, list[np.ndarray], tuple[int, int], int]


def _level_parts(level: CascadeLevel, page_size: int, width_bucket: int) -> _LevelParts:
    table = level.block_table()
    width = -(-table.shape[1] // width_bucket) * width_bucket
    if width != table.shape[1]:  # np.pad does the same, several times slower
        padded = np.zeros((table.shape[0], width), table.dtype)
        padded[:, :table.shape[1]] = table
        table = padded
    lens = level.kv_lens(page_size)
    parts: list[np.ndarray] = []
    for part in (level.qo_indptr, lens, table.ravel()):
        parts += [np.asarray(part, np.int32), np.zeros(-part.size % 4, np.int32)]
    return level, parts, table.shape, int(lens.max(initial=0))


def _pack_levels(levels: list[tuple[int, CascadeLevel]], page_size: int,
                 width_bucket: int = 1, known: dict[int, _LevelParts] | None = None,
                 ) -> tuple[np.ndarray, np.ndarray, list[_Packed]]:
    """The int32 and int64 arrays of ``levels`` in one array each (every int32 part 16-byte
    aligned, as a tensor of its own would be); block tables padded with page 0 to a multiple
    of ``width_bucket`` columns (never read: kernels stop at each row's KV length).

    ``known``: parts of earlier plans' levels by ``id``, reused for a level that ``is`` one of
    them (steady decode keeps its shared levels); replaced by this call's levels' parts.
    """
    ints: list[np.ndarray] = []
    longs: list[np.ndarray] = []
    packed: list[_Packed] = []
    current: dict[int, _LevelParts] = {}
    n32 = n64 = 0
    for position, level in levels:
        hit = None if known is None else known.get(id(level))
        entry = hit if hit is not None and hit[0] is level else _level_parts(
            level, page_size, width_bucket)
        current[id(level)] = entry
        _, parts, shape, max_k = entry
        packed.append(_Packed(position, level, shape, n32, n64, max_k))
        ints += parts
        n32 += sum(part.size for part in parts)
        if not level.q_is_identity:
            longs.append(np.asarray(level.q_index, np.int64))
            n64 += level.q_index.size
    if known is not None:
        known.clear()
        known.update(current)
    return (np.concatenate(ints) if ints else np.zeros(0, np.int32),
            np.concatenate(longs) if longs else np.zeros(0, np.int64), packed)


def _fa_level(p: _Packed, dev32: torch.Tensor, dev64: torch.Tensor | None) -> _FaLevel:
    """``p``'s level as views of the uploaded arrays."""
    level = p.level
    assert dev64 is not None or level.q_is_identity
    groups = level.num_groups
    table_size = p.table_shape[0] * p.table_shape[1]
    views = []
    start = p.at32
    for n in (groups + 1, groups, table_size):
        views.append(dev32[start:start + n])
        start += n + (-n % 4)
    cu_q, kv_lens, flat_table = views
    rows = int(level.qo_indptr[-1])
    return _FaLevel(
        level=level, cu_q=cu_q, kv_lens=kv_lens, block_table=flat_table.view(p.table_shape),
        max_q=int(np.diff(level.qo_indptr).max(initial=0)), max_k=p.max_k,
        index=None if dev64 is None or level.q_is_identity else dev64[p.at64:p.at64 + rows],
        rows=rows)


class FlashAttnCascadeExecutor:
    """Runs cascade plans with vLLM's FlashAttention 3: one varlen call per level.

    Every level is one ``flash_attn_varlen_func`` call over paged KV (a group is one sequence:
    its queries against its pages; non-causal on shared levels, causal on the per-request level),
    and shared levels are merged into the running state with vLLM's ``merge_attn_states``. The
    per-request level writes straight into ``out`` or into a scratch buffer, chosen so that the
    last merge lands in ``out`` and no merge writes a buffer it reads. In a decode step (one
    query per request; ``fused_decode``) the shared levels run first and the per-request level
    and the last merge are one Triton kernel, :func:`~vllm_cascade_plugin.decode_level.
    decode_level`.

    Planning converts each level to block-table form on the host and uploads it in one
    non-blocking copy per dtype; a level that ``is`` the previous plan's (steady decode, see
    :class:`~vllm_cascade_plugin.planner.CascadePlanner`) keeps its device tensors.

    With ``cuda_graphs``, decode steps are *graphed*: their metadata goes into static buffers
    (block tables padded to :data:`GRAPH_PAGE_BUCKET` pages, so consecutive decode steps have
    one shape), and each layer's kernels are captured in a CUDA graph the
    :data:`CAPTURE_AFTER`-th time the same step shape meets the same layer tensors, then
    replayed: one launch per layer instead of several from Python (a cascade step runs its
    attention outside vLLM's FULL graphs, and its launches, not its kernels, set its pace).

    Parameters
    ----------
    kv_layout : str
        Must be ``"NHD"`` (FlashAttention's paged layout).
    max_levels : int
        The most levels a plan may have.
    fused_decode : bool
        Run decode steps' per-request level with ``decode_level`` (where Triton runs and the
        head shape suits it); False: FA3 and a merge, as for every other step.
    cuda_graphs : bool
        Capture and replay the fused decode steps' layers (on a GPU).

    Raises
    ------
    RuntimeError
        When this vLLM build or GPU cannot run FlashAttention 3 (from
        :func:`~vllm_cascade_plugin.compat.fa3_kernels`), or for an HND cache.
    """

    kernel = "fa3"

    def __init__(self, kv_layout: str = "NHD", max_levels: int = 4,
                 fused_decode: bool = True, cuda_graphs: bool = False) -> None:
        if kv_layout != "NHD":
            raise RuntimeError(f"FlashAttention reads an NHD paged cache, not {kv_layout}")
        self._attention, self._merge = compat.fa3_kernels()
        self._max_levels = max_levels
        self._fused_decode = fused_decode
        self.graphs = _Graphs() if cuda_graphs else None
        self._static_key: tuple[Any, ...] = ()
        self._static_parts: dict[int, _LevelParts] = {}  # graphed steps' packed levels
        self._scratch = _Scratch()
        self._levels: tuple[_FaLevel, ...] = ()
        self._step: _FaStep | None = None
        self._sm_scale = 1.0
        self._softcap = 0.0
        self._lse: torch.Tensor | None = None
        self.runs = 0  # run() calls: a whole-step graph checks every layer ran here
        _EXECUTORS.add(self)

    def device_bytes(self) -> int:
        """Scratch and static buffers (the graphs' own memory pool is not counted)."""
        return self._scratch.nbytes()

    def plan(
        self,
        plan: CascadePlan,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        sm_scale: float,
        logits_soft_cap: float | None,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Same contract as :meth:`FlashInferCascadeExecutor.plan`."""
        self._step = None
        _check_plan(plan, page_size, self._max_levels)
        del kv_dtype  # FlashAttention reads it from the tensors
        last_level = plan.levels[-1]
        # Fused: the first shared level writes the state itself when it spans the batch.
        fused = (self._fused_decode and plan.num_levels > 1
                 and int(np.diff(last_level.qo_indptr).max(initial=0)) == 1
                 and int(last_level.qo_indptr[-1]) == last_level.num_groups
                 and decode_level.unsupported_reason(num_qo_heads, num_kv_heads, head_dim)
                 is None)
        graphed = fused and self.graphs is not None and self.graphs.usable(device)
        if graphed:
            levels = self._upload_static(plan, page_size, device)
            self._levels = ()  # static views change with the next graphed step: keep none
        else:
            levels = self._upload_changed(plan, page_size, device)
            self._levels = levels
        *shared, last = levels
        # Every scratch view run() needs, taken here: widest first, so the rest are views of the
        # same buffers and run() looks nothing up.
        take = self._scratch.take

        def view(name: str, rows: int) -> torch.Tensor:
            return take(name, (rows, num_qo_heads, head_dim), q_dtype, device)

        widest = max((fl.rows for fl in shared), default=0)
        gathers = any(fl.index is not None for fl in shared)
        for name in ("level_out", *(("gather_q", "gather_out") if gathers else ())):
            if widest:
                view(name, widest)
        identity_merges = sum(fl.index is None for fl in shared)
        if fused and shared[0].index is None:
            identity_merges -= 1
        fa_shared = tuple(_FaShared(
            level=fl, out=view("level_out", fl.rows),
            gather_q=None if fl.index is None else view("gather_q", fl.rows),
            gather_out=None if fl.index is None else view("gather_out", fl.rows))
            for fl in shared)
        spare = view("fa_state", last.rows) if identity_merges else None
        self._sm_scale = float(sm_scale)
        self._softcap = float(logits_soft_cap or 0.0)
        key = None
        if graphed:
            def ptr(t: torch.Tensor | None) -> int:
                return 0 if t is None else t.data_ptr()

            key = (self._static_key, self._sm_scale, self._softcap, ptr(spare),
                   *((ptr(s.out), ptr(s.gather_q), ptr(s.gather_out)) for s in fa_shared))
        self._step = _FaStep(last=last, shared=fa_shared, spare=spare,
                             start_in_spare=identity_merges % 2 == 1, fused_decode=fused,
                             graph_key=key)

    def _upload_changed(self, plan: CascadePlan, page_size: int,
                        device: torch.device) -> tuple[_FaLevel, ...]:
        """Every level on the device; levels that ``are`` the previous plan's keep theirs."""
        previous = {id(fl.level): fl for fl in self._levels}
        kept: list[_FaLevel | None] = []
        for level in plan.levels:
            old = previous.get(id(level))
            kept.append(old if old is not None and old.level is level else None)
        ints, longs, packed = _pack_levels(
            [(i, level) for i, level in enumerate(plan.levels) if kept[i] is None], page_size)
        if packed:
            dev32 = _upload(ints, np.int32, device)
            dev64 = _upload(longs, np.int64, device) if longs.size else None
            for p in packed:
                kept[p.position] = _fa_level(p, dev32, dev64)
        return tuple(fl for fl in kept if fl is not None)

    def _upload_static(self, plan: CascadePlan, page_size: int,
                       device: torch.device) -> tuple[_FaLevel, ...]:
        """Every level into the static buffers a graphed step's graphs read; sets
        ``_static_key``, which is equal for steps whose views and sizes are equal."""
        ints, longs, packed = _pack_levels(list(enumerate(plan.levels)), page_size,
                                           GRAPH_PAGE_BUCKET, self._static_parts)
        take = self._scratch.take
        # Views of the whole buffers: their start addresses do not move until they grow.
        dev32 = take("static32", (max(ints.size, 1),), torch.int32, device)
        dev64 = take("static64", (max(longs.size, 1),), torch.int64, device)
        for dev, host, dtype in ((dev32, ints, np.int32), (dev64, longs, np.int64)):
            if host.size:
                source = (torch.from_numpy(np.array(host, dtype)) if device.type == "cpu"
                          else _pinned(host, dtype))
                # Stream-ordered after the previous step's replays, which read the old values.
                dev[:host.size].copy_(source, non_blocking=True)
        levels = tuple(_fa_level(p, dev32, dev64) for p in packed)
        self._static_key = (dev32.data_ptr(), dev64.data_ptr(), *(
            (fl.rows, fl.level.num_groups, fl.max_q, p.table_shape[1], fl.index is None,
             p.max_k if p.position < plan.num_levels - 1 else -1)
            for p, fl in zip(packed, levels, strict=True)))
        return levels

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fl: _FaLevel,
                out: torch.Tensor, causal: bool) -> torch.Tensor:
        _, lse = self._attention(
            q=q, k=k, v=v, out=out, cu_seqlens_q=fl.cu_q, max_seqlen_q=fl.max_q,
            seqused_k=fl.kv_lens, max_seqlen_k=fl.max_k, softmax_scale=self._sm_scale,
            causal=causal, window_size=[-1, -1], block_table=fl.block_table,
            softcap=self._softcap, return_softmax_lse=True, fa_version=3)
        return lse  # float32 [num_heads, rows], natural log

    @property
    def lse(self) -> torch.Tensor:
        """The merged LSE of the latest :meth:`run` as FlashInfer has it: ``[tokens, heads]``,
        base 2 (a converted copy)."""
        if self._lse is None:
            raise RuntimeError("no run yet")
        return self._lse.t() * LOG2_E

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor) -> None:
        """Same contract as :meth:`FlashInferCascadeExecutor.run` (NHD caches only)."""
        step = self._step
        if step is None:
            raise RuntimeError("run() before plan()")
        self.runs += 1
        if step.graph_key is not None and self.graphs is not None:
            key = (step.graph_key, q.data_ptr(), q.shape, q.stride(), k_cache.data_ptr(),
                   k_cache.stride(), v_cache.data_ptr(), v_cache.stride(), out.data_ptr(),
                   out.stride())
            self._lse = self.graphs.run(
                key, lambda: self._run_fused(q, k_cache, v_cache, out, step))
            return
        if step.fused_decode:
            self._lse = self._run_fused(q, k_cache, v_cache, out, step)
            return
        # Identity merges alternate between ``out`` and ``spare``; the start is chosen so that
        # the last one lands in ``out`` (gathered merges update the state in place).
        first = step.spare if step.start_in_spare else out
        assert first is not None
        lse = self._attend(q, k_cache, v_cache, step.last, first, causal=True)
        state, lse = self._merge_shared(q, k_cache, v_cache, step, out, first, lse)
        assert state is out
        self._lse = lse

    def _run_fused(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   out: torch.Tensor, step: _FaStep) -> torch.Tensor:
        """A fused decode step's layer: shared levels, then ``decode_level``; returns the LSE."""
        state, lse = self._merge_shared(q, k_cache, v_cache, step, out, None, None)
        last = step.last
        decode_level.decode_level(q, k_cache, v_cache, last.block_table, last.kv_lens, state,
                                  lse, out, lse, sm_scale=self._sm_scale, softcap=self._softcap)
        return lse

    def _merge_shared(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      step: _FaStep, out: torch.Tensor, state: torch.Tensor | None,
                      lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every shared level merged into the running ``(state, lse)``; with no state yet
        (fused decode), the first level starts it in ``out``."""
        for sh in step.shared:
            fl = sh.level
            if state is None or lse is None:
                if sh.gather_q is None:
                    lse = self._attend(q, k_cache, v_cache, fl, out, causal=False)
                    state = out
                    continue
                if fl.rows == q.shape[0]:
                    # Every row, reordered (groups interleaved in the batch): attend in group
                    # order and scatter back; no state to merge with yet.
                    assert fl.index is not None
                    torch.index_select(q, 0, fl.index, out=sh.gather_q)
                    level_lse = self._attend(sh.gather_q, k_cache, v_cache, fl, sh.out,
                                             causal=False)
                    out.index_copy_(0, fl.index, sh.out)
                    lse = torch.empty_like(level_lse)
                    lse.index_copy_(1, fl.index, level_lse)
                    state = out
                    continue
                # Rows outside this level have nothing yet: output 0, LSE -inf.
                out.zero_()
                state = out
                lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32,
                                 device=q.device)
            if sh.gather_q is None or sh.gather_out is None:
                level_lse = self._attend(q, k_cache, v_cache, fl, sh.out, causal=False)
                target = step.spare if state is out else out
                assert target is not None
                merged = torch.empty_like(lse)
                self._merge(target, sh.out, level_lse, state, lse, output_lse=merged)
                state, lse = target, merged
                continue
            assert fl.index is not None
            torch.index_select(q, 0, fl.index, out=sh.gather_q)
            level_lse = self._attend(sh.gather_q, k_cache, v_cache, fl, sh.out, causal=False)
            torch.index_select(state, 0, fl.index, out=sh.gather_out)
            merged_out = torch.empty_like(sh.gather_out)
            merged_lse = torch.empty_like(level_lse)
            self._merge(merged_out, sh.out, level_lse, sh.gather_out,
                        lse.index_select(1, fl.index), output_lse=merged_lse)
            state.index_copy_(0, fl.index, merged_out)
            lse.index_copy_(1, fl.index, merged_lse)
        assert state is not None and lse is not None
        return state, lse


def fa3_unsupported_reason(kv_layout: str) -> str | None:
    """Why :class:`FlashAttnCascadeExecutor` cannot run here, or None."""
    if kv_layout != "NHD":
        return f"the KV cache layout is {kv_layout}; FlashAttention reads NHD"
    try:
        compat.fa3_kernels()
    except RuntimeError as exc:
        return str(exc)
    return None


def choose_kernel(requested: str, kv_layout: str) -> tuple[str, str]:
    """The executor kind for ``CASCADE_KERNEL=requested`` and a line saying which and why.

    ``auto`` takes FlashAttention 3 where it runs (Hopper, NHD cache) and FlashInfer otherwise;
    ``fa3`` asked for where it cannot run falls back to FlashInfer, and the line says so.
    """
    if requested not in ("auto", *KERNELS):
        raise ValueError(f"unknown cascade kernel {requested!r}; expected auto, "
                         f"{', '.join(KERNELS)}")
    if requested == "flashinfer":
        return "flashinfer", "cascade kernels: FlashInfer (CASCADE_KERNEL=flashinfer)"
    reason = fa3_unsupported_reason(kv_layout)
    if reason is None:
        return "fa3", f"cascade kernels: FlashAttention 3 (CASCADE_KERNEL={requested})"
    return "flashinfer", (f"cascade kernels: FlashInfer, because FlashAttention 3 cannot run: "
                          f"{reason} (CASCADE_KERNEL={requested})")


def make_executor(kind: str, float_workspace: torch.Tensor, kv_layout: str,
                  max_levels: int, fused_decode: bool = True, cuda_graphs: bool = False) -> Any:
    """A new executor of ``kind`` (from :func:`choose_kernel`); ``fused_decode`` and
    ``cuda_graphs``: the FA3 executor's (``CASCADE_FUSED_DECODE``, ``CASCADE_CUDA_GRAPHS``)."""
    if kind == "fa3":
        return FlashAttnCascadeExecutor(kv_layout, max_levels, fused_decode=fused_decode,
                                        cuda_graphs=cuda_graphs)
    if kind == "flashinfer":
        return FlashInferCascadeExecutor(float_workspace, kv_layout, max_levels)
    raise ValueError(f"unknown cascade kernel {kind!r}; expected one of {KERNELS}")
