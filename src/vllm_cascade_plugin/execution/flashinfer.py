"""The FlashInfer executor of a :class:`~vllm_cascade_plugin.planning.planner.CascadePlan`: one
FlashInfer ``BatchPrefillWithPagedKVCacheWrapper`` per level, planned on the host, states merged
with ``flashinfer.merge_state_in_place`` (base-2 LSE). Runs wherever vLLM's FlashInfer backend
runs."""

from __future__ import annotations

from dataclasses import dataclass

import flashinfer
import numpy as np
import torch

from ..planning.plan import CascadeLevel, CascadePlan
from .common import (
    EXECUTORS,
    FP8_KV_DTYPE,
    LOG2_E,
    KvScales,
    Scratch,
    apply_sinks,
    check_plan,
    device_index,
    staged,
)


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
    fp8: bool  # an FP8 (e4m3) cache: run() takes the layer's scales




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
        self._scratch = Scratch()
        self._step: _Step | None = None
        EXECUTORS.add(self)

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
        padded_rows: int = 0,
        graphs: bool = True,
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
            Query/output and KV-cache dtypes of the following :meth:`run` calls. An FP8
            ``kv_dtype`` (e4m3, vLLM's fp8) is planned as vLLM plans it (``kv_data_type``);
            the query stays 16-bit (FlashInfer's mixed-precision prefill), and :meth:`run`
            takes the layer's scales.
        device : torch.device
            The GPU the caches live on.
        padded_rows : int
            Rows of the step's query tensor beyond its tokens (vLLM's CUDA-graph padding); this
            executor runs the tokens only (:attr:`rows`).
        graphs : bool
            Whether the step may run from CUDA graphs (False above vLLM's largest capture
            size); this executor captures none.
        """
        del padded_rows, graphs
        self._step = None  # a plan that fails halfway must not leave the previous step runnable
        check_plan(plan, page_size, self._max_levels)
        *shared_levels, last_level = plan.levels
        while len(self._wrappers) < plan.num_levels:
            self._wrappers.append(
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, self._kv_layout))
        wrappers = self._wrappers[: plan.num_levels]
        for wrapper, level in zip(wrappers, plan.levels, strict=True):
            arrays = [np.asarray(a, np.int32) for a in (
                level.qo_indptr, level.kv_page_indptr, level.kv_page_indices,
                level.kv_last_page_len)]
            # FlashInfer's plan() reads these on the host and uploads them non-blocking: from
            # pinned buffers, guarded until those copies have run.
            with staged(arrays, torch.int32, device) as host:
                # Positional up to page_size: the keyword is head_dim_qk in FlashInfer >= 0.2.1.
                wrapper.plan(
                    *host,
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
            fp8=kv_dtype == FP8_KV_DTYPE,
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
                index=device_index(level.q_index, device),
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
    def rows(self) -> int:
        """Query rows :meth:`run` takes: the planned step's tokens."""
        if self._step is None:
            raise RuntimeError("no plan yet")
        return int(self._step.lse.shape[0])

    @property
    def lse(self) -> torch.Tensor:
        """The merged log-sum-exp of the latest :meth:`run`, overwritten by the next one.

        float32 ``[num_tokens, num_qo_heads]``, base 2 (``logsumexp(logits) / ln 2``).
        """
        if self._step is None:
            raise RuntimeError("no plan yet")
        return self._step.lse

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor, scales: KvScales | None = None,
            sinks: torch.Tensor | None = None) -> None:
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
        scales : KvScales or None
            An FP8 cache's per-layer scales (required with one, refused without): passed to
            every level's ``run`` as vLLM's FlashInfer forward passes them (``k_scale`` folded
            into the softmax scale, so the LSE is the dequantised logits'; ``v_scale``
            multiplying the level's output), so the merges see exact partial states.
        sinks : torch.Tensor or None
            The layer's attention sinks (``[num_qo_heads]``, logits in the units of the scaled
            ``q @ k``; gpt-oss), applied once to the merged output (:func:`.common.apply_sinks`).

        Notes
        -----
        The merged log-sum-exp (float32 ``[num_tokens, num_qo_heads]``, base 2 like every
        FlashInfer producer and ``merge_state_in_place``) is left in :attr:`lse`.
        """
        step = self._step
        if step is None:
            raise RuntimeError("run() before plan()")
        if step.fp8 != (scales is not None) or (step.fp8 and q.dtype == FP8_KV_DTYPE):
            raise ValueError(f"planned for {'an FP8' if step.fp8 else 'a 16-bit'} cache with a "
                             f"16-bit query, given a {q.dtype} query and "
                             f"{'no ' if scales is None else ''}scales")
        kv = (k_cache, v_cache)
        lse = step.lse
        # None: FlashInfer's default of 1.0 (the keyword exists in every supported release).
        k_scale = None if scales is None else scales.k_float
        v_scale = None if scales is None else scales.v_float
        step.last.run(q, kv, out=out, lse=lse, return_lse=True, k_scale=k_scale,
                      v_scale=v_scale)
        # Levels run one after another, which is what lets them share scratch buffers.
        for level in step.shared:
            g = level.gather
            if g is None:
                level.wrapper.run(q, kv, out=level.out, lse=level.lse, return_lse=True,
                                  k_scale=k_scale, v_scale=v_scale)
                flashinfer.merge_state_in_place(out, lse, level.out, level.lse)
                continue
            torch.index_select(q, 0, g.index, out=g.q)
            level.wrapper.run(g.q, kv, out=level.out, lse=level.lse, return_lse=True,
                              k_scale=k_scale, v_scale=v_scale)
            torch.index_select(out, 0, g.index, out=g.out)
            torch.index_select(lse, 0, g.index, out=g.lse)
            flashinfer.merge_state_in_place(g.out, g.lse, level.out, level.lse)
            out.index_copy_(0, g.index, g.out)
            lse.index_copy_(0, g.index, g.lse)
        if sinks is not None:
            apply_sinks(out, lse / LOG2_E, sinks)

