"""What the serving benchmark reads from a server's ``/metrics``: the plugin's counters and
vLLM's request histograms, their change over a run, and the figures a row derives from them
(cascade and flat step shares, planning percentiles, host time per step, the middle of a Poisson
run, the step-timeline probe's GPU wait). No server and no client here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.serve.workloads import BURST

COUNTERS = {  # row key -> Prometheus sample name
    "steps_planned": "vllm_cascade_steps_planned_total",
    "decode_steps_planned": "vllm_cascade_decode_steps_planned_total",
    "decode_steps_cascade": "vllm_cascade_decode_steps_cascade_total",
    "decode_steps_graphed": "vllm_cascade_decode_steps_graphed_total",
    "graph_capture_failures": "vllm_cascade_graph_capture_failures_total",
    "graph_captures": "vllm_cascade_graph_captures_total",
    "graph_capture_s": "vllm_cascade_graph_capture_seconds_total",
    "planning_s": "vllm_cascade_planning_seconds_total",
    "planning_cpu_s": "vllm_cascade_planning_cpu_seconds_total",
    "builder_s": "vllm_cascade_builder_seconds_total",
    "builder_staging_s": "vllm_cascade_builder_staging_seconds_total",
    "builder_launch_s": "vllm_cascade_builder_launch_seconds_total",
    "builder_cpu_s": "vllm_cascade_builder_cpu_seconds_total",
    "graph_pool_bytes": "vllm_cascade_graph_pool_bytes",  # a level (gauge): its value after
    # vLLM's own request histograms (every server, plugin or not), their sums and counts: the
    # server's part of the client's TTFT (request_times()).
    "vllm_ttft_s": "vllm:time_to_first_token_seconds_sum",
    "vllm_ttft_n": "vllm:time_to_first_token_seconds_count",
    "vllm_queue_s": "vllm:request_queue_time_seconds_sum",
    "vllm_queue_n": "vllm:request_queue_time_seconds_count",
    "vllm_prefill_s": "vllm:request_prefill_time_seconds_sum",
    "vllm_prefill_n": "vllm:request_prefill_time_seconds_count",
    # vLLM's engine counters: prompt tokens looked up in and found in the prefix cache, prompt
    # tokens prefilled ("processed", vLLM says), requests preempted (two servers' work apart).
    "vllm_prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "vllm_prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "vllm_prompt_tokens": "vllm:prompt_tokens_total",
    "vllm_preemptions": "vllm:num_preemptions_total",
}
LEVELS = ("graph_pool_bytes",)
# Counted on tp_rank="0" only: every tensor-parallel rank plans (and captures) the same steps.
STEP_COUNTERS = ("steps_planned", "decode_steps_planned", "decode_steps_cascade",
                 "decode_steps_graphed", "graph_captures", "graph_capture_s", "planning_s",
                 "planning_cpu_s", "builder_s", "builder_staging_s", "builder_launch_s",
                 "builder_cpu_s")
# Step counts by label, on tp_rank="0": {label value: count}.
BY_LABEL = {  # key -> (Prometheus sample name, label)
    "decode_flat_steps": ("vllm_cascade_decode_flat_steps_total", "reason"),
    "full_graph_capture_causes": ("vllm_cascade_full_graph_captures_total", "cause"),
    # The per-step planning histogram: its cumulative counts by upper bound in seconds.
    "planning_buckets": ("vllm_cascade_step_planning_seconds_bucket", "le"),
    # Planned steps and their planning seconds by how the planning went (pre-check, continued,
    # followed, from scratch).
    "planning_path_steps": ("vllm_cascade_planning_path_steps_total", "path"),
    "planning_path_s": ("vllm_cascade_planning_path_seconds_total", "path"),
}
# The host times whose sum over the planned steps is host_us_per_step (see derived()).
HOST_TIMES = ("planning_s", "builder_s", "graph_capture_s")


def parse_counters(text: str) -> dict[str, Any]:
    """The plugin's counters in a ``/metrics`` text: summed over label sets, step counts on
    ``tp_rank="0"`` only (tensor-parallel ranks plan the same steps), :data:`BY_LABEL` as
    ``{label value: count}`` (``le`` as a float); None when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, Any] = dict.fromkeys([*COUNTERS, *BY_LABEL])
    wanted = {sample: key for key, sample in COUNTERS.items()}
    labelled = {sample: (key, label) for key, (sample, label) in BY_LABEL.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            rank0 = sample.labels.get("tp_rank", "0") == "0"
            if sample.name in labelled and rank0:
                key, label = labelled[sample.name]
                value = sample.labels.get(label, "")
                by = totals[key] = totals[key] or {}
                name = float(value) if label == "le" else value
                by[name] = by.get(name, 0.0) + sample.value
            key = wanted.get(sample.name)
            if key is None:
                continue
            if key in STEP_COUNTERS and not rank0:
                continue
            totals[key] = (totals[key] or 0.0) + sample.value
    return totals


def counter_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    def delta(key: str) -> Any:
        now, then = after.get(key), before.get(key)
        if now is None:
            return None
        if key in BY_LABEL:
            return {k: v - (then or {}).get(k, 0.0) for k, v in now.items()}
        return now if key in LEVELS else now - (then or 0.0)

    return {k: delta(k) for k in (*COUNTERS, *BY_LABEL)}


def planning_percentiles(buckets: dict[float, float] | None) -> tuple[float | None, float | None]:
    """(p50, p99) in µs of the per-step planning time from a histogram's cumulative counts by
    upper bound (seconds; the last, ``inf``), interpolated inside a bucket as the plugin's log
    line does (``vllm_cascade_plugin.stats.histogram``)."""
    from vllm_cascade_plugin.stats.histogram import quantile

    if not buckets:
        return None, None
    bounds = sorted(buckets)
    cumulative = [buckets[b] for b in bounds]
    counts = [n - m for n, m in zip(cumulative, [0.0, *cumulative[:-1]], strict=True)]
    finite = [b for b in bounds if b != float("inf")]
    if len(finite) == len(bounds):  # no +Inf bucket: nothing above the last bound
        counts.append(0.0)
    p50, p99 = (quantile(counts, q, finite) for q in (0.5, 0.99))
    return (None if p50 is None else p50 * 1e6), (None if p99 is None else p99 * 1e6)


def flat_reasons(delta: dict[str, Any]) -> dict[str, float] | None:
    """{reason: decode steps that ran flat for it / decode steps planned} over ``delta``; None
    without a decode step."""
    decode, flat = delta.get("decode_steps_planned"), delta.get("decode_flat_steps")
    if not decode:
        return None
    return {reason: n / decode for reason, n in sorted((flat or {}).items()) if n}


def read_timeline(path: Path | None) -> dict[str, Any] | None:
    """The step-timeline probe's running totals (``probes/step_timeline/``), None
    without a probe; zeros before its first write."""
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"steps": 0, "gpu_step_ms": 0.0, "gpu_wait_ms": 0.0, "waits_over_1ms": 0}


