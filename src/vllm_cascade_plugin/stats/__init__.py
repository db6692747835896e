"""Per-process counters of what the plugin did, how each planned step ended, and the "log once
per reason" rule.

Read them with :func:`snapshot` (tests, the periodic log line, metrics); what each counter is:
:class:`~.counters.Counters`. Pure stdlib here; the Prometheus counters live in
:mod:`vllm_cascade_plugin.stats.prometheus`, imported on first use.

A planned step (:func:`record_planned`) is *open* until :func:`end_step` ends it, or the next
step is planned. It ends as a cascade step when a builder ran cascade in it
(:func:`record_cascade`, counted once however many builders did), else as one flat step with one
reason: the step session's decision (:func:`flat_decision`), or else the first fallback recorded
while it was open, or else :data:`~.counters.UNUSED`. Its planning time (:func:`planning`) is one
sample of the planning histogram.

Every ``CASCADE_LOG_INTERVAL`` seconds (default 60, ``0`` = off) the first planned step after
the interval logs one INFO line with what happened since the last line; an idle worker logs
nothing. The clock is read once per planned step (a monotonic clock, ~50 ns).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .counters import PATH_OTHER, UNUSED, Counters, copy, difference, plain
from .histogram import bucket
from .line import format_line

__all__ = ["Counters", "end_step", "flat_decision", "format_line", "log_once", "logger",
           "page_bytes", "plain", "plan_path", "planning", "publish", "record_builder",
           "record_capture", "record_capture_cause", "record_capture_failure", "record_cascade",
           "record_fallback", "record_flat_step", "record_graphed_step", "record_planned",
           "record_planning", "reset", "set_graph_pool_bytes", "set_page_bytes", "snapshot"]

logger = logging.getLogger("vllm.cascade_plugin")


@dataclass(slots=True)
class _OpenStep:
    decode: bool
    reason: str | None = None  # why it runs flat, the first one said
    ratio: float | None = None  # the cascade/flat time the cost model predicted, if it decided
    cascade: bool = False
    planning_s: float = 0.0
    path: str | None = None  # how its planning went (counters.PLAN_PATHS), once known


_lock = threading.Lock()
_counters = Counters()
_logged: set[str] = set()
_open: _OpenStep | None = None  # the planned step that has not ended yet
_planning_depth = 0  # planning() blocks entered and not left (the outermost one counts)

# The periodic log line. Tests replace _clock with a fake one.
_clock: Callable[[], float] = time.monotonic
_page_bytes = 0  # bytes of one KV page over every layer a plan serves; 0 = unknown
_interval_s: float | None = None  # CASCADE_LOG_INTERVAL, read on the first planned step
_next_log = 0.0
_last_logged = Counters()
_metrics: Any = None  # prometheus.PrometheusCounters once created; False when unavailable
# The counters as last published to the metrics, and how often a thread publishes (a step
# counts in plain Python; the metrics' writes would cost it tens of µs: prometheus.py).
PUBLISH_S = 0.5
_published = Counters()
_publish_lock = threading.Lock()
_publishing = False  # whether this process's publisher thread runs


def set_page_bytes(page_bytes: int) -> None:
    """Bytes one KV page holds across all the layers a step's plan serves (K and V).

    The metadata builder knows them: ``kv_cache_spec.page_size_bytes * len(layer_names)``.
    Until set, the log line and metrics report pages but no bytes.
    """
    global _page_bytes
    _page_bytes = int(page_bytes)


def page_bytes() -> int:
    return _page_bytes


def record_planned(decode: bool) -> None:
    """A real step was planned: the open step ends, this one is open until it ends."""
    _open_step(_OpenStep(decode))


def record_flat_step(decode: bool, path: str, reason: str, ratio: float | None = None) -> None:
    """A real step was planned and runs flat: :func:`record_planned`, :func:`plan_path` and
    :func:`flat_decision` in one call (a step that stops at a pre-check takes one lock, not
    three)."""
    _open_step(_OpenStep(decode, reason, ratio, path=path))


def _open_step(step: _OpenStep) -> None:
    global _open
    now = _clock()
    with _lock:
        _end_locked()
        line = _due_line(now)  # the steps before this one, every one ended
        _counters.steps_planned += 1
        _counters.decode_steps_planned += step.decode
        _open = step
    if _metrics is None:
        _sink()
    elif _metrics and not _publishing:  # a forked child: its own thread
        _start_publisher()
    if line is not None:
        logger.info(*line)


def end_step() -> None:
    """The open step (if any) ends: counted as cascade or flat with its reason."""
    with _lock:
        _end_locked()


def _end_locked() -> None:
    """Under the lock: end the open step."""
    global _open
    step, _open = _open, None
    if step is None:
        return
    _counters.planning_buckets[bucket(step.planning_s)] += 1
    path = step.path or PATH_OTHER
    _counters.planning_paths[path] += 1
    _counters.planning_path_s[path] = _counters.planning_path_s.get(path, 0.0) + step.planning_s
    if step.cascade:
        return
    reason = step.reason or UNUSED
    _counters.flat_reasons[reason] += 1
    if step.decode:
        _counters.decode_flat_reasons[reason] += 1
    if step.ratio is not None:
        ratios = _counters.flat_cost_ratio
        ratios[reason] = ratios.get(reason, 0.0) + step.ratio


def plan_path(path: str) -> None:
    """How the open step's planning went (one of ``counters.PLAN_PATHS``); the last said
    counts."""
    with _lock:
        if _open is not None:
            _open.path = path


def flat_decision(reason: str, ratio: float | None = None) -> None:
    """The open step runs flat for ``reason``, as the step session decided (``ratio``: the
    cascade/flat time the cost model predicted, where it decided)."""
    with _lock:
        if _open is not None and _open.reason is None:
            _open.reason, _open.ratio = reason, ratio


def record_cascade(pages_flat: int, pages_cascade: int, decode: bool) -> None:
    """A builder runs the open step's plan as cascade. Counted once per step: every builder
    that runs it runs the same plan, whose pages are those of all their layers."""
    with _lock:
        if _open is not None:
            if _open.cascade:
                return
            _open.cascade = True
        _counters.steps_cascade += 1
        _counters.decode_steps_cascade += decode
        _counters.pages_flat += pages_flat
        _counters.pages_cascade += pages_cascade


def record_graphed_step() -> None:
    """A cascade decode step whose attention replayed a CUDA graph (once per step)."""
    with _lock:
        _counters.decode_steps_graphed += 1


def record_capture(seconds: float) -> None:
    """A CUDA graph captured, taking ``seconds`` of the step that captured it."""
    with _lock:
        _counters.graph_captures += 1
        _counters.graph_capture_s += seconds


def capture_seconds() -> float:
    """Seconds spent capturing CUDA graphs so far (a float read: no lock)."""
    return _counters.graph_capture_s


def record_capture_cause(cause: str) -> None:
    """A whole-step CUDA graph was captured because ``cause`` was new in its key."""
    with _lock:
        _counters.full_graph_capture_causes[cause] += 1


def set_graph_pool_bytes(total: int) -> None:
    """GPU memory all of the plugin's CUDA-graph pools in this process hold now."""
    with _lock:
        _counters.graph_pool_bytes = int(total)


