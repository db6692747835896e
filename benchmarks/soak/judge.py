"""The soak's verdict (``bench.py``): every criterion with its evidence, from the phases' results
and logs. The logprob rule is the engine tests' (:mod:`vllm_cascade_plugin.face.agreement`).
"""

from __future__ import annotations

import datetime
import re
import signal
from collections.abc import Sequence
from typing import Any

from benchmarks.soak.mix import SUBSET_SIZE
from vllm_cascade_plugin.face import agreement

ISSUE_FIELDS = ("requests", "aborts", "preemptions", "cascade_step_fraction", "max_abs_dlogprob",
                "duration_s", "outcome")
MEMORY_TOL = 0.01
WATCHDOG_S = 60.0
# Fallbacks that mean the plugin caught an error of its own (the step then ran flat).
ERROR_FALLBACK = re.compile(r"error|invariant|out of range")
ERROR_LINE = re.compile(r"(?:^|\s)(?:ERROR|CRITICAL)\s|Traceback \(most recent call last\)"
                        r"|CUDA error|Task exception was never retrieved")


def live_mib(reading: dict[str, Any]) -> float:
    """The engine process's memory that lives, from a reading taken idle after
    ``torch.cuda.empty_cache()`` (``soak_worker.device_memory``): the process's figure less what
    torch's allocator still holds free (``reserved_mib`` - ``allocated_mib``: segments it could
    not return because a live block sits in each). That cache depends on how blocks happened to
    fall into segments, not on what lives: two soaks of the same code saw the process's figure
    grow 2 and 34 MiB of 2,000 with the allocated memory grown 8.3 MiB in both. Readings
    without ``reserved_mib``: the process's figure."""
    used = float(reading["used_mib"])
    reserved, allocated = reading.get("reserved_mib"), reading.get("allocated_mib")
    if reserved is None or allocated is None:
        return used
    return used - max(0.0, float(reserved) - float(allocated))


def completion_problem(n: int, max_tokens: int, finished: bool,
                       completions: Sequence[tuple[str | None, int]]) -> str | None:
    """Why a request that was not aborted did not complete as asked; None when it did.

    ``completions``: (finish reason, token count) of each of its ``n`` completions.
    """
    if not finished:
        return "not finished"
    if len(completions) != n:
        return f"{len(completions)} of {n} completions"
    for reason, count in completions:
        if reason not in ("length", "stop"):
            return f"finish reason {reason!r}"
        if reason == "length" and count != max_tokens:
            return f"finish reason 'length' after {count} of {max_tokens} tokens"
    return None


def error_lines(log: str) -> list[str]:
    """Lines of a phase's log that report an error: vLLM's ERROR lines, tracebacks, CUDA errors."""
    return [line for line in log.splitlines() if ERROR_LINE.search(line)]


