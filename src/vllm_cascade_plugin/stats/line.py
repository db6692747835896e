"""The periodic log line: what one worker did in the last ``CASCADE_LOG_INTERVAL`` seconds."""

from __future__ import annotations

from .counters import COST_REASONS, Counters
from .histogram import quantile


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _us(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e6:.0f} us"


def flat_summary(counters: Counters) -> str:
    """The flat steps by reason, most first; a cost-model reason with the mean cascade/flat time
    it predicted for them (``cost model 40 (predicted 1.12x flat)``)."""
    parts = []
    for reason, n in sorted(counters.flat_reasons.items(), key=lambda item: (-item[1], item[0])):
        ratio = counters.flat_cost_ratio.get(reason) if reason in COST_REASONS else None
        parts.append(f"{reason} {n}" + (f" (predicted {ratio / n:.2f}x flat)" if ratio else ""))
    return ", ".join(parts) or "none"


def path_summary(counters: Counters) -> str:
    """The planned steps by how their planning went, most first, with the mean planning time
    of each (``continued 80% (120 us)``)."""
    total = sum(counters.planning_paths.values())
    parts = [f"{path} {_percent(n, total)} ({_us(counters.planning_path_s.get(path, 0.0) / n)})"
             for path, n in sorted(counters.planning_paths.items(),
                                   key=lambda item: (-item[1], item[0])) if n]
    return ", ".join(parts) or "none"


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
            "%s of them from CUDA graphs; %d graphs captured in %.2f s; planning %.2f s (%s "
            "of it on a CPU), per step p50 %s, p99 %s, by path: %s; host time %s per step, "
            "metadata %s per cascade step (%s of it staging uploads, %s launches, %s on a "
            "CPU)); flat steps: %s; fallbacks: %s; "
            "KV pages read on cascade steps: %s instead of %s flat, %s.",
            elapsed_s, since.steps_planned, _percent(since.steps_cascade, since.steps_planned),
            _percent(since.decode_steps_cascade, since.decode_steps_planned),
            _percent(since.decode_steps_graphed, since.decode_steps_cascade),
            since.graph_captures, since.graph_capture_s, since.planning_s,
            _percent(since.planning_cpu_s, since.planning_s),
            _us(quantile(since.planning_buckets, 0.5)),
            _us(quantile(since.planning_buckets, 0.99)),
            path_summary(since),
            _us(since.host_s / since.steps_planned if since.steps_planned else None),
            _us(since.builder_s / since.steps_cascade if since.steps_cascade else None),
            _percent(since.builder_staging_s, since.builder_s),
            _percent(since.builder_launch_s, since.builder_s),
            _percent(since.builder_cpu_s, since.builder_s),
            flat_summary(since), fallbacks or "none",
            f"{since.pages_cascade:,}", f"{since.pages_flat:,}", kv)
