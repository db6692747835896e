"""Per-process counters of what the plugin did, and the "log once per reason" rule.

Read them with :func:`snapshot` (tests, the periodic log line, metrics). Pure stdlib here; the
Prometheus counters live in :mod:`vllm_cascade_plugin.stats.prometheus`, imported on first use.

Every ``CASCADE_LOG_INTERVAL`` seconds (default 60, ``0`` = off) the first planned step after
the interval logs one INFO line with what happened since the last line; an idle worker logs
nothing. The clock is read once per planned step (a monotonic clock, ~50 ns).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

logger = logging.getLogger("vllm.cascade_plugin")


@dataclass
class Counters:
    steps_planned: int = 0  # real engine steps the planner looked at
    steps_cascade: int = 0  # steps whose attention ran as cascade
    decode_steps_planned: int = 0  # of those planned: pure-decode steps (one token per row)
    decode_steps_cascade: int = 0  # of those run as cascade: pure-decode steps
    decode_steps_graphed: int = 0  # of those: replayed from a CUDA graph (whole step or layers)
    graph_capture_failures: int = 0  # CUDA-graph captures that failed (each turns graphs off)
    graph_captures: int = 0  # CUDA graphs the plugin captured (whole steps or single layers)
    graph_capture_s: float = 0.0  # host time those captures took: the steps they delayed
    planning_s: float = 0.0  # host time the planner took on the planned steps
    graph_pool_bytes: int = 0  # GPU memory the plugin's CUDA-graph pools hold now (a level)
    pages_flat: int = 0  # KV pages flat attention would have read, over cascade steps
    pages_cascade: int = 0  # KV pages the cascade read instead, over cascade steps
    fallbacks: Counter[str] = field(default_factory=Counter)  # steps run flat, by reason


_lock = threading.Lock()
_counters = Counters()
_logged: set[str] = set()

# The periodic log line. Tests replace _clock with a fake one.
_clock: Callable[[], float] = time.monotonic
_page_bytes = 0  # bytes of one KV page over every layer a plan serves; 0 = unknown
_interval_s: float | None = None  # CASCADE_LOG_INTERVAL, read on the first planned step
_next_log = 0.0
_last_logged = Counters()
_metrics: Any = None  # prometheus.PrometheusCounters once created; False when unavailable


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
    now = _clock()
    with _lock:
        line = _due_line(now)  # the steps before this one, whose cascade counts are complete
        _counters.steps_planned += 1
        _counters.decode_steps_planned += decode
    sink = _sink()
    if sink is not None:
        sink.planned(decode)
    if line is not None:
        logger.info(*line)


def record_cascade(pages_flat: int, pages_cascade: int, decode: bool) -> None:
    with _lock:
        _counters.steps_cascade += 1
        _counters.decode_steps_cascade += decode
        _counters.pages_flat += pages_flat
        _counters.pages_cascade += pages_cascade
    sink = _sink()
    if sink is not None:
        sink.cascade(pages_flat, pages_cascade, decode, _page_bytes)


def record_graphed_step() -> None:
    """A cascade decode step whose attention replayed a CUDA graph (once per step)."""
    with _lock:
        _counters.decode_steps_graphed += 1
    sink = _sink()
    if sink is not None:
        sink.graphed()


def record_capture(seconds: float) -> None:
    """A CUDA graph captured, taking ``seconds`` of the step that captured it."""
    with _lock:
        _counters.graph_captures += 1
        _counters.graph_capture_s += seconds
    sink = _sink()
    if sink is not None:
        sink.captured(seconds)


def set_graph_pool_bytes(total: int) -> None:
    """GPU memory all of the plugin's CUDA-graph pools in this process hold now."""
    with _lock:
        _counters.graph_pool_bytes = int(total)
    sink = _sink()
    if sink is not None:
        sink.pool_bytes(total)


def record_planning(seconds: float) -> None:
    """Host time one planned step spent in the planner and the cost model."""
    with _lock:
        _counters.planning_s += seconds
    sink = _sink()
    if sink is not None:
        sink.planning(seconds)