def timeline_deltas(before: dict[str, Any] | None,
                    after: dict[str, Any] | None) -> dict[str, Any]:
    """A run's row keys from the probe's totals before and after it: steps, the GPU's time per
    step running them and waiting for the host between them, the share of waiting; and
    ``timeline_by_kind``: the steps, GPU ms and wait ms per step of each kind of step the
    probe told apart (flat, cascade, capture; a probe without kinds: none), and
    ``timeline_by_phase`` the same for decode and mixed steps (a probe without phases: none).
    Where the probe kept them, the host's ms per step preparing a step
    (``host_prep_ms_per_step``), between steps (``host_between_ms_per_step``) and launching it
    (``host_run_ms_per_step``), and the steps' size: scheduled tokens and requests per step
    (``tokens_per_step``, ``rows_per_step``), in all, by kind and by phase; and the run's
    decode steps by kind and requests
    (``decode_by_rows``: ``[steps, GPU ms per step, wait ms per step]``, for
    :func:`matched_decode`)."""
    if before is None or after is None:
        return {}
    steps = after["steps"] - before["steps"]
    run = after["gpu_step_ms"] - before["gpu_step_ms"]
    wait = after["gpu_wait_ms"] - before["gpu_wait_ms"]
    by_kind, by_phase = _by_group(before, after, "kinds"), _by_group(before, after, "phases")
    return {"timeline_steps": steps,
            "gpu_step_ms_per_step": round(run / steps, 4) if steps else None,
            "gpu_wait_ms_per_step": round(wait / steps, 4) if steps else None,
            "gpu_wait_fraction": round(wait / (run + wait), 4) if run + wait > 0 else None,
            "gpu_waits_over_1ms": after["waits_over_1ms"] - before["waits_over_1ms"],
            "gpu_wait_p99_ms_recent": after.get("wait_p99_ms"),
            **{k: v for k, v in _per_step(after, before, steps).items()
               if not k.startswith("gpu_")},
            **({"timeline_by_kind": by_kind} if by_kind else {}),
            **({"timeline_by_phase": by_phase} if by_phase else {}),
            **_decode_deltas(before.get("decode_by_rows"), after.get("decode_by_rows"))}


