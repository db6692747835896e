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
    point measured again is one more run of it, beside the earlier ones: the README's table
    shows a point's latest run and the range over all its runs); rows of ``new``'s own runs
    (``run_id``) are replaced."""
    runs = {r.get("run_id") for r in new}
    return [r for r in old if r.get("run_id") not in runs] + new


def load_rows(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else []


def write_results(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Rows to ``out``; ``meta`` (this invocation) to ``<out>.meta.json`` beside it, the earlier
    invocations' meta kept under ``runs`` (rows name theirs by ``run_id``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    meta_path = out.with_suffix(".meta.json")
    old = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    runs = [r for r in old.get("runs", []) if r.get("run_id") != meta["run_id"]]
    meta_path.write_text(json.dumps({**meta, "runs": [*runs, meta]}, indent=1))


def baseline_rates(rows: list[dict[str, Any]], baseline: str, tp: int) -> dict[str, float]:
    """The sustainable rate per workload: req/s of ``baseline``'s burst rows."""
    return {r["workload"]: r["request_throughput"] for r in rows
            if r["config"] == baseline and r["request_rate"] == BURST
            and r["tensor_parallel_size"] == tp and r.get("request_throughput")}


def plot(out: Path, order: Sequence[str] = ()) -> Path:
    """TPOT p50 (solid) and TTFT p99 (dashed) against request rate, a line per config, a panel
    per workload; bursts at the rate they achieved. ``<out>.png``, from the JSON only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A run whose every request failed measured nothing.
    rows = [r for r in load_rows(out)
            if r.get("tpot_ms_p50") is not None and r.get("completed", 1)]
    workloads = sorted({r["workload"] for r in rows})
    cols = max(min(len(workloads), 3), 1)
    grid = max(-(-len(workloads) // cols), 1)
    fig, axes = plt.subplots(grid, cols, figsize=(6 * cols, 4.2 * grid), squeeze=False)
    for ax in axes.flat[len(workloads):]:
        ax.axis("off")
    configs = sorted({r["config"] for r in rows},
                     key=lambda c: (list(order).index(c) if c in order else len(order), c))
    for ax, workload in zip(axes.flat, workloads, strict=False):
        twin = ax.twinx()
        for i, config in enumerate(configs):
            mine = [r for r in rows if r["workload"] == workload and r["config"] == config]
            points = sorted((x, j, r) for j, r in enumerate(mine) if (x := (
                r.get("request_throughput") if r["request_rate"] == BURST
                else r["request_rate"])) is not None)
            if not points:
                continue
            xs = [x for x, _, _ in points]
            ax.plot(xs, [r["tpot_ms_p50"] for *_, r in points], "o-", color=f"C{i}", label=config)
            twin.plot(xs, [r["ttft_ms_p99"] for *_, r in points], "s--", color=f"C{i}", alpha=0.6)
            for x, _, r in points:
                if r["request_rate"] == BURST:
                    ax.annotate("burst", (x, r["tpot_ms_p50"]), fontsize=7, color=f"C{i}")
        ax.set_title(workload)
        ax.set_xlabel("request rate (req/s; burst: achieved)")
        ax.set_ylabel("TPOT p50 (ms), solid")
        twin.set_ylabel("TTFT p99 (ms), dashed")
        twin.set_yscale("log")
        ax.legend(fontsize=8, loc="upper left")
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
