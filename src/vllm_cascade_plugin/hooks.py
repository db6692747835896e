"""Every runtime patch the plugin makes to vLLM's model runners, in one place.

Why patches at all: vLLM's metadata builder learns of a step only after the step's CUDA-graph
mode is fixed, gets block ids only as a GPU tensor, and never passes a common prefix (0.32+ have
no cascade at all). So a small wrapper in each runner plans the step on the CPU first, and forbids
a FULL graph replay (which would skip our attention Python) only on steps that will run cascade.
Steps without sharing keep exactly the graphs vLLM would use without the plugin.

Each wrapper calls the original exactly once, never replaces it, and passes its result or
exception through unchanged; its own failures are counted, logged once, and cost the step its
cascade, never the engine. Every patched method exists with the arguments we read in vLLM 0.26
through 0.33; what differs between releases is asked of :mod:`.compat`. The list is mirrored in
the README and guarded by ``tests/test_hooks.py``, which compares each patched method's whole
parameter list with the one recorded for the release and fails loudly on any change.

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


# Every wrapper below keeps to one pattern: its own code runs inside ``try``, the original runs
# outside it, exactly once, and its result or exception passes through unchanged. When the
# wrapper's own code fails, it makes vLLM's call as it came, counts the failure (_failed), and
# where vLLM is then free to pick a FULL graph for the step, makes the step flat (_run_flat): a
# FULL graph replays vLLM's flat attention, so no builder may get a cascade plan then.


def _failed(where: str, exc: BaseException) -> None:
    """Count a failure of a wrapper's own code (logged the first time). Never raises."""
    try:
        stats.record_fallback("runner hook error", f"{where}: {type(exc).__name__}: {exc}")
    except Exception:  # the counters themselves: nothing else to do
        pass


def _run_flat(step: _PendingStep | None) -> None:
    """The current step runs vLLM's flat attention, whatever was planned. Plain assignments:
    what runs when the rest of a wrapper failed must not fail itself."""
    if step is not None:
        step.cascade = False
    session.current = None


def _cascade_call(where: str, step: _PendingStep | None,
                  make: Callable[[], inspect.BoundArguments | None],
                  ) -> inspect.BoundArguments | None:
    """``make()``: a dispatch wrapper's changed call for a cascade step, or None for vLLM's call
    as it came; also None, with the step flat and the failure counted, when ``make`` fails (vLLM
    may then pick a FULL graph)."""
    try:
        return make()
    except Exception as exc:
        _run_flat(step)
        _failed(where, exc)
        return None


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
            _run_flat(step)
            stats.record_fallback("runner hook error", f"{type(exc).__name__}: {exc}")
    return bool(step.cascade)


def _end_step() -> None:
    """Forget the step and its plan (the end of execute_model). Never raises: it runs in a
    ``finally`` that must leave vLLM's result or exception as it is."""
    global _pending
    _pending = None
    try:
        session.end_step()
    except Exception as exc:
        session.current = None
        _failed("execute_model", exc)


def _execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """Both runners: a real step is pending while it runs; its plan ends with it."""
    signature = inspect.signature(original)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _pending
        try:
            call = signature.bind(self, *args, **kwargs)
            # V2 runs its profile and CUDA-graph capture steps through here too, as dummy runs.
            real = session.active and not call.arguments.get("dummy_run", False)
            _pending = _PendingStep(self, call.arguments["scheduler_output"]) if real else None
        except Exception as exc:  # no step pending: nothing plans, every step runs flat
            _pending = None
            _failed("execute_model", exc)
        try:
            return original(self, *args, **kwargs)
        finally:
            _end_step()
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
        try:
            if step is not None and step.runner is self:
                _plan_once(step, _v1_plan)
        except Exception as exc:
            _run_flat(step)
            _failed("_determine_batch_execution_and_padding", exc)
        return original(self, *args, **kwargs)
    return wrapper