def _by_group(before: dict[str, Any], after: dict[str, Any], key: str) -> dict[str, Any]:
    """The probe's totals of each group of steps under ``key`` (``kinds``, ``phases``) between
    the two readings, per step; a group without a step in between is left out."""
    out = {}
    for group, totals in (after.get(key) or {}).items():
        earlier = (before.get(key) or {}).get(group, {})
        n = totals["steps"] - earlier.get("steps", 0)
        if n:
            out[group] = {"steps": n, **_per_step(totals, earlier, n)}
    return out


def _decode_deltas(before: dict[str, Any] | None,
                   after: dict[str, Any] | None) -> dict[str, Any]:
    """``decode_by_rows`` of the steps between the probe's two readings (none where the probe
    did not keep it): kind -> requests -> [steps, GPU ms per step, wait ms per step]."""
    if after is None:
        return {}
    out: dict[str, dict[str, list[float]]] = {}
    for kind, sizes in after.items():
        earlier = (before or {}).get(kind, {})
        for rows, (n, gpu, wait) in sizes.items():
            n0, gpu0, wait0 = earlier.get(rows, (0, 0.0, 0.0))
            if n > n0:
                out.setdefault(kind, {})[rows] = [n - n0, round((gpu - gpu0) / (n - n0), 4),
                                                  round((wait - wait0) / (n - n0), 4)]
    return {"decode_by_rows": out} if out else {}


def matched_decode(row: dict[str, Any], kind: str, other: dict[str, Any],
                   other_kind: str = "flat") -> dict[str, Any] | None:
    """``row``'s decode steps of ``kind`` against ``other``'s of ``other_kind``, at equal
    requests per step (``decode_by_rows``): GPU ms per step, each batch size weighted by the
    fewer steps either has of it (``ratio``: ``row``'s over ``other``'s; ``steps``: the weights'
    sum; ``sizes``: batch sizes both ran). None where they share no batch size."""
    mine = (row.get("decode_by_rows") or {}).get(kind) or {}
    theirs = (other.get("decode_by_rows") or {}).get(other_kind) or {}
    num = den = weight = 0.0
    sizes = 0
    for rows, (n, gpu, _wait) in mine.items():
        if rows in theirs:
            w = min(n, theirs[rows][0])
            num, den = num + w * gpu, den + w * theirs[rows][1]
            weight, sizes = weight + w, sizes + 1
    if not sizes or den <= 0:
        return None
    return {"ratio": round(num / den, 4), "steps": int(weight), "sizes": sizes}


TIMELINE_TOTALS = ("gpu_step_ms", "gpu_wait_ms", "host_prep_ms", "host_between_ms", "host_run_ms",
                   "tokens", "rows")


def _per_step(now: dict[str, Any], before: dict[str, Any], steps: int) -> dict[str, Any]:
    """Each of the probe's running totals ``now`` has, less ``before``'s, per step (None
    without steps): ``<total>_per_step``."""
    return {f"{name}_per_step": round((now[name] - before.get(name, 0.0)) / steps, 4)
            if steps else None for name in TIMELINE_TOTALS if name in now}


def offered_load(rate: float | str, sustainable: float | None) -> float | None:
    """A Poisson rate as a fraction of the flat config's sustainable rate measured on the same
    workload (its burst's completed / duration); None for a burst or an unknown rate."""
    if rate == BURST or not sustainable:
        return None
    return round(float(rate) / sustainable, 3)