def judge(run: dict | None, replay: dict | None, settings: dict[str, Any],
          exit_codes: dict[str, int | None], errors: dict[str, list[str]]) -> dict[str, Any]:
    """soak.json: the issue's fields, every criterion with its evidence, and the verdict.

    ``run``/``replay``: the phases' results (None when a phase wrote none); ``exit_codes``: each
    phase's exit status (None: not run); ``errors``: each phase's error lines.
    """
    run = run or {}
    counters = run.get("counters") or {}
    planned, cascade = counters.get("decode_steps_planned", 0), counters.get(
        "decode_steps_cascade", 0)
    fallbacks = counters.get("fallbacks", {})
    plugin_errors = {r: n for r, n in fallbacks.items() if ERROR_FALLBACK.search(r)}
    ran, replayed = run.get("subset", {}), (replay or {}).get("subset", {})
    ids = [i for i in ran if i in replayed]
    worst, mean, compared = agreement.compare([ran[i] for i in ids],
                                              [replayed[i] for i in ids])
    identical = sum(ran[i]["tokens"] == replayed[i]["tokens"] for i in ids)
    before, after = run.get("memory_before") or {}, run.get("memory_after") or {}
    live = (live_mib(before), live_mib(after)) if before and after else None
    memory_change = (live[1] - live[0]) / live[0] if live else None
    requests, aborts = run.get("requests", 0), run.get("aborts", 0)
    preemptions, duration = run.get("preemptions", 0), run.get("duration_s", 0.0)
    incomplete, failed = run.get("incomplete", 0), run.get("request_errors", 0)
    hang = run.get("hang")
    if hang is None and exit_codes.get("run") == -signal.SIGKILL:
        hang = "the run phase was killed (its time limit, or out of memory)"
    n_errors = sum(len(lines) for lines in errors.values())
    graphs = after.get("graphs") or {}
    graph_replays = graphs.get("graph_replays", 0) + graphs.get("full_graph_replays", 0)
    checks = [
        ("requests", requests >= settings["min_requests"],
         f"{requests:,} submitted, at least {settings['min_requests']:,} required"),
        ("duration", duration >= settings["duration"],
         f"drove for {duration:.0f} s, at least {settings['duration']:.0f} s required"),
        ("completion", incomplete == 0 and failed == 0 and run.get("completed", 0) > 0,
         f"{run.get('completed', 0):,} completed; {incomplete} not aborted but incomplete, "
         f"{failed} raised; {run.get('problems', [])[:5]}"),
        ("logprobs", len(ids) == SUBSET_SIZE and agreement.agrees(worst, mean, compared),
         f"{len(ids)} of {SUBSET_SIZE} subset requests compared ({identical} identical), "
         f"{compared} tokens: max |d| {worst:.4f} (<= {agreement.MAX_TOL}), mean {mean:.4f} "
         f"(<= {agreement.MEAN_TOL})"),
        ("no_hang", hang is None and exit_codes.get("run") is not None,
         hang or "a request produced output at least every "
         f"{WATCHDOG_S:.0f} s while any was in flight"),
        ("memory", memory_change is not None and abs(memory_change) <= MEMORY_TOL,
         "not measured" if live is None or memory_change is None else
         f"{live[0]:,.0f} MiB -> {live[1]:,.0f} MiB live ({100 * memory_change:+.2f}%, limit "
         f"{100 * MEMORY_TOL:.0f}%; the process {before['used_mib']:,.0f} -> "
         f"{after['used_mib']:,.0f} MiB, less the allocator's free cache)"),
        ("no_error_lines", n_errors == 0,
         f"{n_errors} error lines: " + "; ".join(
             f"{phase}: {lines[:3]}" for phase, lines in errors.items() if lines)),
        ("exercised", aborts > 0 and preemptions > 0 and cascade > 0
         and run.get("kinds", {}).get("sampling", 0) > 0,
         f"{aborts} aborts, {preemptions} preemptions, {cascade:,} cascade decode steps, "
         f"{run.get('kinds', {}).get('sampling', 0)} n>1 requests (each must be > 0)"),
        ("capture_failures", bool(counters) and counters.get("graph_capture_failures", 0) == 0,
         f"{counters.get('graph_capture_failures', 0)} CUDA-graph captures failed; "
         f"{graph_replays:,} graph replays" if counters
         else "the plugin's counters could not be read"),
        ("plugin_errors", not plugin_errors and bool(counters),
         f"fallbacks caused by errors: {plugin_errors}" if counters
         else "the plugin's counters could not be read"),
        ("phases", exit_codes.get("run") == 0 and exit_codes.get("replay") == 0
         and not run.get("failures"),
         f"exit codes {exit_codes}; failures {run.get('failures', ['no results'])}"),
    ]
    criteria = {name: {"ok": bool(ok), "detail": detail} for name, ok, detail in checks}
    reasons = [f"{name}: {c['detail']}" for name, c in criteria.items() if not c["ok"]]
    return {
        "requests": requests,
        "aborts": aborts,
        "preemptions": preemptions,
        "cascade_step_fraction": cascade / planned if planned else None,
        "max_abs_dlogprob": worst if compared else None,
        "duration_s": round(duration, 1),
        "outcome": "fail" if reasons else "pass",
        "graph_replays": graph_replays,  # per-layer and whole-step, in the drive
        "capture_failures": counters.get("graph_capture_failures", 0),
        "date": datetime.date.today().isoformat(),
        "reasons": reasons,
        "criteria": criteria,
        "mean_abs_dlogprob": mean if compared else None,
        "compared_tokens": compared,
        "subset_compared": len(ids),
        "subset_identical": identical,
        "completed": run.get("completed", 0),
        "non_aborted_incomplete": incomplete,
        "request_errors": failed,
        "aborts_raced": run.get("aborts_raced", 0),
        "output_tokens": run.get("output_tokens", 0),
        "kinds": run.get("kinds", {}),
        "memory_before_mib": before.get("used_mib"),
        "memory_after_mib": after.get("used_mib"),
        "memory_change_fraction": memory_change,
        "memory_live_mib": list(live) if live else None,
        "memory_raw_mib": [before.get("used_raw_mib"), after.get("used_raw_mib")],
        "memory_samples": run.get("memory_samples", []),
        "memory_readings": {"before": before, "after": after},
        "executors": after.get("executors", before.get("executors")),
        "error_lines": n_errors,
        "plugin_counters": counters,
        "fallbacks": fallbacks,
        "settings": settings,
    }
