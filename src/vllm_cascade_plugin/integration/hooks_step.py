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

from .. import stats
from ..step import session
from . import row_keys


class PendingStep:
    def __init__(self, runner: Any, scheduler_output: Any) -> None:
        self.runner, self.scheduler_output = runner, scheduler_output
        self.cascade: bool | None = None  # planned yet, and its verdict


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