def derived(delta: dict[str, Any], plugin_on: bool) -> dict[str, Any]:
    """What a row says of the plugin's host time and flat steps over one run (None with the
    plugin off or a counter missing):

    - ``planning_us_p50``, ``planning_us_p99``: percentiles of the per-step planning time;
    - ``host_us_per_step``: planning, the metadata builders' executor planning and CUDA-graph
      captures (:data:`HOST_TIMES`), over the planned steps;
    - ``planning_cpu_share``: of the planning time, the share the planning thread ran on a CPU
      (well under 1: it waited for the GIL or the CPU);
    - ``builder_staging_share``: of the metadata builders' time, the share spent staging the
      plans for the device (pinned host copies, upload launches: CUDA calls);
    - ``builder_launch_share``: of it, the share in the uploads' launches alone;
    - ``builder_cpu_share``: of it, the share their thread ran on a CPU (the rest it waited:
      for the GIL, which each torch call releases, or the CPU);
    - ``flat_reasons``: {reason: decode steps that ran flat for it / decode steps planned};
      with ``cascade_step_fraction`` they add up to 1;
    - ``full_graph_capture_causes``: {cause: whole-step graphs captured for it};
    - ``planning_paths``: {how a step's planning went: [share of the planned steps, mean
      planning µs of those steps]} (the pre-checks that stopped it, or the planner's path).
    """
    out: dict[str, Any] = dict.fromkeys(("planning_us_p50", "planning_us_p99",
                                         "host_us_per_step", "planning_cpu_share",
                                         "builder_staging_share", "builder_launch_share",
                                         "builder_cpu_share",
                                         "flat_reasons",
                                         "full_graph_capture_causes", "planning_paths"))
    if not plugin_on:
        return out
    out["planning_us_p50"], out["planning_us_p99"] = planning_percentiles(
        delta.get("planning_buckets"))
    steps, host = delta.get("steps_planned"), [delta.get(k) for k in HOST_TIMES]
    if steps and None not in host:
        out["host_us_per_step"] = 1e6 * sum(host) / steps
    planning, cpu = delta.get("planning_s"), delta.get("planning_cpu_s")
    if planning and cpu is not None:
        out["planning_cpu_share"] = cpu / planning
    builder = delta.get("builder_s")
    for share, part in (("builder_staging_share", "builder_staging_s"),
                        ("builder_launch_share", "builder_launch_s"),
                        ("builder_cpu_share", "builder_cpu_s")):
        seconds = delta.get(part)
        if builder and seconds is not None:
            out[share] = seconds / builder
    out["flat_reasons"] = flat_reasons(delta)
    causes = delta.get("full_graph_capture_causes")
    if causes is not None:
        out["full_graph_capture_causes"] = {c: int(n) for c, n in sorted(causes.items()) if n}
    paths, path_s = delta.get("planning_path_steps"), delta.get("planning_path_s") or {}
    total = sum((paths or {}).values())
    if paths is not None and total:
        out["planning_paths"] = {p: [n / total, 1e6 * path_s.get(p, 0.0) / n]
                                 for p, n in sorted(paths.items(), key=lambda i: -i[1]) if n}
    return out


REQUEST_TIMES = {  # row key -> (sum, count) keys of vLLM's histograms in COUNTERS
    "server_ttft_ms_mean": ("vllm_ttft_s", "vllm_ttft_n"),
    "queue_ms_mean": ("vllm_queue_s", "vllm_queue_n"),
    "prefill_ms_mean": ("vllm_prefill_s", "vllm_prefill_n"),
}


def request_times(delta: dict[str, Any]) -> dict[str, float | None]:
    """Where a run's time to first token went, as vLLM's server measured it (means in ms over
    the run's requests; None where vLLM reported none):

    - ``server_ttft_ms_mean``: from the moment vLLM's frontend starts rendering the prompt
      (the HTTP request read; vLLM stamps ``arrival_time`` before it tokenizes) to its first
      token; the client's ``ttft_ms_mean`` less this is HTTP's part, and this less the next
      two is tokenizing the prompt and handing the request to the engine core;
    - ``queue_ms_mean``: waiting in the engine's queue until first scheduled;
    - ``prefill_ms_mean``: from first scheduled to the first token (the prompt's steps).
    """
    out: dict[str, float | None] = {}
    for key, (total, count) in REQUEST_TIMES.items():
        s, n = delta.get(total), delta.get(count)
        out[key] = 1e3 * s / n if s is not None and n else None
    return out


