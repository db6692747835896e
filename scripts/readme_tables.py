"""Render README.md's measured figures from the committed result files.

    python scripts/readme_tables.py            # rewrite README.md's generated blocks
    python scripts/readme_tables.py --check    # exit 1 if README.md differs from what it renders

Every block of the README between ``<!-- table:NAME -->`` and ``<!-- /table -->`` is generated
here from ``benchmarks/results/`` (standard library only); the rest of the README is prose without
measured figures. ``tests/test_readme.py`` fails when the README's blocks differ from what this
renders from the committed JSON, so a new result file means running this script.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # its parts, wherever it is loaded from
sys.path.insert(0, str(ROOT))  # the serve bench's reading of its rows (benchmarks.serve)
from readme_compat import block_compatibility  # noqa: E402

from benchmarks.serve.metrics import shared_cascade_fraction  # noqa: E402

README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
H200 = RESULTS / "h200"
CPU = RESULTS / "cpu"
BLOCK = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)

TIMES, DASH = "\u00d7", "\u2013"  # the README's multiplication sign and en dash
E2E_WORKLOADS = {  # e2e/bench.py workload -> what it is
    "b128_16k_prefix_64_own": "128 requests behind one 16K-token prefix",
    "8_prefixes_8k_x16_interleaved": f"8 prefixes of 8K {TIMES} 16 requests, interleaved",
    "n16_sampling_32_prompts_4k": "`n=16` sampling, 32 prompts of 4K",
    "no_sharing_256_random_2k": "256 random 2K prompts (no sharing)",
    "one_8k_prefix_x64": "64 requests behind one 8K-token prefix",
}
# kernel_grid.json rows the README shows: (B, P, groups).
KERNEL_ROWS = [(64, 2048, 1), (128, 2048, 1), (128, 8192, 1), (256, 8192, 1), (256, 32768, 1),
               (256, 8192, 4), (256, 8192, 16)]
CORRECTNESS_WORKLOADS = {  # tests/gpu/test_engine.py workload -> what it is
    "a_one_8k_prefix_x64": f"(a) one 8K prefix {TIMES} 64",
    "b_4_prefixes_x16_interleaved": f"(b) 4 interleaved 2K prefixes {TIMES} 16",
    "c_tree_2k_system_4x4k_docs_x8": f"(c) 2K system prompt → 4 documents {TIMES} 8 questions",
    "d_n8_sampling_16_prompts": "(d) `n=8` sampling",
    "e_chunked_prefill_with_decodes": "(e) chunked prefill mixed with decodes",
    "f_preemption_small_kv_cache": "(f) preemption under a small KV cache",
}


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _meta(path: Path) -> dict[str, Any]:
    meta = path.with_name(path.name.removesuffix(".json") + ".meta.json")
    return _load(meta) if meta.is_file() else {}


def _int(x: float) -> str:
    return f"{x:,.0f}"


def _ratio(x: float) -> str:
    return f"{x:.2f}{TIMES}"


def _table(head: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    head = list(head)
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(row) + " |" for row in rows)]


def _source(*paths: Path) -> str:
    return ", ".join(f"`{p.relative_to(ROOT)}`" for p in paths)


def _versions(meta: dict[str, Any]) -> list[str]:
    return [f"{name} {meta[key]}" for key, name in (("vllm", "vLLM"), ("flashinfer", "FlashInfer"))
            if key in meta]


def _setup(meta: dict[str, Any]) -> str:
    parts = [meta.get("gpu", "GPU not recorded").split(" (")[0], *_versions(meta)]
    return ", ".join(parts) + (f", {meta['date']}" if "date" in meta else "")


# ---------------------------------------------------------------------------------------- blocks


def e2e_speedups() -> dict[str, tuple[float, float | None]]:
    """workload -> (plugin / flat FlashInfer, plugin / FLASH_ATTN) output tokens/s."""
    rows = _load(H200 / "e2e.json")
    out = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        by = {r["config"]: r["out_tok_per_s"] for r in rows if r["workload"] == workload}
        if "cascade" in by and "flashinfer" in by:
            fa = by.get("flash_attn")
            out[workload] = (by["cascade"] / by["flashinfer"], by["cascade"] / fa if fa else None)
    return out


def block_summary() -> list[str]:
    """The headline: end to end and per layer, from e2e.json and kernel_grid.json."""
    speed = e2e_speedups()
    meta = _meta(H200 / "e2e.json")
    parts = [f"{_ratio(s)} with {E2E_WORKLOADS.get(w, w).replace('`', '')}" for w, (s, _) in
             speed.items()]
    grid = [r for r in _load(H200 / "kernel_grid.json") if r["ms"].get("plugin")]
    best = max(grid, key=lambda r: r["ms"]["fi_decode"] / r["ms"]["plugin"])
    return [f"End to end on an {_setup(meta)} (Llama-3-8B shapes, dummy weights), output "
            f"tokens/s against flat FlashInfer: {'; '.join(parts)}. {serve_headline()}Per "
            f"attention layer, up to "
            f"{_ratio(best['ms']['fi_decode'] / best['ms']['plugin'])} faster than flat "
            f"FlashInfer decode ({best['B']} requests {TIMES} {best['P']:,} shared tokens). "
            f"Details in [Performance](#performance)."]


# The serving headline's workloads (serve/workloads.py): what each is.
SERVE_HEADLINE = {"prefix_8k_x4": "4 documents of 8K tokens", "prefix_32k_x1": "one of 32K",
                  "prefix_2k_x16": "16 of 2K"}


def serve_headline() -> str:
    """Served by ``vllm serve`` on vLLM's default backend against it flat (serve.json): TPOT
    p50 at 90% load and a burst's output tokens/s, each point's latest run and, where it ran
    more than once, the range over its runs (each against its own run's flat server); "" when
    serve.json has none of it."""
    path = H200 / "serve.json"
    rows = _load(path) if path.is_file() else []
    parts, days = [], set()

    def plugin_over_flat(workload: str, spec: str, key: str, servers: str = "",
                         faster: bool = False) -> tuple[str, list[str]] | None:
        """The latest run's plugin ÷ flat ``key`` at ``spec`` (``faster``: flat ÷ plugin), and
        the range over every run where there are several; None where not measured."""
        runs = serve_runs(rows, f"flash_attn{servers}", f"cascade_flash_attn{servers}",
                          workload).get(spec)
        if not runs:
            return None
        days.update(str(r.get("run_id", ""))[:8] for pair in runs for r in pair)
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
            f"{dates}), TPOT p50 at 90% of flat's burst rate / a burst's output tokens/s: "
            f"{'; '.join(parts)} shared by many requests. ")


def block_e2e() -> list[str]:
    path = H200 / "e2e.json"
    rows, meta = _load(path), _meta(path)
    body = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        by = {r["config"]: r for r in rows if r["workload"] == workload}
        if "cascade" not in by or "flashinfer" not in by:
            continue
        on, flat, fa = by["cascade"], by["flashinfer"], by.get("flash_attn")
        counters = on.get("plugin_counters") or {}
        steps = (f"{counters['steps_cascade']} of {counters['steps_planned']}"
                 if "steps_planned" in counters else "not recorded")
        body.append([E2E_WORKLOADS.get(workload, workload),
                     _int(fa["out_tok_per_s"]) if fa else DASH, _int(flat["out_tok_per_s"]),
                     _int(on["out_tok_per_s"]),
                     _ratio(on["out_tok_per_s"] / flat["out_tok_per_s"]),
                     _ratio(on["out_tok_per_s"] / fa["out_tok_per_s"]) if fa else DASH, steps])
    return [f"Output tokens/s, {_setup(meta)} ({_source(path)}):", "",
            *_table(["workload", "`FLASH_ATTN`", "`FLASHINFER` flat", "plugin",
                     "vs flat FlashInfer", "vs `FLASH_ATTN`", "steps run as cascade"], body)]


def block_kernel() -> list[str]:
    path = H200 / "kernel_grid.json"
    rows, meta = _load(path), _meta(path)
    by = {(r["B"], r["P"], r["groups"]): r for r in rows}
    body = []
    for key in KERNEL_ROWS:
        if key not in by:
            continue
        r, (b, p, g) = by[key], key
        ms = r["ms"]
        label = f"{b} {TIMES} {p:,}" + (f", {g} groups" if g > 1 else "")
        cells = [label, f"{ms['plugin']:.3f} ({r.get('plugin_choice', '?')})",
                 f"{ms['fi_decode']:.3f}", _ratio(ms["fi_decode"] / ms["plugin"])]
        cells += [f"{ms[k]:.3f}" if ms.get(k) else DASH
                  for k in ("fa3_decode", "fa3_cascade", "plugin_cascade")]
        body.append([*cells, f"{r['floor_ms']:.3f}"])
    return [f"ms per layer call, median GPU time, {_setup(meta)} ({_source(path)}):", "",
            *_table([f"B requests {TIMES} P shared tokens", "plugin (what it runs)",
                     "flat FlashInfer decode", "speed-up", "FA3 decode (`FLASH_ATTN`)",
                     "FA3 prefix+suffix (vLLM ≤ 0.31)", "plugin, FlashInfer executor",
                     "floor"], body)]


def block_planner() -> list[str]:
    path = CPU / "planner.json"
    rows, meta = _load(path), _meta(path)
    def us(row: dict[str, Any], key: str) -> str:
        return f"{row[key]:.0f}" if key in row else DASH

    def told(row: dict[str, Any], name: str) -> str:
        """Comparing → told the rows, and the speedup: the rounds' median (min to max)."""
        cell = f"{us(row, f'{name}_median_us')} → {us(row, f'{name}_keyed_median_us')}"
        if speedup := row.get(f"{name}_keyed_speedup"):
            cell += f" ({speedup[1]:.2f}{TIMES}, {speedup[0]:.2f}{DASH}{speedup[2]:.2f})"
        return cell

    body = [[r["case"], _int(r["requests"]), _int(r["pages"]), told(r, "steady"),
             told(r, "churn"),
             us(r, "cold_median_us"),
             "skipped (no two rows share a first block)" if r.get("planner_skipped") else "runs"]
            for r in rows]
    machine = meta.get("machine", "not recorded").replace("/", ", ") + " cores"
    return [f"µs per decode step (median), CPU {machine}, numpy {meta.get('numpy', '?')} "
            f"({_source(path)}); comparing block ids → told the rows that changed "
            "(`CASCADE_PLAN_FROM_CHANGES`), both on the same steps, and the speedup "
            f"(median, min{DASH}max of {meta.get('rounds', 1)} rounds):", "",
            *_table(["case", "requests", "pages per row", "steady decode",
                     "one request replaced per step", "new batch (cold)", "planner"], body)]


def _rate_key(row: dict[str, Any]) -> tuple[int, float, str]:
    spec = str(row.get("rate_spec", row["request_rate"]))
    rate = row["request_rate"]
    return (0, 0.0, spec) if rate == "burst" else (1, float(rate), spec)


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


def serve_runs(rows: list[dict[str, Any]], flat_config: str, plugin_config: str, workload: str,
               tp: int = 1) -> dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Per rate spec (in rate order), every run's (flat row, plugin row) of ``workload``, in
    file order: each plugin row with the flat row of its own run, else the latest flat row
    before it in the file (the one it was measured against), else the first after it. A run
    whose every request failed measured nothing and is left out."""
    def of(config: str) -> dict[str, list[tuple[int, dict[str, Any]]]]:
        out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for i, r in enumerate(rows):
            if (r["workload"] == workload and r["config"] == config
                    and r.get("tensor_parallel_size", 1) == tp and r.get("completed", 1)):
                # a repeat at the same rate ("90%#2", serve/bench.py's "90%*2") is another run of it
                spec = str(r.get("rate_spec", r["request_rate"])).partition("#")[0]
                out.setdefault(spec, []).append((i, r))
        return out
    flat, on = of(flat_config), of(plugin_config)
    runs = {}
    for spec in sorted(set(flat) & set(on), key=lambda s: _rate_key(flat[s][-1][1])):
        runs[spec] = []
        for at, c in on[spec]:
            same = [f for _, f in flat[spec] if f.get("run_id") == c.get("run_id")]
            same = [f for f in same if f.get("rate_spec") == c.get("rate_spec")] or same
            before = [f for i, f in flat[spec] if i < at]
            runs[spec].append(((same or before or [flat[spec][0][1]])[-1], c))
    return runs


def block_serve() -> list[str]:
    path = H200 / "serve.json"
    if not path.is_file():
        return ["Not measured yet: `benchmarks/serve/bench.py` writes "
                "`benchmarks/results/h200/serve.json`, and this table is rendered from it."]
    rows, meta = _load(path), _meta(path)

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
    gpu_of = {run.get("run_id"): run.get("gpu", "GPU not recorded").split(" (")[0]
              for run in meta.get("runs", [meta])}
    shown_runs = {r.get("run_id") for r in rows}
    by_gpu: dict[str, set[str]] = {}
    for run in meta.get("runs", [meta]):
        if run.get("run_id") in shown_runs and "date" in run:
            by_gpu.setdefault(gpu_of[run.get("run_id")], set()).add(run["date"])
    main_gpu = max(by_gpu, key=lambda g: len(by_gpu[g])) if by_gpu else ""
    other_gpu = False
    keys = dict.fromkeys((r["workload"], r.get("tensor_parallel_size", 1)) for r in rows)
    for flat_config, plugin_config, backend in SERVE_PAIRS:
        for workload, tp in keys:
            for spec, runs in serve_runs(rows, flat_config, plugin_config, workload, tp).items():
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
                if gpu_of.get(f.get("run_id"), main_gpu) != main_gpu:
                    rate, other_gpu = f"{rate}, {gpu_of[f.get('run_id')]}", True

                def cell(key: str, digits: int = 0, runs: list[Any] = runs,
                         f: dict[str, Any] = f, c: dict[str, Any] = c) -> str:
                    text = pair(f, c, key, digits)
                    ratios = [b[key] / a[key] for a, b in runs
                              if a.get(key) and b.get(key) is not None]
                    if len(ratios) > 1 and text.endswith(")"):
                        text = f"{text[:-1]}; {min(ratios):.2f}{DASH}{max(ratios):.2f}{TIMES})"
                    return text

                if f["request_rate"] == "burst" and all(
                        r.get(k) is not None for r in (f, c) for k in TTFT_PARTS):
                    splits.append(f"{backend} {workload}: flat {_ttft_parts(f)}; plugin "
                                  f"{_ttft_parts(c)}")
                fraction, sharing = c.get("cascade_step_fraction"), shared_cascade_fraction(c)
                shown = DASH if fraction is None else f"{100 * fraction:.0f}%"
                if sharing is not None and fraction:
                    middle = c.get("mid_run_shared_cascade_fraction")
                    mid = "" if middle is None else f"; {100 * middle:.0f}% mid-run"
                    shown += f" ({100 * sharing:.0f}%{mid})"
                body.append([backend, workload + (f", TP {tp}" if tp != 1 else ""), rate,
                             cell("output_tok_per_s"), cell("ttft_ms_p99"),
                             cell("tpot_ms_p50", 1), cell("tpot_ms_p99", 1),
                             shown,
                             _flat_reasons(c), planning(c)])
    lines = []
    if (H200 / "serve.png").is_file():
        lines += ["![Online serving on an H200](benchmarks/results/h200/serve.png)", ""]
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
              "shares, the cost model bypassed:", ""]
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


def block_correctness() -> list[str]:
    path = H200 / "correctness.json"
    rows, meta = _load(path), _meta(path)
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    corrupted = []
    for r in rows:
        if "corrupt" in r["workload"]:
            corrupted.append(r)
            continue
        if r.get("full_graph_replays"):
            graphs = "whole-step"
        elif r.get("graph_replays"):
            graphs = "per layer"
        else:
            graphs = "not recorded"
        groups.setdefault((r["tensor_parallel_size"], graphs), []).append(r)
    body = []
    for (tp, graphs), rs in groups.items():
        names = dict.fromkeys(r["workload"] for r in rs)
        runners = ", ".join(sorted({r["runner"].upper() for r in rs}))
        fractions = [r["cascade_step_fraction"] for r in rs
                     if r.get("cascade_step_fraction") is not None]
        low, high = (f"{100 * x:.0f}%" for x in (min(fractions or [0]), max(fractions or [0])))
        body.append([runners, str(tp), graphs,
                     " ".join(CORRECTNESS_WORKLOADS[n].split(" ")[0]
                              if n in CORRECTNESS_WORKLOADS else n for n in names),
                     f"{max(r['max_abs_dlogprob'] for r in rs):.3f}",
                     f"{max(r['mean_abs_dlogprob'] for r in rs):.3f}",
                     DASH if not fractions else low if low == high else f"{low[:-1]}{DASH}{high}",
                     "pass" if all(r["outcome"] == "pass" for r in rs) else "FAIL"])
    lines = [f"Plugin on (`CASCADE_POLICY=always`) vs off, chosen-token logprobs, "
             f"{_setup(meta)} ({_source(path)}); workloads: "
             + "; ".join(CORRECTNESS_WORKLOADS.values()) + ":", "",
             *_table(["runners", "TP", "CUDA graphs of the plugin", "workloads",
                      "max \\|Δ logprob\\|", "mean \\|Δ logprob\\| (worst workload)",
                      "steps run as cascade", "outcome"], body)]
    for r in corrupted:
        verdict = "and does" if r["outcome"] == "fail" else "but DID NOT"
        what = ("one page of the shared prefix read as its neighbour"
                if r.get("corrupted") == "one page" else "every page id shifted by one")
        lines += ["", f"A deliberately corrupted plan ({what}) must fail "
                      f"the same comparison, {verdict}: mean \\|Δ\\| "
                      f"{r['mean_abs_dlogprob']:.3f}, max {r['max_abs_dlogprob']:.3f}."]
    return lines


def block_kernel_correctness() -> list[str]:
    path = H200 / "kernel_correctness.json"
    report = _load(path)
    cases = report["cases"]
    real = [c for c in cases if "corrupt" not in c["name"]]
    bad = [c for c in cases if "corrupt" in c["name"]]
    line = (f"Kernel level ({_source(path)}, {report.get('device', 'GPU not recorded')}): "
            f"{len(real)} comparisons of the executors with flat attention and an fp32 reference, "
            f"largest error {max(c['max_abs_err'] for c in real):.1e} "
            f"({sum(c['outcome'] == 'pass' for c in real)} of {len(real)} within tolerance)")
    if bad:
        line += (f"; {len(bad)} corrupted plans caught with errors "
                 f"{min(c['max_abs_err'] for c in bad):.2f}{DASH}"
                 f"{max(c['max_abs_err'] for c in bad):.2f} against a "
                 f"{max(c['tol'] for c in bad):.2f} tolerance")
    return [line + "."]


def block_soak() -> list[str]:
    path = H200 / "soak.json"
    s, meta = _load(path), _meta(path)
    # the memory that lives (the process's figure less the allocator's free cache) where the
    # run read it, else the process's figure
    memory = s.get("memory_live_mib") or [s["memory_before_mib"], s["memory_after_mib"]]
    return [f"Soak ({_source(path)}, {_setup(meta)}): **{s['outcome']}**. "
            f"{_int(s['requests'])} requests over {s['duration_s']:.0f} s with "
            f"{_int(s['aborts'])} aborts and {_int(s['preemptions'])} preemptions; cascade on "
            f"{100 * s['cascade_step_fraction']:.1f}% of decode steps; a greedy subset replayed "
            f"without the plugin agreed within max \\|Δ logprob\\| {s['max_abs_dlogprob']:.3f} "
            f"(mean {s['mean_abs_dlogprob']:.3f}); device memory "
            f"{_int(memory[0])} → {_int(memory[1])} MiB "
            f"({100 * s['memory_change_fraction']:+.1f}%) between the first minute and the end."]


def block_demo_cpu() -> list[str]:
    """The plan, its KV pages and the numerical check of ``vllm-cascade demo`` without a GPU."""
    text = (CPU / "demo.txt").read_text().splitlines()
    keep = [line for line in text if line.lstrip().startswith(("level ", "KV pages read"))
            or line.rstrip().endswith(("PASS", "FAIL"))]
    return ["```", *keep, "```"]


BLOCKS: dict[str, Callable[[], list[str]]] = {
    "summary": block_summary, "e2e": block_e2e, "kernel": block_kernel,
    "planner": block_planner, "serve": block_serve, "correctness": block_correctness,
    "kernel_correctness": block_kernel_correctness, "soak": block_soak,
    "demo_cpu": block_demo_cpu, "compatibility": block_compatibility,
}


def render(text: str) -> str:
    """``text`` with every generated block re-rendered; an unknown block name is an error."""
    def one(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise KeyError(f"README block {name!r}: no renderer (known: {', '.join(BLOCKS)})")
        return m.group(1) + "\n".join(BLOCKS[name]()) + "\n" + m.group(4)
    return BLOCK.sub(one, text)


def block_names(text: str) -> list[str]:
    return [m.group("name") for m in BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if README.md is not what the result files render")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    old = args.readme.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{args.readme}: generated blocks are stale; run python "
                  f"scripts/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        args.readme.write_text(new)
        print(f"readme_tables: rewrote {', '.join(block_names(new))} in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
