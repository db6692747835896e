"""Per-process counters of what the plugin did, and the "log once per reason" rule.

Read them with :func:`snapshot` (tests, the periodic log line, metrics). Pure stdlib.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field, replace

logger = logging.getLogger("vllm.cascade_plugin")


@dataclass
class Counters:
    steps_planned: int = 0  # real engine steps the planner looked at
    steps_cascade: int = 0  # steps whose attention ran as cascade
    decode_steps_planned: int = 0  # of those planned: pure-decode steps (one token per row)
    decode_steps_cascade: int = 0  # of those run as cascade: pure-decode steps
    pages_flat: int = 0  # KV pages flat attention would have read, over cascade steps
    pages_cascade: int = 0  # KV pages the cascade read instead, over cascade steps
    fallbacks: Counter[str] = field(default_factory=Counter)  # steps run flat, by reason


_lock = threading.Lock()
_counters = Counters()
_logged: set[str] = set()


def record_planned(decode: bool) -> None:
    with _lock:
        _counters.steps_planned += 1
        _counters.decode_steps_planned += decode


def record_cascade(pages_flat: int, pages_cascade: int, decode: bool) -> None:
    with _lock:
        _counters.steps_cascade += 1
        _counters.decode_steps_cascade += decode
        _counters.pages_flat += pages_flat
        _counters.pages_cascade += pages_cascade


def record_fallback(reason: str, detail: str = "", *, level: int = logging.WARNING) -> None:
    """Count a step (or layer) that ran flat for ``reason``; log the first one of each reason."""
    with _lock:
        _counters.fallbacks[reason] += 1
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
    with _lock:
        return replace(_counters, fallbacks=Counter(_counters.fallbacks))


def reset() -> None:
    """Forget counts and logged reasons (tests)."""
    global _counters
    with _lock:
        _counters = Counters()
        _logged.clear()