def record_planning(seconds: float, cpu_seconds: float = 0.0) -> None:
    """Host time spent planning the open step (or a step that never opened), and of it the
    time the thread ran on a CPU."""
    with _lock:
        _counters.planning_s += seconds
        _counters.planning_cpu_s += cpu_seconds
        if _open is not None:
            _open.planning_s += seconds


class _Planning:
    """:func:`planning`'s block: a plain context manager, which costs a step a few µs less
    than a generator's (every planned step enters one)."""

    __slots__ = ("cpu", "start")

    def __enter__(self) -> None:
        global _planning_depth
        _planning_depth += 1
        if _planning_depth == 1:
            self.start, self.cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc: object) -> None:
        global _planning_depth
        _planning_depth -= 1
        if _planning_depth == 0:  # the outermost block times it
            record_planning(time.perf_counter() - self.start, time.thread_time() - self.cpu)


_planning_block = _Planning()


def planning() -> _Planning:
    """Count the block's host time as planning (:func:`record_planning`); a block inside
    another is part of the outer one's time. For the worker's step thread only."""
    return _planning_block


def record_builder(seconds: float, staging_seconds: float = 0.0,
                   cpu_seconds: float = 0.0, launch_seconds: float = 0.0) -> None:
    """Host time a metadata builder spent planning its executor for a cascade step; of it,
    ``staging_seconds`` staging the plan for the device (pinned copies, upload launches), of
    that ``launch_seconds`` in the launches, and ``cpu_seconds`` the time its thread ran on a
    CPU."""
    with _lock:
        _counters.builder_s += seconds
        _counters.builder_staging_s += staging_seconds
        _counters.builder_launch_s += launch_seconds
        _counters.builder_cpu_s += cpu_seconds


