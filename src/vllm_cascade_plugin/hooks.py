"""Every runtime patch the plugin makes to vLLM's model runners, in one place.

Why patches at all: vLLM's metadata builder learns of a step only after the step's CUDA-graph
mode is fixed, gets block ids only as a GPU tensor, and never passes a common prefix (0.32+ have
no cascade at all). So a small wrapper in each runner plans the step on the CPU first, and forbids
a FULL graph replay (which would skip our attention Python) only on steps that will run cascade.
Steps without sharing keep exactly the graphs vLLM would use without the plugin.

Each wrapper calls the original, never replaces it, and swallows its own failures (a failing hook
costs the step its cascade, never the engine). Every patched method exists with the arguments we
read in vLLM 0.26 through 0.33; what differs between releases is asked of :mod:`.compat`. The
list is mirrored in the README and guarded by ``tests/test_hooks.py``, which fails loudly when a
patched vLLM symbol changes.

V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``), ``vllm.v1.worker.gpu_model_runner.GPUModelRunner``:
  ``execute_model``  remember a real step; forget its plan when the step ends;
  ``_determine_batch_execution_and_padding``  plan the step (its CPU block table is committed);
  ``vllm.v1.cudagraph_dispatcher.CudagraphDispatcher.dispatch``  ``invalid_modes`` gets FULL on
  cascade steps (what vLLM's own cascade did through ``use_cascade_attn`` up to 0.31).
V2 runner, ``vllm.v1.worker.gpu``:
  ``block_table.BlockTables.append_block_ids``  keep a CPU mirror of the block ids;
  ``model_runner.GPUModelRunner.execute_model``  remember a real (not dummy) step;
  ``cudagraph_utils.CudaGraphManager.dispatch``  plan the step; no FULL graph for cascade steps.
Whole-step graphs (``CASCADE_FULL_GRAPHS``, :mod:`.fullgraph`): V1
``GPUModelRunner._model_forward`` and V2 ``CudaGraphManager.run_pw_graph`` run a cascade decode
step's model call from the plugin's own CUDA graph of the whole step.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from . import compat, stats
from .step import session

_PATCHED = "__cascade_plugin_original__"


def _wrap(owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    if hasattr(original, _PATCHED):  # idempotent: the backend module may be imported twice
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _PATCHED, original)
    setattr(owner, name, wrapper)


def _plan_rows(first_pages: np.ndarray, block_table: Callable[[], np.ndarray],
               num_blocks: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray) -> bool:
    """Plan a step from CPU rows; True when it will run cascade.

    ``block_table`` is read only when the rows' first block ids leave sharing possible.
    """
    needed = -(-seq_lens // max(session.page_size, 1))
    if np.any(num_blocks < needed):
        stats.record_fallback("block table shorter than the sequence")
        session.end_step()
        return False
    if session.skip_unshared(first_pages, seq_lens, query_lens):
        return False
    step = session.plan_step(block_table(), seq_lens, query_lens)
    return step is not None and step.decision.use_cascade


class _PendingStep:
    def __init__(self, runner: Any, scheduler_output: Any) -> None:
        self.runner, self.scheduler_output = runner, scheduler_output
        self.cascade: bool | None = None  # planned yet, and its verdict


_pending: _PendingStep | None = None


def _plan_once(step: _PendingStep, plan: Callable[[_PendingStep], bool]) -> bool:
    """The step's verdict, planned on first use (dispatch runs again under data parallelism)."""
    if step.cascade is None:
        try:
            step.cascade = plan(step)
        except Exception as exc:
            session.end_step()
            step.cascade = False
            stats.record_fallback("runner hook error", f"{type(exc).__name__}: {exc}")
    return step.cascade