def shared_cascade_fraction(row: dict[str, Any]) -> float | None:
    """Of a plugin row's decode steps whose rows share a page (all but those flat for "no shared
    level" or "single request": cascade has nothing to do there), the share that ran cascade;
    None without the counters or without such steps. A row without a "single request" count
    holds those steps in "no shared level": the same share."""
    from vllm_cascade_plugin.stats.counters import NO_SHARED, SINGLE

    fraction, reasons = row.get("cascade_step_fraction"), row.get("flat_reasons")
    if fraction is None or reasons is None:
        return None
    sharing = 1.0 - sum(reasons.get(r, 0.0) for r in (NO_SHARED, SINGLE))
    return min(fraction / sharing, 1.0) if sharing > 1e-9 else None


# The middle of a run's Poisson arrivals (fractions of their duration from the first prefill):
# steady serving, without the small batches of the run's own ramp up and drain.
MID_RUN = (0.25, 0.75)


def mid_run(snapshots: Sequence[tuple[float, dict[str, Any]]], before: dict[str, Any],
            duration_s: float) -> dict[str, Any]:
    """A plugin row's step counts over the middle of its arrivals (:data:`MID_RUN`), from
    ``/metrics`` read every second or so while the client ran (``snapshots``: (monotonic
    seconds, :func:`parse_counters`)); ``before``: the counters before the run;
    ``duration_s``: the arrivals' length (requests / rate). The arrivals start at the first
    snapshot where vLLM counts a finished prefill. Keys ``mid_run_*``, None where the snapshots
    do not cover half the window or no decode step was planned in it:
    ``mid_run_window_s`` ([from, to] seconds after that start), ``mid_run_decode_steps``,
    ``mid_run_cascade_step_fraction``, ``mid_run_flat_reasons`` and
    ``mid_run_shared_cascade_fraction``, as the row's own over the whole run."""
    out: dict[str, Any] = {f"mid_run_{k}": None for k in (
        "window_s", "decode_steps", "cascade_step_fraction", "flat_reasons",
        "shared_cascade_fraction")}
    first = before.get("vllm_prefill_n") or 0.0
    start = next((t for t, c in snapshots if (c.get("vllm_prefill_n") or 0.0) > first), None)
    if start is None or duration_s <= 0:
        return out
    lo, hi = (start + f * duration_s for f in MID_RUN)
    inside = [(t, c) for t, c in snapshots if lo <= t <= hi]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < (hi - lo) / 2:
        return out
    (t0, c0), (t1, c1) = inside[0], inside[-1]
    delta = counter_deltas(c0, c1)
    cascade, _ = fractions(delta, True)
    if cascade is None:
        return out
    reasons = flat_reasons(delta)
    out.update(mid_run_window_s=[round(t0 - start, 1), round(t1 - start, 1)],
               mid_run_decode_steps=int(delta["decode_steps_planned"]),
               mid_run_cascade_step_fraction=cascade, mid_run_flat_reasons=reasons,
               mid_run_shared_cascade_fraction=shared_cascade_fraction(
                   {"cascade_step_fraction": cascade, "flat_reasons": reasons}))
    return out


def fractions(delta: dict[str, float | None], plugin_on: bool) -> tuple[float | None, ...]:
    """(cascade_step_fraction, graph_replay_fraction): Δcascade/Δplanned and Δgraphed/Δcascade
    decode steps; None with the plugin off, a counter missing or a zero denominator."""
    def ratio(num: float | None, den: float | None) -> float | None:
        return None if not plugin_on or num is None or not den else num / den

    return (ratio(delta["decode_steps_cascade"], delta["decode_steps_planned"]),
            ratio(delta["decode_steps_graphed"], delta["decode_steps_cascade"]))


def count_capture_warnings(log_text: str) -> int:
    """Server-log lines that say a CUDA-graph capture failed."""
    return sum(1 for line in log_text.splitlines()
               if ("vllm-cascade-plugin: capturing" in line and "failed" in line)
               or "INTERNAL ASSERT FAILED" in line)
