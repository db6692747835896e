"""Render the measured figures of README.md and docs/ from the committed result files.

    python scripts/readme_tables.py            # rewrite the documents' generated blocks
    python scripts/readme_tables.py --check    # exit 1 if a document differs from what it renders

Every block of README.md and of the documents in ``DOCUMENTS`` between ``<!-- table:NAME -->``
and ``<!-- /table -->`` is generated here from ``benchmarks/results/`` (standard library only);
the rest is prose without measured figures. ``tests/test_readme.py`` fails when a block differs
from what this renders from the committed JSON, so a new result file means running this script.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its parts, wherever it is loaded from
from readme_common import (
    CPU,
    DASH,
    GPU,
    ROOT,
    TIMES,
    _int,
    _load,
    _meta,
    _ratio,
    _setup,
    _source,
    _table,
)
from readme_compat import block_compatibility
from readme_glance import block_costs, block_exactness, block_glance, block_serve_summary
from readme_serve import block_serve, serve_headline

README = ROOT / "README.md"
# Every document with generated blocks: the README, and the docs its evidence moved to.
DOCUMENTS = (README, ROOT / "docs" / "performance.md", ROOT / "docs" / "compatibility.md")
BLOCK = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
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


# ---------------------------------------------------------------------------------------- blocks


def e2e_speedups() -> dict[str, tuple[float, float | None]]:
    """workload -> (plugin / flat FlashInfer, plugin / FLASH_ATTN) output tokens/s."""
    rows = _load(GPU / "e2e.json")
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
    meta = _meta(GPU / "e2e.json")
    parts = [f"{_ratio(s)} with {E2E_WORKLOADS.get(w, w).replace('`', '')}" for w, (s, _) in
             speed.items()]
    grid = [r for r in _load(GPU / "kernel_grid.json") if r["ms"].get("plugin")]
    best = max(grid, key=lambda r: r["ms"]["fi_decode"] / r["ms"]["plugin"])
    return [f"End to end on an {_setup(meta)} (Llama-3-8B shapes, dummy weights), output "
            f"tokens/s against flat FlashInfer: {'; '.join(parts)}. {serve_headline()}Per "
            f"attention layer, up to "
            f"{_ratio(best['ms']['fi_decode'] / best['ms']['plugin'])} faster than flat "
            f"FlashInfer decode ({best['B']} requests {TIMES} {best['P']:,} shared tokens). "
            f"Details below."]


def block_e2e() -> list[str]:
    path = GPU / "e2e.json"
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
    path = GPU / "kernel_grid.json"
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


def block_correctness() -> list[str]:
    path = GPU / "correctness.json"
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
    path = GPU / "kernel_correctness.json"
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
    path = GPU / "soak.json"
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
    "glance": block_glance, "costs": block_costs, "exactness": block_exactness,
    "serve_summary": block_serve_summary,
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
                        help="exit 1 if a document is not what the result files render")
    parser.add_argument("--readme", type=Path, action="append",
                        help="a document to render (repeatable; default: README.md and docs/ "
                             "files with blocks)")
    args = parser.parse_args(argv)
    stale = []
    for path in args.readme or DOCUMENTS:
        old = path.read_text()
        new = render(old)
        if new == old:
            continue
        if args.check:
            stale.append(path)
            print(f"{path}: generated blocks are stale; run python scripts/readme_tables.py",
                  file=sys.stderr)
        else:
            path.write_text(new)
            print(f"readme_tables: rewrote {', '.join(block_names(new))} in {path}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
