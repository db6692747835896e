"""Render the benchmark JSON of one or more result folders as PNG plots beside it.

    python3 -m benchmarks.plot_results benchmarks/results/gpu [benchmarks/results/cpu ...]

``e2e.json`` -> ``e2e.png`` (output tokens/s per engine configuration, and the ratio to flat
FlashInfer); ``planner.json`` -> ``planner.png`` (planner CPU time per decode step);
``kernel_grid.json`` -> ``kernel_grid.png`` (ms per attention layer call against B, one panel per
prefix length, the five methods and the bandwidth/compute floor). Needs matplotlib (imported
only here, lazily): ``pip install matplotlib``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

E2E_LABELS = {  # e2e/bench.py configuration -> label, in plotting order
    "flash_attn": "FLASH_ATTN\n(vLLM default)",
    "flashinfer": "FLASHINFER\n(flat)",
    "cascade": "cascade\n(policy auto)",
    "cascade_always": "cascade\n(policy always)",
    "cascade_unfused": "cascade\n(no fused decode)",
    "cascade_nographs": "cascade\n(no CUDA graphs)",
    "cascade_layergraphs": "cascade\n(per-layer graphs)",
}



def _save(fig: Any, out: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out

def _meta(folder: Path, name: str) -> dict[str, Any]:
    path = folder / f"{name}.meta.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def plot_e2e(folder: Path, plt: Any) -> Path:
    rows = json.loads((folder / "e2e.json").read_text())
    meta = _meta(folder, "e2e")
    workloads = sorted({r["workload"] for r in rows})
    cols = min(len(workloads), 2)
    grid_rows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(7.5 * cols, 5 * grid_rows), squeeze=False)
    for ax in axes.flat[len(workloads):]:
        ax.axis("off")
    for ax, workload in zip(axes.flat, workloads, strict=False):
        by_config = {r["config"]: r for r in rows if r["workload"] == workload}
        configs = [c for c in E2E_LABELS if c in by_config] + sorted(
            c for c in by_config if c not in E2E_LABELS)
        speeds = [by_config[c]["out_tok_per_s"] for c in configs]
        base = by_config.get("flashinfer", {}).get("out_tok_per_s")
        # Rows of a second GPU that ran at the same time (e2e.json "gpu" 1) say so.
        labels = [E2E_LABELS.get(c, c) + ("\n[GPU 1]" if by_config[c].get("gpu") == 1 else "")
                  for c in configs]
        bars = ax.bar(labels, speeds,
                      color=["#999999" if c.startswith("flash") else "#2a7ab9" for c in configs])
        for bar, config, speed in zip(bars, configs, speeds, strict=True):
            note = f"{speed:,.0f}"
            if base:
                note += f"\n{speed / base:.2f}x"
            counters = by_config[config].get("plugin_counters")
            if counters:
                note += f"\ncascade {counters['steps_cascade']}/{counters['steps_planned']} steps"
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(0, max(speeds) * 1.3)
        ax.set_title(workload, fontsize=10)
    fig.suptitle(f"End to end on {meta.get('gpu', '?')}: vLLM {meta.get('vllm', '?')}, "
                 f"FlashInfer {meta.get('flashinfer', '?')}\n{meta.get('model', '')}", fontsize=9)
    return _save(fig, folder / "e2e.png", plt)


def plot_planner(folder: Path, plt: Any) -> Path:
    rows = json.loads((folder / "planner.json").read_text())
    meta = _meta(folder, "planner")
    labels = [f"{r['case']}\n{r['requests']} rows\n{r['pages']} pages" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    series = [("steady_median_us", "steady decode step"),
              ("steady_keyed_median_us", "steady, told the rows that changed"),
              ("churn_median_us", "one request replaced per step"),
              ("churn_keyed_median_us", "replaced, told the rows that changed"),
              ("cold_median_us", "cold (new block table)")]
    series = [(key, label) for key, label in series if all(key in r for r in rows)]
    width = 0.8 / len(series)
    for n, (key, label) in enumerate(series):
        offset = (n - (len(series) - 1) / 2) * width
        bars = ax.bar([i + offset for i in x], [r[key] for r in rows], width=width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("planner time per step, µs (median)")
    ax.legend()
    ax.set_title(f"Cascade planner, CPU {meta.get('machine', '?')} (machine/cores), "
                 f"numpy {meta.get('numpy', '?')}", fontsize=10)
    fig.tight_layout()
    out = folder / "planner.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


KERNEL_STYLES = {  # kernels/bench.py method -> (label, line style), in legend order
    "plugin": ("plugin (what it runs)", {"color": "#2a7ab9", "lw": 2.5, "marker": "o",
                                         "zorder": 5}),
    "plugin_cascade_fa3": ("plugin FA3 executor (always cascade)",
                           {"color": "#2a7ab9", "lw": 1, "ls": "--", "marker": "."}),
    "plugin_cascade": ("plugin FlashInfer executor (always cascade)",
                       {"color": "#8e44ad", "lw": 1, "ls": "--", "marker": "."}),
    "fi_decode": ("FlashInfer decode (vLLM flat)", {"color": "#777777", "marker": "s"}),
    "fi_cascade": ("FlashInfer MultiLevelCascade", {"color": "#e08a1e", "marker": "^"}),
    "fa3_decode": ("FA3 decode (vLLM FLASH_ATTN)", {"color": "#3a9a3a", "marker": "v"}),
    "fa3_cascade": ("FA3 cascade_attention (vLLM <= 0.31)", {"color": "#c0392b", "marker": "D"}),
}


def _kernel_panel(ax: Any, rows: list[dict[str, Any]], x_key: str) -> None:
    rows = sorted(rows, key=lambda r: r[x_key])
    xs = [r[x_key] for r in rows]
    for method, (label, style) in KERNEL_STYLES.items():
        points = [(x, r["ms"].get(method)) for x, r in zip(xs, rows, strict=True)]
        points = [(x, y) for x, y in points if isinstance(y, (int, float))]
        if points:
            ax.plot(*zip(*points, strict=True), label=label, ms=4, **style)
    ax.plot(xs, [r["floor_ms"] for r in rows], color="black", ls=":", label="floor (4.3 TB/s, "
            "790 TFLOP/s)")
    for x, r in zip(xs, rows, strict=True):
        if not r.get("ok", True):
            ax.annotate("ERR", (x, r["floor_ms"]), color="red", fontsize=8, ha="center")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.grid(True, which="both", alpha=0.3)


def plot_kernels(folder: Path, plt: Any) -> Path:
    rows = json.loads((folder / "kernel_grid.json").read_text())
    meta = _meta(folder, "kernel_grid")
    single = [r for r in rows if r["groups"] == 1]
    prefixes = sorted({r["P"] for r in single})
    grouped = {(r["B"], r["P"]) for r in rows if r["groups"] > 1}
    panels = len(prefixes) + len(grouped)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(4.2 * max(panels, 1), 4.6),
                             squeeze=False, sharey=True)
    axes = list(axes[0])
    for ax, prefix in zip(axes, prefixes, strict=False):
        _kernel_panel(ax, [r for r in single if r["P"] == prefix], "B")
        ax.set_title(f"P = {prefix} shared tokens, 1 group", fontsize=9)
        ax.set_xlabel("B (requests, 1 query token each)")
    for ax, (batch, prefix) in zip(axes[len(prefixes):], sorted(grouped), strict=False):
        _kernel_panel(ax, [r for r in rows if r["B"] == batch and r["P"] == prefix], "groups")
        ax.set_title(f"B = {batch}, P = {prefix} per group", fontsize=9)
        ax.set_xlabel("groups (each its own prefix)")
    axes[0].set_ylabel("ms per attention layer call (median GPU time)")
    axes[0].legend(fontsize=7, loc="upper left")
    own = sorted({r["S"] for r in rows})
    fig.suptitle(f"Decode attention, Llama-3-8B heads (32 q / 8 kv, d=128), bf16, page 16, "
                 f"{'/'.join(map(str, own))} own tokens per request\n{meta.get('gpu', '?')}: "
                 f"vLLM {meta.get('vllm', '?')}, FlashInfer {meta.get('flashinfer', '?')}, "
                 f"torch {meta.get('torch', '?')}, {meta.get('date', '?')}", fontsize=9)
    return _save(fig, folder / "kernel_grid.png", plt)


PLOTS = {"e2e.json": plot_e2e, "planner.json": plot_planner, "kernel_grid.json": plot_kernels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="result folders")
    args = parser.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print("plot_results: matplotlib is not installed (pip install matplotlib)",
              file=sys.stderr)
        return 1
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = 0
    for folder in args.folders:
        for name, plot in PLOTS.items():
            if (folder / name).is_file():
                print(f"plot_results: {plot(folder, plt)}")
                written += 1
    if not written:
        print(f"plot_results: no {' or '.join(PLOTS)} in {', '.join(map(str, args.folders))}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