def _v1_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def cascade_call(step: _PendingStep | None, self: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> inspect.BoundArguments | None:
        """The call that keeps a cascade step off FULL graphs; None: vLLM's call as it came."""
        if step is None or not step.cascade or step.runner.cudagraph_dispatcher is not self:
            return None
        call = signature.bind(self, *args, **kwargs)
        # A re-dispatch to the mode data-parallel ranks agreed on (valid_modes) stays as it is.
        if call.arguments.get("valid_modes") is None:
            from vllm.config import CUDAGraphMode

            call.arguments["invalid_modes"] = {
                CUDAGraphMode.FULL, *(call.arguments.get("invalid_modes") or ())}
        return call

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = _pending
        call = _cascade_call("CudagraphDispatcher.dispatch", step,
                             lambda: cascade_call(step, self, args, kwargs))
        if call is None:
            return original(self, *args, **kwargs)
        result = original(*call.args, **call.kwargs)
        _record_padding(lambda: result[1].num_tokens)
        return result
    return wrapper


def _record_padding(num_tokens: Callable[[], int]) -> None:
    """Tell the session the token count vLLM padded a cascade step to (the rows of its
    tensors, what a graphed step runs); on any surprise, 0 (no padding used). Never raises."""
    try:
        session.padded_tokens = int(num_tokens())
    except Exception as exc:
        session.padded_tokens = 0
        try:
            stats.log_once("padding unknown", "vllm-cascade-plugin: vLLM's padded token count "
                           "is not readable here (%s: %s); graphed cascade steps run unpadded.",
                           type(exc).__name__, exc)
        except Exception:
            pass


# ----------------------------------------------------------------------------------- V2 runner

_MIRROR = "_cascade_block_ids"


def _mirror_failed(tables: Any, exc: BaseException) -> None:
    """Never plan from a mirror that missed a write: no V2 step plans from now on. Never
    raises."""
    try:
        tables.__dict__[_MIRROR] = False
        stats.record_fallback("block id mirror error", f"{type(exc).__name__}: {exc}")
    except Exception:
        pass


def _v2_append_block_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, req_index: int, new_block_ids: Any, overwrite: bool) -> Any:
        start: int | None
        try:  # where the ids go: the row's length before vLLM's write
            start = 0 if overwrite else int(self.num_blocks.np[0, req_index])
        except Exception as exc:
            start = None
            _mirror_failed(self, exc)
        result = original(self, req_index, new_block_ids, overwrite)
        if start is None:
            return result
        try:
            mirror = self.__dict__.get(_MIRROR)
            if mirror is False:  # a write was missed before: the mirror stays unusable
                return result
            if mirror is None:
                mirror = np.zeros(tuple(self.block_tables[0].gpu.shape), dtype=np.int32)
                self.__dict__[_MIRROR] = mirror
            ids = compat.v2_block_ids_written(self, 0, new_block_ids[0])
            mirror[req_index, start:start + len(ids)] = ids
        except Exception as exc:
            _mirror_failed(self, exc)
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

    def cascade_call(step: _PendingStep | None, self: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> inspect.BoundArguments | None:
        """The call that matches no FULL decode graph, on a cascade step (planned here); None:
        vLLM's call as it came."""
        if (step is None or step.runner.cudagraph_manager is not self
                or not _plan_once(step, _v2_plan)):
            return None
        call = signature.bind(self, *args, **kwargs)
        # Neither a uniform token count nor a query-length bound: no FULL decode graph matches,
        # PIECEWISE ones still do.
        for name in full_graph_arguments:
            call.arguments[name] = None
        return call

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = _pending
        call = _cascade_call("CudaGraphManager.dispatch", step,
                             lambda: cascade_call(step, self, args, kwargs))
        if call is None:
            return original(self, *args, **kwargs)
        desc = original(*call.args, **call.kwargs)
        try:
            from vllm.config import CUDAGraphMode

            if desc.cg_mode == CUDAGraphMode.FULL:  # a FULL graph for any batch: eager instead
                desc = dataclasses.replace(desc, cg_mode=CUDAGraphMode.NONE,
                                           num_tokens=call.arguments["num_tokens"],
                                           num_reqs=call.arguments["num_reqs"])
        except Exception as exc:  # vLLM's choice stands, perhaps a FULL graph: run flat
            _run_flat(step)
            _failed("CudaGraphManager.dispatch", exc)
            return desc
        _record_padding(lambda: desc.num_tokens)
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


def _capturing() -> bool:
    """Whether this thread's stream is capturing a CUDA graph (False where CUDA never started)."""
    try:
        import torch

        return bool(torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


class _ModelCall:
    """The runner's model call, handed to the whole-step graphs, which run it, capture it or
    replay its graph: what its last run returned or raised, and whether inside a capture (where
    it computes nothing until the graph is replayed)."""

    def __init__(self, forward: Callable[[], Any]) -> None:
        self.forward = forward
        self.captured = False
        self.completed = False  # returned outside a capture: its result is this step's output
        self.result: Any = None
        self.error: BaseException | None = None

    def __call__(self) -> Any:
        self.captured, self.completed, self.error = _capturing(), False, None
        try:
            self.result = self.forward()
        except BaseException as exc:
            self.error = exc
            raise
        self.completed = not self.captured
        return self.result


def _through_graphs(graphs: Any, forward: Callable[[], Any], ctx: Any, inputs: dict[str, Any],
                    parallel_sizes: tuple[int, ...], tag: str, where: str) -> Any:
    """``forward()`` by way of the whole-step graphs; if their code fails, ``forward()`` once
    more only when no run of it finished outside a capture (a capture computes nothing, and a
    finished run's result is the step's), and ``forward()``'s own exception as it is."""
    call = _ModelCall(forward)
    try:
        return graphs.run(call, ctx, inputs, parallel_sizes, tag)
    except Exception as exc:
        if exc is call.error and not call.captured:
            raise  # the model's own failure, not the graphs'
        _failed(where, exc)
    return call.result if call.completed else forward()


def _v1_model_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """V1: a cascade decode step's model call from a whole-step graph (``fullgraph``)."""
    signature = inspect.signature(original)

    def graphed(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """What the graphs run this call with; None: vLLM's call as it came."""
        step = _pending
        if step is None or step.runner is not self or not step.cascade:
            return None
        graphs = _full_graphs(self)
        if graphs is None:
            return None
        call = signature.bind(self, *args, **kwargs)
        if call.arguments.get("model_kwargs"):
            return None
        from vllm.forward_context import get_forward_context

        inputs = {k: call.arguments.get(k) for k in
                  ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")}
        return graphs, get_forward_context(), inputs, _parallel_sizes(self)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            found = graphed(self, args, kwargs)
        except Exception as exc:
            _failed("_model_forward", exc)
            found = None
        if found is None:
            return original(self, *args, **kwargs)
        graphs, ctx, inputs, sizes = found
        return _through_graphs(graphs, lambda: original(self, *args, **kwargs), ctx, inputs,
                               sizes, "v1", "_model_forward")
    return wrapper


def _v2_run_pw_graph(original: Callable[..., Any]) -> Callable[..., Any]:
    """V2: a cascade decode step's piecewise model call from a whole-step graph."""

    def graphed(self: Any, model_inputs: dict[str, Any]) -> tuple[Any, ...] | None:
        """What the graphs run this call with; None: vLLM's call as it came."""
        step = _pending
        if (step is None or step.runner.cudagraph_manager is not self or not step.cascade
                or getattr(self, "use_breakable_cg", False)):
            return None
        graphs = _full_graphs(step.runner)
        if graphs is None:
            return None
        from vllm.forward_context import get_forward_context

        return graphs, get_forward_context(), dict(model_inputs), _parallel_sizes(step.runner)

    def wrapper(self: Any, model: Any, model_inputs: dict[str, Any]) -> Any:
        try:
            found = graphed(self, model_inputs)
        except Exception as exc:
            _failed("run_pw_graph", exc)
            found = None
        if found is None:
            return original(self, model, model_inputs)
        graphs, ctx, inputs, sizes = found
        return _through_graphs(graphs, lambda: original(self, model, model_inputs), ctx, inputs,
                               sizes, "v2", "run_pw_graph")
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
