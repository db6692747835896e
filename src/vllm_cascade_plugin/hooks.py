"""Every runtime patch the plugin makes to vLLM's model runners, in one place.

Why patches at all: vLLM's metadata builder learns of a step only after the step's CUDA-graph
mode is fixed, gets block ids only as a GPU tensor, and Model Runner V2 never passes a common
prefix. So a small wrapper in each runner plans the step on the CPU first, and forbids a FULL
graph replay (which would skip our attention Python) only on steps that will run cascade. Steps
without sharing keep exactly the graphs vLLM would use without the plugin.

Each wrapper calls the original first or last, never replaces it, and swallows its own failures
(a failing hook costs the step its cascade, never the engine). The list is mirrored in the README
and guarded by ``tests/test_hooks.py``, which fails loudly when a patched vLLM symbol changes.

V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``), ``vllm.v1.worker.gpu_model_runner.GPUModelRunner``:
  ``initialize_metadata_builders``  turn on the runner's (otherwise dead) cascade hook;
  ``_compute_cascade_attn_prefix_lens``  plan the step; a non-None result disables FULL graphs;
  ``execute_model``  forget the plan when the step ends.
V2 runner, ``vllm.v1.worker.gpu``:
  ``block_table.BlockTables.append_block_ids``  keep a CPU mirror of the block ids;
  ``model_runner.GPUModelRunner.execute_model``  remember the step's scheduler output;
  ``cudagraph_utils.CudaGraphManager.dispatch``  plan the step; no FULL graph for cascade steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from . import stats
from .step import session

_PATCHED = "__cascade_plugin_original__"


def _wrap(owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    if hasattr(original, _PATCHED):  # idempotent: the backend module may be imported twice
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _PATCHED, original)
    setattr(owner, name, wrapper)


def _plan_rows(block_table: np.ndarray, num_blocks: np.ndarray, seq_lens: np.ndarray,
               query_lens: np.ndarray) -> bool:
    """Plan a step from CPU rows; True when it will run cascade."""
    needed = -(-seq_lens // max(session.page_size, 1))
    if np.any(num_blocks < needed):
        stats.record_fallback("block table shorter than the sequence")
        session.end_step()
        return False
    step = session.plan_step(block_table, seq_lens, query_lens)
    return step is not None and step.decision.use_cascade


# ----------------------------------------------------------------------------------- V1 runner

def _v1_initialize_metadata_builders(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        # The runner calls _compute_cascade_attn_prefix_lens only with this flag on. Our wrapper
        # of that method never runs vLLM's own (disabled, broken) FlashInfer cascade.
        self.cascade_attn_enabled = session.active
        return result
    return wrapper


def _v1_compute_cascade_attn_prefix_lens(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, num_scheduled_tokens: np.ndarray, num_computed_tokens: np.ndarray,
                num_common_prefix_blocks: list[int]) -> list[list[int]] | None:
        try:
            if len(self.kv_cache_config.kv_cache_groups) != 1:
                stats.record_fallback("more than one KV cache group")
                return None
            table = self.input_batch.block_table[0]
            n = len(num_scheduled_tokens)
            query_lens = np.asarray(num_scheduled_tokens, dtype=np.int32)
            seq_lens = (np.asarray(num_computed_tokens[:n], dtype=np.int32) + query_lens)
            if not _plan_rows(table.block_table.np[:n], table.num_blocks_per_row[:n], seq_lens,
                              query_lens):
                return None
        except Exception as exc:
            session.end_step()
            stats.record_fallback("runner hook error", f"{type(exc).__name__}: {exc}")
            return None
        # Non-None disables FULL graphs for this step; the zeros keep common_prefix_len at 0.
        return [[0] * len(groups) for groups in self.attn_groups]
    return wrapper


def _end_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            session.end_step()
    return wrapper


# ----------------------------------------------------------------------------------- V2 runner

_MIRROR = "_cascade_block_ids"


def _v2_append_block_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, req_index: int, new_block_ids: Any, overwrite: bool) -> Any:
        start = 0 if overwrite else int(self.num_blocks.np[0, req_index])
        result = original(self, req_index, new_block_ids, overwrite)
        try:
            mirror = self.__dict__.get(_MIRROR)
            if mirror is None:
                mirror = np.zeros(tuple(self.block_tables[0].gpu.shape), dtype=np.int32)
                self.__dict__[_MIRROR] = mirror
            ids = new_block_ids[0]
            bpk = self.blocks_per_kv_block[0]
            if bpk > 1:
                ids = [b * bpk + k for b in ids for k in range(bpk)]
            mirror[req_index, start:start + len(ids)] = ids
        except Exception as exc:
            self.__dict__[_MIRROR] = False  # never plan from a mirror that missed a write
            stats.record_fallback("block id mirror error", f"{type(exc).__name__}: {exc}")
        return result
    return wrapper


class _PendingStep:
    def __init__(self, runner: Any, scheduler_output: Any) -> None:
        self.runner, self.scheduler_output = runner, scheduler_output
        self.cascade: bool | None = None  # planned yet, and its verdict


_pending: _PendingStep | None = None


def _v2_execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        global _pending
        dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
        _pending = None if dummy or not session.active else _PendingStep(self, scheduler_output)
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            _pending = None
            session.end_step()
    return wrapper


def _v2_plan(step: _PendingStep) -> bool:
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    runner, so = step.runner, step.scheduler_output
    tables = runner.block_tables
    if tables.num_kv_cache_groups != 1:
        stats.record_fallback("more than one KV cache group")
        return False
    mirror = tables.__dict__.get(_MIRROR)
    if mirror is None or mirror is False:
        stats.record_fallback("no CPU block ids")
        return False
    req_ids = sort_batch_req_ids(so.num_scheduled_tokens, runner.decode_query_len)
    n = len(req_ids)
    index = np.fromiter(map(runner.req_states.req_id_to_index.__getitem__, req_ids),
                        dtype=np.int64, count=n)
    query_lens = np.fromiter(map(so.num_scheduled_tokens.__getitem__, req_ids),
                             dtype=np.int32, count=n)
    seq_lens = runner.req_states.num_computed_tokens_np[index] + query_lens
    width = int(-(-int(seq_lens.max()) // max(session.page_size, 1)))
    return _plan_rows(mirror[index, :width], tables.num_blocks.np[0, index], seq_lens, query_lens)


def _v2_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, num_reqs: int, num_tokens: int, uniform_token_count: int | None,
                num_active_loras: int) -> Any:
        step = _pending
        if step is None or step.runner.cudagraph_manager is not self:
            return original(self, num_reqs, num_tokens, uniform_token_count, num_active_loras)
        if step.cascade is None:  # dispatch runs again under data parallelism: plan once
            try:
                step.cascade = _v2_plan(step)
            except Exception as exc:
                session.end_step()
                step.cascade = False
                stats.record_fallback("runner hook error", f"{type(exc).__name__}: {exc}")
        if not step.cascade:
            return original(self, num_reqs, num_tokens, uniform_token_count, num_active_loras)
        # No uniform token count: the FULL decode graphs do not match, PIECEWISE ones still do.
        desc = original(self, num_reqs, num_tokens, None, num_active_loras)
        from vllm.config import CUDAGraphMode

        if desc.cg_mode == CUDAGraphMode.FULL:
            desc = type(desc)(cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens,
                              num_reqs=num_reqs, num_active_loras=desc.num_active_loras)
        return desc
    return wrapper


def patch_targets() -> list[tuple[type, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    """(class, method, wrapper factory) for every patch; imports vLLM's runner modules."""
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    return [
        (V1Runner, "initialize_metadata_builders", _v1_initialize_metadata_builders),
        (V1Runner, "_compute_cascade_attn_prefix_lens", _v1_compute_cascade_attn_prefix_lens),
        (V1Runner, "execute_model", _end_step),
        (BlockTables, "append_block_ids", _v2_append_block_ids),
        (V2Runner, "execute_model", _v2_execute_model),
        (CudaGraphManager, "dispatch", _v2_dispatch),
    ]


def install() -> None:
    """Apply every patch (idempotent). Called when the backend module is imported in a worker."""
    for owner, name, make in patch_targets():
        _wrap(owner, name, make)
