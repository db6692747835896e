"""What the serving benchmark records: result rows and files, the plot, the machine.

Rows merge the client's ``vllm bench serve`` result with the server's counters over the run
(``metrics``); a results file holds every row, ``<out>.meta.json`` beside it every
invocation's provenance. No server and no client here.
"""

from __future__ import annotations

import contextlib
import json
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.serve.metrics import (
    BY_LABEL,
    derived,
    fractions,
    request_times,
    shared_cascade_fraction,
)
from benchmarks.serve.pairs import DEFAULT_MODEL, model_of
from benchmarks.serve.workloads import BURST

ROW_KEYS = ("workload", "config", "request_rate", "tensor_parallel_size", "output_tok_per_s",
            "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "cascade_step_fraction",
            "graph_replay_fraction", "capture_warnings")


EXTRAS = {  # extra row key -> vllm bench serve result field
    "num_prompts": "num_prompts", "completed": "completed", "failed": "failed",
    "duration_s": "duration", "request_throughput": "request_throughput",
    "total_output_tokens": "total_output_tokens", "ttft_ms_mean": "mean_ttft_ms",
    "tpot_ms_mean": "mean_tpot_ms", "itl_ms_p50": "p50_itl_ms", "itl_ms_p99": "p99_itl_ms",
    "e2el_ms_p50": "p50_e2el_ms", "max_concurrent_requests": "max_concurrent_requests"}