def _execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """Both runners: a real step is pending while it runs; its plan ends with it."""
    signature = inspect.signature(original)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _pending
        call = signature.bind(self, *args, **kwargs)
        # V2 runs its profile and CUDA-graph capture steps through here too, as dummy runs.
        real = session.active and not call.arguments.get("dummy_run", False)
        _pending = _PendingStep(self, call.arguments["scheduler_output"]) if real else None
        try:
            return original(self, *args, **kwargs)
        finally:
            _pending = None
            session.end_step()
    return wrapper


# ----------------------------------------------------------------------------------- V1 runner

def _v1_plan(step: _PendingStep) -> bool:
    runner, so = step.runner, step.scheduler_output
    if len(runner.kv_cache_config.kv_cache_groups) != 1:
        stats.record_fallback("more than one KV cache group")
        return False
    batch = runner.input_batch
    n = batch.num_reqs
    if n == 0:  # a step without requests runs a dummy batch (external launcher under DP)
        return False
    query_lens = np.fromiter(map(so.num_scheduled_tokens.__getitem__, batch.req_ids),
                             dtype=np.int32, count=n)
    seq_lens = np.asarray(batch.num_computed_tokens_cpu[:n], dtype=np.int32) + query_lens
    rows = batch.block_table[0].block_table.np[:n]
    return _plan_rows(rows[:, 0], lambda: rows, batch.block_table[0].num_blocks_per_row[:n],
                      seq_lens, query_lens)