def record_capture_failure() -> None:
    with _lock:
        _counters.graph_capture_failures += 1
    sink = _sink()
    if sink is not None:
        sink.capture_failure()


def record_fallback(reason: str, detail: str = "", *, level: int = logging.WARNING) -> None:
    """Count a step (or layer) that ran flat for ``reason``; log the first one of each reason."""
    with _lock:
        _counters.fallbacks[reason] += 1
        first = reason not in _logged
        _logged.add(reason)
    sink = _sink()
    if sink is not None:
        sink.fallback(reason)
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
    with _lock:
        return _copy(_counters)


def reset() -> None:
    """Forget counts, logged reasons and the log line's timer (tests)."""
    global _counters, _interval_s, _last_logged
    with _lock:
        _counters = Counters()
        _logged.clear()
        _interval_s = None
        _last_logged = Counters()


def _copy(counters: Counters) -> Counters:
    return replace(counters, fallbacks=Counter(counters.fallbacks))


def _sink() -> Any:
    """The Prometheus counters, created on first use; None when prometheus_client is missing."""
    global _metrics
    if _metrics is None:
        try:
            from .prometheus import PrometheusCounters

            _metrics = PrometheusCounters()
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
        _last_logged = _copy(_counters)
        return None
    if _interval_s <= 0 or now < _next_log:
        return None
    elapsed = now - (_next_log - _interval_s)
    since = _difference(_counters, _last_logged)
    _last_logged = _copy(_counters)
    _next_log = now + _interval_s
    return format_line(since, _counters, elapsed, _page_bytes)


def _read_interval() -> float:
    from ..config import ConfigError, load_config

    try:
        return load_config().log_interval_s
    except ConfigError:  # vLLM has already refused to start with it; stay quiet
        return 0.0


def _difference(now: Counters, before: Counters) -> Counters:
    return Counters(
        steps_planned=now.steps_planned - before.steps_planned,
        steps_cascade=now.steps_cascade - before.steps_cascade,
        decode_steps_planned=now.decode_steps_planned - before.decode_steps_planned,
        decode_steps_cascade=now.decode_steps_cascade - before.decode_steps_cascade,
        decode_steps_graphed=now.decode_steps_graphed - before.decode_steps_graphed,
        graph_capture_failures=now.graph_capture_failures - before.graph_capture_failures,
        graph_captures=now.graph_captures - before.graph_captures,
        graph_capture_s=now.graph_capture_s - before.graph_capture_s,
        planning_s=now.planning_s - before.planning_s,
        graph_pool_bytes=now.graph_pool_bytes,  # a level, not a count
        pages_flat=now.pages_flat - before.pages_flat,
        pages_cascade=now.pages_cascade - before.pages_cascade,
        fallbacks=now.fallbacks - before.fallbacks,
    )


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_line(since: Counters, total: Counters, elapsed_s: float,
                page_bytes: int) -> tuple[object, ...]:
    """The periodic log line as ``logger.info`` arguments (a format string, then values)."""
    fallbacks = ", ".join(f"{reason} {n}" for reason, n in sorted(since.fallbacks.items()))
    saved = since.pages_flat - since.pages_cascade
    if page_bytes:
        total_saved = (total.pages_flat - total.pages_cascade) * page_bytes
        kv = f"{_bytes(saved * page_bytes)} saved ({_bytes(total_saved)} since start)"
    else:
        kv = "bytes unknown (page size not set)"
    return ("vllm-cascade-plugin: last %.0f s: %d steps, %s ran cascade (decode steps: %s, "
            "%s of them from CUDA graphs; %d graphs captured in %.2f s; planning %.2f s); "
            "fallbacks: %s; KV pages read on cascade steps: %s instead of %s flat, %s.",
            elapsed_s, since.steps_planned, _percent(since.steps_cascade, since.steps_planned),
            _percent(since.decode_steps_cascade, since.decode_steps_planned),
            _percent(since.decode_steps_graphed, since.decode_steps_cascade),
            since.graph_captures, since.graph_capture_s, since.planning_s, fallbacks or "none",
            f"{since.pages_cascade:,}", f"{since.pages_flat:,}", kv)