def make_row(*, workload: str, config: str, request_rate: float | str, tensor_parallel_size: int,
             result: dict[str, Any], delta: dict[str, float | None], plugin_on: bool,
             capture_warnings: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One result row: :data:`ROW_KEYS` first, then extras (counts, means, provenance)."""
    step_fraction, replay_fraction = fractions(delta, plugin_on)
    row = {"workload": workload, "config": config, "request_rate": request_rate,
           "tensor_parallel_size": tensor_parallel_size,
           "output_tok_per_s": result.get("output_throughput"),
           "ttft_ms_p50": result.get("p50_ttft_ms"), "ttft_ms_p99": result.get("p99_ttft_ms"),
           "tpot_ms_p50": result.get("p50_tpot_ms"), "tpot_ms_p99": result.get("p99_tpot_ms"),
           "cascade_step_fraction": step_fraction, "graph_replay_fraction": replay_fraction,
           "capture_warnings": capture_warnings}
    row.update({k: result.get(field) for k, field in EXTRAS.items()})
    if row["request_throughput"] is None and result.get("duration"):
        row["request_throughput"] = result["completed"] / result["duration"]
    row.update(request_times(delta))
    row.update(derived(delta, plugin_on))
    row["shared_cascade_fraction"] = shared_cascade_fraction(row)
    row.update({k: v for k, v in delta.items() if k not in BY_LABEL})
    row.update(extra)
    return row


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``new`` (an invocation's rows so far) after ``old``: every other run's rows are kept (a
    point measured again is one more run of it, beside the earlier ones: docs/performance.md's
    table shows a point's latest run and the range over all its runs); rows of ``new``'s own runs
    (``run_id``) are replaced."""
    runs = {r.get("run_id") for r in new}
    return [r for r in old if r.get("run_id") not in runs] + new


def load_rows(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else []


def rows_kept(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` but those of a run ``<path>.meta.json`` marks ``left_out`` (it could not resolve
    what it measured: a rate taken from it would carry that on)."""
    meta_path = path.with_suffix(".meta.json")
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    left_out = {run.get("run_id") for run in meta.get("runs", [])
                if isinstance(run, dict) and run.get("left_out")}
    return [row for row in rows if row.get("run_id") not in left_out]


def write_results(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Rows to ``out``; ``meta`` (this invocation) to ``<out>.meta.json`` beside it, the earlier
    invocations' meta kept under ``runs`` (rows name theirs by ``run_id``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    meta_path = out.with_suffix(".meta.json")
    old = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    runs = [r for r in old.get("runs", []) if r.get("run_id") != meta["run_id"]]
    meta_path.write_text(json.dumps({**meta, "runs": [*runs, meta]}, indent=1))


def baseline_rates(rows: list[dict[str, Any]], baseline: str, tp: int,
                   model: str = DEFAULT_MODEL, key: str = "request_throughput",
                   ) -> dict[str, Any]:
    """The sustainable rate per workload: req/s of ``baseline``'s burst rows serving ``model``
    (``pairs.model_of``: a model's rates never come from another's bursts), the latest row's;
    ``key``: another field of the same rows (``run_id``: the run that measured the rate)."""
    return {r["workload"]: r.get(key) for r in rows
            if r["config"] == baseline and r["request_rate"] == BURST and model_of(r) == model
            and r["tensor_parallel_size"] == tp and r.get("request_throughput")}


# (flat config, plugin config, backend) the plot compares, first found first: vLLM's default
# backend, else FlashInfer's
PLOT_PAIRS = (("flash_attn", "cascade_flash_attn", "FLASH_ATTN"),
              ("flashinfer", "cascade", "FLASHINFER"))
PLOT_WORKLOADS = {  # workload -> what it is, in the plot's order (most sharing first)
    "prefix_32k_x1": "one 32K-token document", "prefix_8k_x4": "4 documents of 8K",
    "prefix_2k_x16": "16 documents of 2K", "chat_1k5_system": "chat, 1.5K system prompt",
    "chat_1k_prefill_heavy": "prefill-heavy chat,\n1K system prompt",
    "random_2k": "no sharing (2K random)"}
PLOT_BARS = (("90%", "tpot_ms_p50", True,
              "TPOT p50 at 90% of flat's burst rate: flat \u00f7 plugin"),
             (BURST, "output_tok_per_s", False, "a burst's output tokens/s: plugin \u00f7 flat"))


def plot(out: Path, order: Sequence[str] = ()) -> Path:
    """Plugin over flat per workload, on one linear axis (above 1: the plugin better): TPOT p50
    at 90% load and a burst's output tokens/s, each bar the latest run, its whisker the range
    over every run (each against its own flat server). ``<out>.png``, from the JSON only;
    ``order`` is accepted for the callers' sake (the shipped configs are compared)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.serve.pairs import ratios, serve_runs

    rows = load_rows(out)
    bars: list[tuple[str, list[list[float]]]] = []  # workload label -> per bar kind, the ratios
    backends: set[str] = set()
    gpus: set[str] = set()
    names = list(PLOT_WORKLOADS)
    for workload in sorted({r["workload"] for r in rows},
                           key=lambda w: (names.index(w) if w in names else len(names), w)):
        for flat, plugin, backend in PLOT_PAIRS:
            runs = serve_runs(rows, flat, plugin, workload)
            found = [ratios(runs.get(spec, []), key, lower) for spec, key, lower, _ in PLOT_BARS]
            if any(found):
                mine = sorted({str(r.get("gpu") or "GPU not recorded").split(" (")[0]
                               .removeprefix("NVIDIA ").split(" ")[0]
                               for pairs in runs.values() for pair in pairs for r in pair})
                label = f"{PLOT_WORKLOADS.get(workload, workload)}\n{', '.join(mine)}"
                bars.append((label if backend == "FLASH_ATTN" else f"{label}, {backend}",
                             found))
                backends.add(backend)
                gpus.update(mine)
                break
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(bars) + 2), 4.2))
    width = 0.38
    for i, (_, _, _, label) in enumerate(PLOT_BARS):
        xs = [j + (i - 0.5) * width for j in range(len(bars))]
        latest = [found[i][-1] if found[i] else 0.0 for _, found in bars]
        pairs = list(zip(latest, bars, strict=True))
        low = [v - min(found[i]) if found[i] else 0.0 for v, (_, found) in pairs]
        high = [max(found[i]) - v if found[i] else 0.0 for v, (_, found) in pairs]
        ax.bar(xs, latest, width, yerr=[low, high], capsize=3, color=f"C{i}", label=label)
        for x, (_, found), v, up in zip(xs, bars, latest, high, strict=True):
            ax.annotate(f"{v:.2f}\u00d7" if found[i] else "not\nmeasured", (x, v + up),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
    ax.set_ylabel("plugin over flat (above 1: better)")
    ax.set_ylim(0, max([1.2, *(max(f) * 1.12 for _, found in bars for f in found if f)]))
    ax.set_title(f"vllm serve, the plugin over flat on the same backend "
                 f"({', '.join(sorted(backends)) or 'none'}); bar: latest run, whisker: every run",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


# --- The machine ------------------------------------------------------------------------


def provenance() -> dict[str, str]:
    found = {"python": platform.python_version(), "gpu": "unknown"}
    for name in ("vllm", "flashinfer-python", "torch", "vllm-cascade-plugin"):
        try:
            found[name.removesuffix("-python")] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name.removesuffix("-python")] = "not installed"
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # no CUDA context here
        found["gpu"] = ", ".join(sorted(set(subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
            text=True, timeout=30, check=True).stdout.splitlines()) - {""}))
    return found
