"""The FlashAttention 3 executor of a
:class:`~vllm_cascade_plugin.planning.planner.CascadePlan`: vLLM's bundled
``flash_attn_varlen_func`` with a block table per level (as vLLM's own FLASH_ATTN backend and its
pre-0.32 cascade call it), states merged with vLLM's ``merge_attn_states`` (natural-log LSE).
Hopper only, NHD cache layout; planning is numpy and one upload, no FlashInfer plan."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import stats
from ..graphs.capture import LayerGraphs
from ..planning import graph_layout
from ..planning.plan import CascadeLevel, CascadePlan
from . import common, decode_level, fa3_split, vllm_kernels
from .common import EXECUTORS, FP8_KV_DTYPE, LOG2_E, KvScales, Scratch, check_plan, quantise_fp8
from .fa3_levels import FaLevel, gather_rows, upload_levels, write_static
from .fa3_split import FlatRows


@dataclass(frozen=True)
class _FaShared:
    """A shared level of one step and the scratch views :meth:`FlashAttnCascadeExecutor.run`
    uses for it (taken once per step, in ``plan``)."""

    level: FaLevel
    out: torch.Tensor  # [n_q, heads, head_dim]: the level's partial output
    gather_q: torch.Tensor | None  # [n_q, heads, head_dim]: its queries, gathered (index only)
    gather_out: torch.Tensor | None  # [n_q, heads, head_dim]: the running state's rows


@dataclass(frozen=True)
class _FaStep:
    last: FaLevel
    shared: tuple[_FaShared, ...]
    spare: torch.Tensor | None  # [rows, heads, head_dim]: the other buffer of identity merges
    start_in_spare: bool  # odd identity merges: the per-request level writes ``spare`` first
    # One query per request: shared levels first, then the per-request level and the last
    # merge in one Triton kernel (``decode_level``) instead of an FA3 call and a merge.
    fused_decode: bool
    rows: int  # query rows the levels run: the plan's tokens, or a graphed step's padded rows
    # FP8 cache: where a 16-bit query is quantised for FA3 (FA3 takes q, K and V in one dtype;
    # vLLM's FlashAttention layers hand an FP8 query already). None: a 16-bit cache.
    q_fp8: torch.Tensor | None
    # Graphed (fused decode, CUDA graphs on): what a captured layer bakes in besides its
    # tensors' addresses (bucketed level sizes, static buffers, scratch views, scale); None:
    # eager.
    graph_key: tuple[Any, ...] | None = None
    layout_key: tuple[Any, ...] | None = None  # of graph_key: the bucketed level sizes alone
    # A mixed step (:mod:`.fa3_split`): its other rows flat, and the buffers the decode rows'
    # queries are gathered into and their output comes from ([rows, heads, head_dim] each).
    split: tuple[FlatRows, torch.Tensor, torch.Tensor] | None = None


class FlashAttnCascadeExecutor:
    """Runs cascade plans with vLLM's FlashAttention 3: one varlen call per level.

    Every level is one ``flash_attn_varlen_func`` call over paged KV (a group is one sequence:
    its queries against its pages; non-causal on shared levels, causal on the per-request level),
    and shared levels are merged into the running state with vLLM's ``merge_attn_states``. The
    per-request level writes straight into ``out`` or into a scratch buffer, chosen so that the
    last merge lands in ``out`` and no merge writes a buffer it reads. In a decode step (one
    query per request; ``fused_decode``) the shared levels run first and the per-request level
    and the last merge are one Triton kernel, :func:`~vllm_cascade_plugin.execution.decode_level.
    decode_level`.

    Planning converts each level to block-table form on the host and uploads it in one
    non-blocking copy per dtype; a level that ``is`` the previous plan's (steady decode, see
    :class:`~vllm_cascade_plugin.planning.planner.CascadePlanner`) keeps its device tensors.

    With ``cuda_graphs``, decode steps are *graphed*: their metadata is laid out in bucketed
    sizes (:mod:`~vllm_cascade_plugin.planning.graph_layout`: rows padded to vLLM's capture
    size, groups, query runs and block-table widths to buckets) in static buffers, and each
    layer's kernels are captured in a CUDA graph the first time a layout meets the layer's
    tensors, then replayed: one launch per layer instead of several from Python, for every step
    with that layout however the batch changed.

    Parameters: ``kv_layout`` must be ``"NHD"`` (FlashAttention's paged layout);
    ``max_levels``, the most levels a plan may have; ``fused_decode``, run decode steps'
    per-request level with ``decode_level`` (where Triton runs and the head shape suits it;
    False: FA3 and a merge, as for every other step); ``cuda_graphs``, capture and replay the
    fused decode steps' layers (on a GPU). Raises RuntimeError where this vLLM build or GPU cannot
    run FlashAttention 3 (:func:`~vllm_cascade_plugin.execution.vllm_kernels.fa3_kernels`), or
    for an HND cache. Mixed prefill+decode steps: :mod:`.fa3_split`.
    """

    kernel = "fa3"

    def __init__(self, kv_layout: str = "NHD", max_levels: int = 4,
                 fused_decode: bool = True, cuda_graphs: bool = False) -> None:
        if kv_layout != "NHD":
            raise RuntimeError(f"FlashAttention reads an NHD paged cache, not {kv_layout}")
        self._attention, self._merge = vllm_kernels.fa3_kernels()
        self._max_levels = max_levels
        self._fused_decode = fused_decode
        self.graphs = LayerGraphs() if cuda_graphs else None
        self._known_layouts: dict[int, Any] = {}  # graphed steps' shared-level layouts
        self._scratch = Scratch()
        self._levels: tuple[FaLevel, ...] = ()
        self._step: _FaStep | None = None
        self._sm_scale = 1.0
        self._softcap = 0.0
        self._scales: KvScales | None = None  # the running layer's (FP8 caches)
        self._lse: torch.Tensor | None = None
        self._graphed_counted = False
        self.runs = 0  # run() calls: a whole-step graph checks every layer ran here
        # The most rows a graphed step can have (0: unknown): its buffers are allocated for it
        # at once, so that a growing batch moves none (their addresses key the graphs).
        self.graph_rows = 0
        EXECUTORS.add(self)

    def device_bytes(self) -> int:
        """Scratch and static buffers (the graphs' own memory pool: ``graphs.pool_bytes()``)."""
        return self._scratch.nbytes()

    @property
    def rows(self) -> int:
        """Query rows the planned step's :meth:`run` takes (a graphed step's padded rows)."""
        if self._step is None:
            raise RuntimeError("no plan yet")
        split = self._step.split
        return self._step.rows if split is None else split[0].num_tokens

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
        split: FlatRows | None = None,
    ) -> None:
        """Same contract as :meth:`FlashInferCascadeExecutor.plan`; ``padded_rows``: the rows of
        the step's query and output tensors (vLLM's CUDA-graph padding), which a graphed decode
        step runs whole (:attr:`rows`); ``graphs``: False runs the step without graphs (vLLM
        does not pad it: above its largest capture size). With an FP8 ``kv_dtype`` (e4m3)
        ``q_dtype`` is the output's, which FA3 writes in bf16 only for FP8 input; :meth:`run`
        then needs the layer's scales. ``split``: a mixed step, ``plan`` its decode rows alone
        (:mod:`.fa3_split`; ``padded_rows`` then theirs, a 16-bit cache only)."""
        self._step = None
        self._graphed_counted = False
        check_plan(plan, page_size, self._max_levels)
        fp8 = kv_dtype == FP8_KV_DTYPE
        if split is not None and (fp8 or split.num_decode != plan.stats.num_tokens):
            raise ValueError("a split step takes a 16-bit cache and a plan of its decode rows")
        if fp8 and q_dtype != torch.bfloat16:
            raise RuntimeError(f"FlashAttention 3 writes FP8 attention's output in bf16, not "
                               f"{q_dtype}")
        last_level = plan.levels[-1]
        # Fused: the first shared level writes the state itself when it spans the batch.
        fused = (self._fused_decode and plan.num_levels > 1
                 and int(np.diff(last_level.qo_indptr).max(initial=0)) == 1
                 and int(last_level.qo_indptr[-1]) == last_level.num_groups
                 and decode_level.unsupported_reason(num_qo_heads, num_kv_heads, head_dim)
                 is None)
        graphed = fused and graphs and self.graphs is not None and self.graphs.usable(device)
        rows = plan.stats.num_tokens
        static_key: tuple[Any, ...] = ()
        layout_key: tuple[Any, ...] | None = None
        if graphed:
            rows = max(rows, padded_rows)
            layouts = graph_layout.layout(plan, rows, known=self._known_layouts)
            reserve_rows = max(self.graph_rows, rows)
            levels, addresses = write_static(
                layouts, self._scratch, device,
                (graph_layout.STATIC32_RESERVE if self.graph_rows else 0,
                 reserve_rows * self._max_levels))
            layout_key = tuple(layout.key for layout in layouts)
            static_key = (*addresses, *layout_key)
            self._levels = ()  # static views change with the next graphed step: keep none
        else:
            levels = self._upload_changed(plan, page_size, device)
            self._levels = levels
        *shared, last = levels
        # Every scratch view run() needs, taken here: widest first, so the rest are views of the
        # same buffers and run() looks nothing up.
        take = self._scratch.take

        reserve = max(self.graph_rows, rows) * num_qo_heads * head_dim if graphed else 0
        # A graphed step's buffers are its own: an eager step of more tokens (a prefill) growing
        # a shared one would move it under the graphs captured before.
        prefix = "graphed " if graphed else ""

        def view(name: str, n: int, dtype: torch.dtype = q_dtype) -> torch.Tensor:
            return take(prefix + name, (n, num_qo_heads, head_dim), dtype, device, reserve)

        query_dtype = FP8_KV_DTYPE if fp8 else q_dtype  # what FA3 reads

        widest = max((fl.rows for fl in shared), default=0)
        gathers = any(fl.index is not None for fl in shared)
        for name in ("level_out", *(("gather_q", "gather_out") if gathers else ())):
            if widest:
                view(name, widest, query_dtype if name == "gather_q" else q_dtype)
        identity_merges = sum(fl.index is None for fl in shared)
        if fused and shared[0].index is None:
            identity_merges -= 1
        fa_shared = tuple(_FaShared(
            level=fl, out=view("level_out", fl.rows),
            gather_q=None if fl.index is None else view("gather_q", fl.rows, query_dtype),
            gather_out=None if fl.index is None else view("gather_out", fl.rows))
            for fl in shared)
        spare = view("fa_state", last.rows) if identity_merges else None
        q_fp8 = view("q_fp8", rows, FP8_KV_DTYPE) if fp8 else None
        split_step = None if split is None else (split, view("split_q", rows),
                                                 view("split_out", rows))
        self._sm_scale = float(sm_scale)
        self._softcap = float(logits_soft_cap or 0.0)
        key = None
        if graphed:
            def ptr(t: torch.Tensor | None) -> int:
                return 0 if t is None else t.data_ptr()

            key = (static_key, self._sm_scale, self._softcap, ptr(spare), ptr(q_fp8),
                   *((ptr(s.out), ptr(s.gather_q), ptr(s.gather_out)) for s in fa_shared))
        self._step = _FaStep(last=last, shared=fa_shared, spare=spare,
                             start_in_spare=identity_merges % 2 == 1, fused_decode=fused,
                             rows=rows, q_fp8=q_fp8, graph_key=key, layout_key=layout_key,
                             split=split_step)

    def _upload_changed(self, plan: CascadePlan, page_size: int,
                        device: torch.device) -> tuple[FaLevel, ...]:
        """Every level on the device; levels that ``are`` the previous plan's keep theirs."""
        previous = {id(fl.level): fl for fl in self._levels}
        kept: list[FaLevel | None] = []
        for level in plan.levels:
            old = previous.get(id(level))
            kept.append(old if old is not None and old.level is level else None)
        missing: list[tuple[int, CascadeLevel]] = [
            (i, level) for i, level in enumerate(plan.levels) if kept[i] is None]
        for position, fl in upload_levels(missing, page_size, device):
            kept[position] = fl
        return tuple(fl for fl in kept if fl is not None)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fl: FaLevel,
                out: torch.Tensor, causal: bool) -> torch.Tensor:
        descales = {}
        if self._scales is not None:
            # As vLLM's FlashAttention forward passes them: the layer's one-element scales
            # expanded to (sequences, KV heads), here a level's groups.
            shape = (fl.kv_lens.shape[0], k.shape[2])
            descales = {"q_descale": self._scales.q.expand(shape),
                        "k_descale": self._scales.k.expand(shape),
                        "v_descale": self._scales.v.expand(shape)}
        _, lse = self._attention(
            q=q, k=k, v=v, out=out, cu_seqlens_q=fl.cu_q, max_seqlen_q=fl.max_q,
            seqused_k=fl.kv_lens, max_seqlen_k=fl.max_k, softmax_scale=self._sm_scale,
            causal=causal, window_size=[-1, -1], block_table=fl.block_table,
            softcap=self._softcap, return_softmax_lse=True, fa_version=3, **descales)
        return lse  # float32 [num_heads, rows], natural log

    @property
    def lse(self) -> torch.Tensor:
        """The merged LSE of the latest :meth:`run` as FlashInfer has it: ``[rows, heads]``,
        base 2 (a converted copy)."""
        if self._lse is None:
            raise RuntimeError("no run yet")
        return self._lse.t() * LOG2_E

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor, scales: KvScales | None = None,
            sinks: torch.Tensor | None = None) -> None:
        """Same contract as :meth:`FlashInferCascadeExecutor.run` (NHD caches only), with
        :attr:`rows` query rows (more than the plan's tokens in a padded graphed step: the
        extra rows' output is written and meaningless; a split step's LSE: its decode rows',
        in their order). An FP8 cache (planned so) takes the
        layer's ``scales`` and an FP8 query (as vLLM's FlashAttention layers hand it, ``q *
        scales.q`` its value) or a 16-bit one, quantised here with ``scales.q`` as vLLM's
        FlashAttention layers would."""
        step = self._step
        if step is None:
            raise RuntimeError("run() before plan()")
        rows = self.rows
        if q.shape[0] != rows or out.shape[0] != rows:
            raise ValueError(f"planned for {rows} query rows, given {q.shape[0]}")
        if (step.q_fp8 is not None) != (scales is not None) or (
                step.q_fp8 is not None and k_cache.dtype != FP8_KV_DTYPE):
            raise ValueError(f"planned for {'an FP8' if step.q_fp8 is not None else 'a 16-bit'}"
                             f" cache, given a {k_cache.dtype} cache and "
                             f"{'no ' if scales is None else ''}scales")
        self._scales = scales
        self.runs += 1
        if step.split is None:
            self._run_levels(q, k_cache, v_cache, out, step)
            self._sink(out, sinks)
            return
        flat, split_q, split_out = step.split  # a mixed step: see fa3_split
        fa3_split.run_flat(self._attention, flat, q, k_cache, v_cache, out, self._sm_scale,
                           self._softcap, sinks)
        fa3_split.gather(flat, q, split_q)
        self._run_levels(split_q, k_cache, v_cache, split_out, step)
        self._sink(split_out, sinks)
        fa3_split.scatter(flat, split_out, out)

    def _sink(self, out: torch.Tensor, sinks: torch.Tensor | None) -> None:
        """The layer's attention sinks (``s_aux``, one per query head) on the merged output."""
        if sinks is not None:
            assert self._lse is not None
            common.apply_sinks(out, self._lse.t(), sinks)

    def _run_levels(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, step: _FaStep) -> None:
        """The plan's levels on ``step.rows`` query rows (from the layer's CUDA graph where the
        step is graphed); the merged LSE in ``_lse``."""
        scales = self._scales
        if step.graph_key is not None and self.graphs is not None:
            key = (step.graph_key, q.data_ptr(), q.shape, q.stride(), q.dtype,
                   k_cache.data_ptr(), k_cache.stride(), v_cache.data_ptr(), v_cache.stride(),
                   out.data_ptr(), out.stride(),
                   *(() if scales is None else (t.data_ptr() for t in scales.tensors())))
            replays = self.graphs.replays
            self._lse = self.graphs.run(
                key, lambda: self._run_fused(q, k_cache, v_cache, out, step))
            if (self.graphs.replays > replays and not self._graphed_counted
                    and step.split is None):
                self._graphed_counted = True  # the step's first layer replayed: a graphed step
                stats.record_graphed_step()
            return
        if step.fused_decode:
            self._lse = self._run_fused(q, k_cache, v_cache, out, step)
            return
        q = self._fp8_query(q, step)
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
        q = self._fp8_query(q, step)
        state, lse = self._merge_shared(q, k_cache, v_cache, step, out, None, None)
        last = step.last
        decode_level.decode_level(
            q, k_cache, v_cache, last.block_table, last.kv_lens, state, lse, out, lse,
            sm_scale=self._sm_scale, softcap=self._softcap,
            scales=None if self._scales is None else self._scales.tensors())
        return lse

    def _fp8_query(self, q: torch.Tensor, step: _FaStep) -> torch.Tensor:
        """The query FA3 reads: with an FP8 cache, FP8 (quantised here if it came 16-bit)."""
        if step.q_fp8 is None or q.dtype == FP8_KV_DTYPE:
            return q
        assert self._scales is not None
        return quantise_fp8(q, self._scales.q, step.q_fp8)

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
                    # Every row, reordered (groups interleaved in the batch; a graphed step's
                    # first level always): attend in group order and scatter back, no state to
                    # merge with yet.
                    assert fl.index is not None
                    gather_rows(q, fl.index, sh.gather_q)
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
            gather_rows(q, fl.index, sh.gather_q)
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