def _v1_determine_batch_execution(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = _pending
        if step is not None and step.runner is self:
            _plan_once(step, _v1_plan)
        return original(self, *args, **kwargs)
    return wrapper


def _v1_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = _pending
        if step is None or not step.cascade or step.runner.cudagraph_dispatcher is not self:
            return original(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs)
        # A re-dispatch to the mode data-parallel ranks agreed on (valid_modes) stays as it is.
        if call.arguments.get("valid_modes") is None:
            from vllm.config import CUDAGraphMode

            call.arguments["invalid_modes"] = {
                CUDAGraphMode.FULL, *(call.arguments.get("invalid_modes") or ())}
        return original(*call.args, **call.kwargs)
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
            ids = compat.v2_block_ids_written(self, 0, new_block_ids[0])
            mirror[req_index, start:start + len(ids)] = ids
        except Exception as exc:
            self.__dict__[_MIRROR] = False  # never plan from a mirror that missed a write
            stats.record_fallback("block id mirror error", f"{type(exc).__name__}: {exc}")
        return result
    return wrapper


def _v2_plan(step: _PendingStep) -> bool:
    runner, so = step.runner, step.scheduler_output
    tables = runner.block_tables
    if tables.num_kv_cache_groups != 1:
        stats.record_fallback("more than one KV cache group")
        return False
    mirror = tables.__dict__.get(_MIRROR)
    if mirror is None or mirror is False:
        stats.record_fallback("no CPU block ids")
        return False
    req_ids = compat.v2_batch_order(runner, so)
    n = len(req_ids)
    index = np.fromiter(map(runner.req_states.req_id_to_index.__getitem__, req_ids),
                        dtype=np.int64, count=n)
    query_lens = np.fromiter(map(so.num_scheduled_tokens.__getitem__, req_ids),
                             dtype=np.int32, count=n)
    seq_lens = runner.req_states.num_computed_tokens_np[index] + query_lens
    width = int(-(-int(seq_lens.max()) // max(session.page_size, 1)))
    # The row copy (~70 us for 256 rows x 2K pages) only when sharing is possible.
    return _plan_rows(mirror[index, 0], lambda: mirror[index, :width],
                      tables.num_blocks.np[0, index], seq_lens, query_lens)


def _v2_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    full_graph_arguments = [a for a in compat.V2_FULL_GRAPH_ARGUMENTS
                            if a in signature.parameters]

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = _pending
        if (step is None or step.runner.cudagraph_manager is not self
                or not _plan_once(step, _v2_plan)):
            return original(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs)
        # Neither a uniform token count nor a query-length bound: no FULL decode graph matches,
        # PIECEWISE ones still do.
        for name in full_graph_arguments:
            call.arguments[name] = None
        desc = original(*call.args, **call.kwargs)
        from vllm.config import CUDAGraphMode

        if desc.cg_mode == CUDAGraphMode.FULL:  # a FULL graph for any batch: run eagerly instead
            desc = dataclasses.replace(desc, cg_mode=CUDAGraphMode.NONE,
                                       num_tokens=call.arguments["num_tokens"],
                                       num_reqs=call.arguments["num_reqs"])
        return desc
    return wrapper


# ------------------------------------------------------- whole-step graphs (CASCADE_FULL_GRAPHS)

_FULL = "_cascade_full_graphs"


def _full_graphs(runner: Any) -> Any:
    """The runner's whole-step graphs when ``CASCADE_FULL_GRAPHS`` is on and this engine can use
    them, else None (why not is logged once per runner)."""
    config = session.config
    if config is None or not config.full_graphs or not config.cuda_graphs:
        return None
    graphs = runner.__dict__.get(_FULL)
    if graphs is None:
        from .fullgraph import StepGraphs, unsupported_reason

        reason = unsupported_reason(runner.vllm_config)
        if reason is not None:
            stats.logger.info("vllm-cascade-plugin: cascade decode steps keep vLLM's piecewise "
                              "path and per-layer graphs, not whole-step graphs: %s.", reason)
        graphs = runner.__dict__[_FULL] = StepGraphs() if reason is None else False
    return None if graphs is False else graphs  # not `or`: a StepGraphs without graphs is falsy


def _parallel_sizes(runner: Any) -> tuple[int, ...]:
    parallel = runner.vllm_config.parallel_config
    return (parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
            parallel.data_parallel_size)


def _v1_model_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """V1: a cascade decode step's model call from a whole-step graph (``fullgraph``)."""
    signature = inspect.signature(original)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = _pending
        if step is None or step.runner is not self or not step.cascade:
            return original(self, *args, **kwargs)
        graphs = _full_graphs(self)
        if graphs is None:
            return original(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs)
        if call.arguments.get("model_kwargs"):
            return original(self, *args, **kwargs)
        from vllm.forward_context import get_forward_context

        inputs = {k: call.arguments.get(k) for k in
                  ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")}
        return graphs.run(lambda: original(self, *args, **kwargs), get_forward_context(),
                          inputs, _parallel_sizes(self), "v1")
    return wrapper


def _v2_run_pw_graph(original: Callable[..., Any]) -> Callable[..., Any]:
    """V2: a cascade decode step's piecewise model call from a whole-step graph."""

    def wrapper(self: Any, model: Any, model_inputs: dict[str, Any]) -> Any:
        step = _pending
        if (step is None or step.runner.cudagraph_manager is not self or not step.cascade
                or getattr(self, "use_breakable_cg", False)):
            return original(self, model, model_inputs)
        graphs = _full_graphs(step.runner)
        if graphs is None:
            return original(self, model, model_inputs)
        from vllm.forward_context import get_forward_context

        return graphs.run(lambda: original(self, model, model_inputs), get_forward_context(),
                          dict(model_inputs), _parallel_sizes(step.runner), "v2")
    return wrapper


def patch_targets() -> list[tuple[type, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    """(class, method, wrapper factory) for every patch; imports vLLM's runner modules."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    return [
        (V1Runner, "execute_model", _execute_model),
        (V1Runner, "_determine_batch_execution_and_padding", _v1_determine_batch_execution),
        (CudagraphDispatcher, "dispatch", _v1_dispatch),
        (BlockTables, "append_block_ids", _v2_append_block_ids),
        (V2Runner, "execute_model", _execute_model),
        (CudaGraphManager, "dispatch", _v2_dispatch),
        (V1Runner, "_model_forward", _v1_model_forward),
        (CudaGraphManager, "run_pw_graph", _v2_run_pw_graph),
    ]


def install() -> None:
    """Apply every patch (idempotent). Called when the backend module is imported in a worker."""
    for owner, name, make in patch_targets():
        _wrap(owner, name, make)