def record_capture_failure() -> None:
    with _lock:
        _counters.graph_capture_failures += 1


def record_fallback(reason: str, detail: str = "", *, level: int = logging.WARNING) -> None:
    """Count a fallback to flat attention (a step's, a builder's or a layer call's) for
    ``reason``; the open step's flat reason unless it has one; log the first of each reason."""
    with _lock:
        _counters.fallbacks[reason] += 1
        if _open is not None and _open.reason is None:
            _open.reason = reason
        first = reason not in _logged
        _logged.add(reason)
    if first:
        logger.log(level, "vllm-cascade-plugin: falling back to flat attention (%s)%s; "
                   "logged once per reason.", reason, f": {detail}" if detail else "")


def log_once(key: str, message: str, *args: object, level: int = logging.INFO) -> None:
    with _lock:
        first = key not in _logged
        _logged.add(key)
    if first:
        logger.log(level, message, *args)


def snapshot() -> Counters:
    """A copy of the counters; what they counted is published to the metrics first."""
    publish()
    with _lock:
        return copy(_counters)


def publish() -> None:
    """Add what was counted since the last publication to the Prometheus metrics (where they
    exist): the publisher thread's every :data:`PUBLISH_S`, :func:`snapshot` and the process's
    exit call it."""
    global _published
    sink = _sink()
    if sink is None:
        return
    with _publish_lock:
        with _lock:
            since = difference(_counters, _published)
            _published = copy(_counters)
        try:
            sink.publish(since, _page_bytes)
        except Exception as exc:  # metrics are a convenience: never fail a step for them
            log_once("metrics failed", "vllm-cascade-plugin: Prometheus metrics not updated "
                     "(%s: %s).", type(exc).__name__, exc, level=logging.WARNING)


def _publisher() -> None:
    while True:
        time.sleep(PUBLISH_S)
        publish()


def _start_publisher() -> None:
    global _publishing
    _publishing = True
    threading.Thread(target=_publisher, name="vllm-cascade-metrics", daemon=True).start()


def _forked_child() -> None:
    """A forked process has no publisher thread and must not publish its parent's counts
    again (prometheus_client's multiprocess values follow the new pid by themselves): the
    child's first planned step starts its own thread. Its locks are new: a thread of the
    parent (the publisher) may have held one at the fork."""
    global _lock, _published, _publish_lock, _publishing
    _lock, _publish_lock, _publishing = threading.Lock(), threading.Lock(), False
    _published = copy(_counters)


os.register_at_fork(after_in_child=_forked_child)


def reset() -> None:
    """Forget counts, the open step, logged reasons and the log line's timer (tests)."""
    global _counters, _interval_s, _last_logged, _open, _planning_depth, _published
    publish()  # the metrics keep what was counted before
    with _lock:
        _counters = Counters()
        _published = Counters()
        _open = None
        _planning_depth = 0
        _logged.clear()
        _interval_s = None
        _last_logged = Counters()


def _sink() -> Any:
    """The Prometheus counters, created on first use; None when prometheus_client is missing."""
    global _metrics
    if _metrics is None:
        try:
            from .prometheus import PrometheusCounters

            _metrics = PrometheusCounters()
            _start_publisher()
            atexit.register(publish)
        except Exception as exc:  # metrics are a convenience: never fail a step for them
            _metrics = False
            logger.info("vllm-cascade-plugin: no Prometheus metrics in this process (%s: %s).",
                        type(exc).__name__, exc)
    return _metrics or None


def _due_line(now: float) -> tuple[object, ...] | None:
    """Under the lock: the log line's arguments when one is due, else None."""
    global _interval_s, _next_log, _last_logged
    if _interval_s is None:
        _interval_s = _read_interval()
        _next_log = now + _interval_s
        _last_logged = copy(_counters)
        return None
    if _interval_s <= 0 or now < _next_log:
        return None
    elapsed = now - (_next_log - _interval_s)
    since = difference(_counters, _last_logged)
    _last_logged = copy(_counters)
    _next_log = now + _interval_s
    return format_line(since, _counters, elapsed, _page_bytes)


def _read_interval() -> float:
    from ..config import ConfigError, load_config

    try:
        return load_config().log_interval_s
    except ConfigError:  # vLLM has already refused to start with it; stay quiet
        return 0.0
