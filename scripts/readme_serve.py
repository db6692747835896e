"""README.md's serving figures: the headline's served ratios and the serving table, from
``benchmarks/results/gpu/serve.json`` (rows of ``benchmarks/serve/bench.py``, each plugin row
paired with the flat row of its own run). Rendered by ``readme_tables.py`` (blocks ``summary``
and ``serve``)."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

from readme_common import (
    DASH,
    GPU,
    ROOT,
    TIMES,
    _meta,
    _ratio,
    _source,
    _table,
    _versions,
    served_rows,
)

sys.path.insert(0, str(ROOT))  # the serve bench's reading of its rows (benchmarks.serve)
from benchmarks.serve.metrics import shared_cascade_fraction
from benchmarks.serve.pairs import DEFAULT_MODEL, model_of, serve_runs  # plugin row's flat row

# The serving headline's workloads (serve/workloads.py): what each is.
SERVE_HEADLINE = {"prefix_8k_x4": "4 documents of 8K tokens", "prefix_32k_x1": "one of 32K",
                  "prefix_2k_x16": "16 of 2K"}


def serve_headline() -> str:
    """Served by ``vllm serve`` on vLLM's default backend against it flat (serve.json): TPOT
    p50 at 90% load and a burst's output tokens/s, each point's latest run and, where it ran
    more than once, the range over its runs (each against its own run's flat server); "" when
    serve.json has none of it."""
    path = GPU / "serve.json"
    rows = served_rows(path) if path.is_file() else []
    parts, days, gpus = [], set(), set()

    def plugin_over_flat(workload: str, spec: str, key: str, servers: str = "",
                         faster: bool = False) -> tuple[str, list[str]] | None:
        """The latest run's plugin ÷ flat ``key`` at ``spec`` (``faster``: flat ÷ plugin), and
        the range over every run where there are several; None where not measured."""
        runs = serve_runs(rows, f"flash_attn{servers}", f"cascade_flash_attn{servers}",
                          workload).get(spec)
        if not runs:
            return None
        days.update(str(r.get("run_id", ""))[:8] for pair in runs for r in pair)
        gpus.update(gpu_of(r) for pair in runs for r in pair)
        ratios = [f[key] / c[key] if faster else c[key] / f[key] for f, c in runs]
        spread = ([f"{min(ratios):.2f}{DASH}{_ratio(max(ratios))} over {len(runs)} runs"]
                  if len(runs) > 1 else [])
        return _ratio(ratios[-1]) + (" lower" if faster else ""), spread

    def phrase(latest: tuple[str, list[str]] | None, *notes: str) -> str:
        """The latest ratio, then its range and ``notes`` in one parenthesis."""
        if latest is None:
            return "not measured"
        aside = [*latest[1], *notes]
        return latest[0] + (f" ({'; '.join(aside)})" if aside else "")

    for workload, what in SERVE_HEADLINE.items():
        tpot = plugin_over_flat(workload, "90%", "tpot_ms_p50", faster=True)
        burst = plugin_over_flat(workload, "burst", "output_tok_per_s")
        # The burst again with prompts tokenized by 4 API server processes: its latest run.
        servers = plugin_over_flat(workload, "burst", "output_tok_per_s", "_api_servers_4")
        also = [f"{servers[0]} with `--api-server-count 4`"] if servers else []
        said = [phrase(tpot), phrase(burst, *also)]
        if said != ["not measured"] * 2:
            parts.append(f"{' / '.join(said)} with {what}")
    if not parts:
        return ""
    dates = ", ".join(f"{d[:4]}-{d[4:6]}-{d[6:]}" for d in sorted(days) if d.isdigit())
    return (f"Served by `vllm serve` (vLLM's default `FLASH_ATTN` backend against it flat, "
            f"{', '.join(sorted(gpus))}, {dates}), TPOT p50 at 90% of flat's burst rate / a "
            f"burst's output tokens/s: "
            f"{'; '.join(parts)} shared by many requests. ")



def gpu_of(row: dict[str, Any]) -> str:
    """The GPU that measured a row (its model, without the details in brackets)."""
    return (row.get("gpu") or "GPU not recorded").split(" (")[0]


# (flat config, plugin config, the backend both run) of serve/bench.py's CONFIGS; the plugin
# with cascade on every step that shares (no cost model) beside the plugin as shipped
SERVE_PAIRS = (("flash_attn", "cascade_flash_attn", "FLASH_ATTN"),
               ("flash_attn", "cascade_flash_attn_always", "FLASH_ATTN, `CASCADE_POLICY=always`"),
               ("flash_attn", "cascade_flash_attn_split_off", "FLASH_ATTN, mixed steps flat"),
               ("flash_attn", "cascade_flash_attn_split_mixed",
                "FLASH_ATTN, `CASCADE_SPLIT_MIXED=1`"),
               ("flash_attn", "cascade_flash_attn_mixed_whole",
                "FLASH_ATTN, mixed steps planned whole"),
               ("flash_attn_api_servers_4", "cascade_flash_attn_api_servers_4",
                "FLASH_ATTN, 4 API servers"),
               ("flash_attn_pow2_graphs", "cascade_flash_attn_pow2_graphs",
                "FLASH_ATTN, capture sizes 1, 2, 4, …, 512"),
               ("flash_attn", "cascade_flash_attn_hybrid", "FLASH_ATTN, `CASCADE_UNVERIFIED=1`"),
               ("flash_attn_fp8", "cascade_flash_attn_fp8", "FLASH_ATTN, FP8 KV cache"),
               ("flashinfer", "cascade", "FLASHINFER"))
APART = "\u00b9"  # marks a pair measured by separate invocations


def _flat_reasons(row: dict[str, Any]) -> str:
    """The plugin's flat decode steps by reason, largest first: ``cost model 22%, ...``."""
    reasons = row.get("flat_reasons")
    if not reasons:
        return DASH
    shown = [f"{reason} {100 * share:.0f}%" for reason, share in
             sorted(reasons.items(), key=lambda item: -item[1]) if share >= 0.005]
    return ", ".join(shown) or DASH


TTFT_PARTS = ("ttft_ms_mean", "server_ttft_ms_mean", "queue_ms_mean", "prefill_ms_mean")


def _ttft_parts(row: dict[str, Any]) -> str:
    """A run's mean time to first token and its parts: HTTP (the client's less vLLM's), the
    frontend's tokenizing and hand-off to the engine (vLLM's less its queue and prefill), the
    engine's queue and the prefill."""
    client, server, queue, prefill = (row[k] for k in TTFT_PARTS)
    return (f"{client:,.0f} ms = HTTP {client - server:,.0f} + tokenizing and hand-off "
            f"{server - queue - prefill:,.0f} + queue {queue:,.0f} + prefill {prefill:,.0f}")


def block_serve() -> list[str]:
    path = GPU / "serve.json"
    if not path.is_file():
        return ["Not measured yet: `benchmarks/serve/bench.py` writes "
                "`benchmarks/results/gpu/serve.json`, and this table is rendered from it."]
    rows, meta = served_rows(path), _meta(path)
    left_out = [run["run_id"] for run in meta.get("runs", []) if run.get("left_out")]

    def pair(flat: dict[str, Any], on: dict[str, Any], key: str, digits: int = 0) -> str:
        a, b = flat.get(key), on.get(key)
        if a is None or b is None:
            return DASH
        ratio = f" ({_ratio(b / a)})" if a else ""
        return f"{a:,.{digits}f} → {b:,.{digits}f}{ratio}"

    def planning(on: dict[str, Any]) -> str:
        p50, p99, host = (on.get(k) for k in ("planning_us_p50", "planning_us_p99",
                                              "host_us_per_step"))
        if p50 is None:
            return DASH
        shown = f"{p50:,.0f} / {p99:,.0f}"
        return f"{shown} ({host:,.0f})" if host is not None else shown

    body, apart, splits = [], False, []
    gpu_of_run = {r.get("run_id"): gpu_of(r) for r in rows}  # every row names its GPU
    by_gpu: dict[str, set[str]] = {}
    for run in meta.get("runs", [meta]):
        if run.get("run_id") in gpu_of_run and "date" in run:
            by_gpu.setdefault(gpu_of_run[run.get("run_id")], set()).add(run["date"])
    counts = Counter(gpu_of_run.values())  # without dated runs in the meta: the most rows' GPU
    main_gpu = max(by_gpu or counts, key=lambda g: len(by_gpu[g]) if by_gpu else counts[g],
                   default="")
    other_gpu = False
    # A row of another model than Llama-3-8B's shapes names it beside its workload.
    keys = dict.fromkeys((r["workload"], r.get("tensor_parallel_size", 1), model_of(r))
                         for r in rows)
    for flat_config, plugin_config, backend in SERVE_PAIRS:
        for workload, tp, model in keys:
            for spec, runs in serve_runs(rows, flat_config, plugin_config, workload, tp,
                                         model).items():
                f, c = runs[-1]  # the latest run shown; the others as the ratios' range
                rate = spec
                if f["request_rate"] != "burst":
                    flat_rate, plugin_rate = f["request_rate"], c["request_rate"]
                    rate += (f" ({flat_rate} req/s)" if plugin_rate == flat_rate
                             else f" (flat {flat_rate}, plugin {plugin_rate} req/s)")
                if len(runs) > 1:
                    rate += f", {len(runs)} runs"
                if any(a.get("run_id") != b.get("run_id") for a, b in runs):
                    rate, apart = rate + APART, True
                if gpu_of(f) != main_gpu:
                    rate, other_gpu = f"{rate}, {gpu_of(f)}", True

                def cell(key: str, digits: int = 0, runs: list[Any] = runs,
                         f: dict[str, Any] = f, c: dict[str, Any] = c) -> str:
                    text = pair(f, c, key, digits)
                    ratios = [b[key] / a[key] for a, b in runs
                              if a.get(key) and b.get(key) is not None]
                    if len(ratios) > 1 and text.endswith(")"):
                        text = f"{text[:-1]}; {min(ratios):.2f}{DASH}{max(ratios):.2f}{TIMES})"
                    return text

                named = workload + (f", TP {tp}" if tp != 1 else "") + (
                    f", {model}" if model != DEFAULT_MODEL else "")
                if f["request_rate"] == "burst" and all(
                        r.get(k) is not None for r in (f, c) for k in TTFT_PARTS):
                    splits.append(f"{backend} {named}: flat {_ttft_parts(f)}; plugin "
                                  f"{_ttft_parts(c)}")
                fraction, sharing = c.get("cascade_step_fraction"), shared_cascade_fraction(c)
                shown = DASH if fraction is None else f"{100 * fraction:.0f}%"
                if sharing is not None and fraction:
                    middle = c.get("mid_run_shared_cascade_fraction")
                    mid = "" if middle is None else f"; {100 * middle:.0f}% mid-run"
                    shown += f" ({100 * sharing:.0f}%{mid})"
                body.append([backend, named, rate,
                             cell("output_tok_per_s"), cell("ttft_ms_p99"),
                             cell("tpot_ms_p50", 1), cell("tpot_ms_p99", 1),
                             shown,
                             _flat_reasons(c), planning(c)])
    lines = []
    if (GPU / "serve.png").is_file():
        shown = " and ".join(sorted(set(gpu_of_run.values()), key=lambda g: g != main_gpu))
        lines += [f"![Online serving, {shown}](../benchmarks/results/gpu/serve.png)", ""]  # docs/
    setup = "".join(f"{version}, " for version in _versions(meta))
    gpus = "; ".join(f"{gpu} {', '.join(sorted(dates))}" for gpu, dates in sorted(
        by_gpu.items(), key=lambda item: item[0] != main_gpu))
    where = " (a row measured on another GPU names it beside its rate)" if other_gpu else ""
    lines += [f"Flat → plugin on the same backend (plugin ÷ flat), {setup}{gpus}{where} "
              f"({_source(path)}); latencies in ms, lower is better; the plugin's decode "
              "steps as cascade, of all and (in brackets) of those whose rows share a page "
              "(all but those flat for no shared level or a single request), and of those over "
              "the middle half of a Poisson run's arrivals (mid-run: without the batch's ramp "
              "up and drain, where it is small); its flat decode "
              "steps as a share of its decode steps, by reason; its planning time per step "
              "in µs (p50 / p99) and its whole host time per step (planning, metadata, graph "
              "captures); a point measured in several runs (request rate: N runs) shows its "
              "latest run, then the range of every run's ratio (each run's plugin against its "
              "own flat server); "
              "FLASH_ATTN: the plugin's defaults at the run's code (`serve.meta.json`), "
              "which in run 20261203T093105 split mixed prefill+decode steps (what "
              "`CASCADE_SPLIT_MIXED=1` does) and from then to run 20261203T163808 ran them "
              "flat; mixed steps flat: every mixed step flat (the split's per-step term "
              "`cost.FA3_SPLIT_STEP_FIXED_US` 10^12 µs); mixed steps planned whole: each "
              "run as cascade where the eager cost model says so (the defaults, "
              "`CASCADE_SPLIT_MIXED=0`); "
              "`CASCADE_POLICY=always`: the plugin with cascade on every step that "
              "shares, the cost model bypassed; FP8 KV cache: both servers on "
              "`--kv-cache-dtype fp8`, the plugin with `CASCADE_FP8_KV=1`" + (
                  f"; left out, each for the reason its `left_out` in serve.meta.json gives: "
                  f"run {', '.join(left_out)}" if left_out else "") + ":", ""]
    lines += _table(["backend", "workload", "request rate", "output tokens/s", "TTFT p99",
                     "TPOT p50", "TPOT p99",
                     "decode steps as cascade (of those that share)",
                     "flat decode steps, why", "planning µs p50 / p99 (host µs per step)"], body)
    if splits:
        lines += ["", "Where a burst's time to first token goes (means over its requests, the "
                  "client's and vLLM's own `/metrics` histograms): " + "; ".join(splits) + "."]
    if apart:
        lines += ["", f"{APART} flat and plugin measured by separate `serve/bench.py` "
                  "invocations (`serve.meta.json` names each run, its machine and its "
                  "command)."]
    return lines
