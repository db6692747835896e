"""GPU executor of a :class:`~vllm_cascade_plugin.planner.CascadePlan` on FlashInfer kernels.

The plan/run split mirrors FlashInfer's: :meth:`FlashInferCascadeExecutor.plan` runs on the host
once per engine step (one ``BatchPrefillWithPagedKVCacheWrapper.plan`` per level), and
:meth:`FlashInferCascadeExecutor.run` runs per layer: the causal per-request level writes the
output and its log-sum-exp, then every shared level is attended and merged into it with
``flashinfer.merge_state_in_place``. Neither method reads anything back from the GPU.

Only vLLM workers import this module (it imports torch and flashinfer at the top).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import flashinfer
import numpy as np
import torch

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


def _pinned(array: np.ndarray, dtype: type[np.integer]) -> torch.Tensor:
    # Host tensors keep FlashInfer's plan free of device->host copies; pinned ones make the
    # non_blocking uploads (FlashInfer's and ours) truly asynchronous, and torch's pinned-memory
    # allocator does not reuse a block before its copy has run. np.require copies only when
    # needed: from_numpy warns on read-only arrays, and the planner may freeze its output.
    return torch.from_numpy(np.require(array, dtype, ("C", "W"))).pin_memory()


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
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


_EXECUTORS: weakref.WeakSet[FlashInferCascadeExecutor] = weakref.WeakSet()


def device_bytes() -> int:
    """GPU memory the plugin holds in this process beyond vLLM's (soak tests attribute growth).

    Scratch buffers plus each FlashInfer wrapper's int workspace; the float workspace is vLLM's
    own FlashInfer buffer, shared, and not counted.
    """
    total = 0
    for executor in list(_EXECUTORS):
        total += sum(b.numel() * b.element_size() for b in executor._scratch._buffers.values())
        for wrapper in executor._wrappers:
            buf = getattr(wrapper, "_int_workspace_buffer", None)
            total += 0 if buf is None else buf.numel() * buf.element_size()
    return total


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
        if plan.page_size != page_size:
            raise ValueError(f"plan page size {plan.page_size} != cache page size {page_size}")
        if not 1 <= plan.num_levels <= self._max_levels:
            raise ValueError(f"plan has {plan.num_levels} levels; 1..{self._max_levels} supported")
        *shared_levels, last_level = plan.levels
        if not (last_level.causal and last_level.q_is_identity):
            raise ValueError("the last level must be causal and cover the queries in step order")
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
