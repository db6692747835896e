"""The engine step in flight, as every runner hook sees it, and the rules the hooks keep.

``execute_model`` (both runners) makes a real step :data:`pending` while it runs and forgets it,
with its plan, when it ends; the dispatch wrappers (:mod:`.hooks_dispatch`) plan it and the
whole-step graph wrappers (:mod:`.hooks_graphs`) run it.

Every wrapper keeps to one pattern: its own code runs inside ``try``, the original runs outside
it, exactly once, and its result or exception passes through unchanged. When the wrapper's own
code fails, it makes vLLM's call as it came, counts the failure (:func:`failed`), and where vLLM
is then free to pick a FULL graph for the step, makes the step flat (:func:`run_flat`): a FULL
graph replays vLLM's flat attention, so no builder may get a cascade plan then.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import stats
from ..step import session
from . import compat, row_keys

ROWS_DIFFER = "planned rows are not the batch's rows"
FULL_GRAPH = "cascade step dispatched to a FULL CUDA graph"


class PendingStep:
    def __init__(self, runner: Any, scheduler_output: Any) -> None:
        self.runner, self.scheduler_output = runner, scheduler_output
        self.cascade: bool | None = None  # planned yet, and its verdict
        # Who each planned row is, in the planned order: Model Runner V2's request-state
        # indices (int64), V1's request ids (a list); None: not planned.
        self.rows: np.ndarray | list[str] | None = None
        # The CUDA-graph mode vLLM dispatched the step to (CUDAGraphMode's name); None: not
        # dispatched yet.
        self.graph_mode: str | None = None
        self.vllm_order: np.ndarray | None = None  # V2 before 0.30: vLLM's batch order, once read


pending: PendingStep | None = None  # the real step this process's runner is executing


def failed(where: str, exc: BaseException) -> None:
    """Count a failure of a wrapper's own code (logged the first time). Never raises."""
    try:
        stats.record_fallback("runner hook error", f"{where}: {type(exc).__name__}: {exc}")
    except Exception:  # the counters themselves: nothing else to do
        pass


def run_flat(step: PendingStep | None) -> None:
    """The current step runs vLLM's flat attention, whatever was planned. Plain assignments:
    what runs when the rest of a wrapper failed must not fail itself."""
    if step is not None:
        step.cascade = False
    session.current = None


def note_graph_mode(step: PendingStep | None, mode: Callable[[], Any]) -> None:
    """The CUDA-graph mode vLLM dispatched ``step`` to (``mode()``, a ``CUDAGraphMode``). Never
    raises: an unreadable mode stays unknown, which keeps the step flat
    (:func:`runs_as_planned`)."""
    if step is None:
        return
    try:
        name = mode().name
    except Exception:
        name = None
    step.graph_mode = name if isinstance(name, str) else None


def _end_step() -> None:
    """Forget the step and its plan (the end of execute_model). Never raises: it runs in a
    ``finally`` that must leave vLLM's result or exception as it is."""
    global pending
    pending = None
    try:
        session.end_step()
    except Exception as exc:
        session.current = None
        failed("execute_model", exc)


def batch_rows(step: PendingStep, common_attn_metadata: Any) -> np.ndarray | list[str]:
    """Who each row of the batch a builder is given is, as :attr:`PendingStep.rows` says it:
    Model Runner V2's ``idx_mapping`` (``common_attn_metadata.req_idx``, 0.30+; before, the
    request-state indices of vLLM's own batch order of the step, ``sort_batch_req_ids``); V1's
    ``input_batch.req_ids``."""
    runner = step.runner
    req_idx = getattr(common_attn_metadata, "req_idx", None)
    if req_idx is not None:
        return np.asarray(req_idx)
    if not hasattr(runner, "req_states"):  # Model Runner V1
        return list(runner.input_batch.req_ids)
    if step.vllm_order is None:  # once per step, whatever the number of builders
        order = compat.v2_batch_order(runner, step.scheduler_output)
        step.vllm_order = np.fromiter(map(runner.req_states.req_id_to_index.__getitem__, order),
                                      dtype=np.int64, count=len(order))
    return step.vllm_order


def _first_difference(planned: np.ndarray | list[str],
                      batch: np.ndarray | list[str]) -> str | None:
    """Where the batch's rows differ from the planned ones (None: they are the same)."""
    n = len(planned)
    if len(batch) < n:
        return f"{n} rows planned, the batch has {len(batch)}"
    head = batch[:n]
    if isinstance(planned, np.ndarray):
        same = np.asarray(head) == planned
        if bool(np.all(same)):
            return None
        row = int(np.argmin(same))
    else:
        if list(head) == planned:
            return None
        row = next(i for i, (a, b) in enumerate(zip(planned, head, strict=True)) if a != b)
    return f"row {row} of {n}: planned {_shown(planned[row])}, the batch's {_shown(head[row])}"


def _shown(value: Any) -> str:
    return repr(value.item() if isinstance(value, np.generic) else value)


def runs_as_planned(common_attn_metadata: Any) -> bool:
    """Whether a builder may hand out the cascade metadata of the step the hooks planned for the
    batch it is given: the batch's rows are the planned rows, by identity (two rows of equal
    lengths would otherwise read each other's KV), and vLLM dispatched the step to no FULL CUDA
    graph (whose replay would run the flat attention it captured, with the wrappers holding an
    older step's plan). False: counted, logged once with what differed; the builder builds flat
    metadata. A plan made without the hooks (the tests' and benchmarks' sessions) has nothing
    to check. Never raises."""
    step = pending
    if step is None or step.rows is None:
        return True
    try:
        if step.graph_mode is None or step.graph_mode == "FULL":
            stats.record_fallback(FULL_GRAPH, f"vLLM's mode: {step.graph_mode or 'unknown'}")
            return False
        differs = _first_difference(step.rows, batch_rows(step, common_attn_metadata))
    except Exception as exc:
        differs = f"the batch's rows cannot be read ({type(exc).__name__}: {exc})"
    if differs is not None:
        stats.record_fallback(ROWS_DIFFER, differs)
        return False
    return True


def execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """Both runners: a real step is pending while it runs; its plan ends with it."""
    signature = inspect.signature(original)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        global pending
        try:
            call = signature.bind(self, *args, **kwargs)
            # V2 runs its profile and CUDA-graph capture steps through here too, as dummy runs.
            real = session.active and not call.arguments.get("dummy_run", False)
            pending = PendingStep(self, call.arguments["scheduler_output"]) if real else None
            if pending is not None:  # every real step: the rows vLLM writes anew
                row_keys.note_step(self, pending.scheduler_output)
        except Exception as exc:  # no step pending: nothing plans, every step runs flat
            pending = None
            row_keys.forget(self)
            failed("execute_model", exc)
        try:
            return original(self, *args, **kwargs)
        finally:
            _end_step()
    return wrapper
