"""Kernel benchmark: one decode step of attention, five ways, over the issue #5 grid.

Usage (on the GPU machine, after ``source .devb/setup_device.sh``):
    python3 -m benchmarks.kernels.bench [--out DIR] [--quick] [--rows 256x8192x4,8x512] [--reps N]

A step: B requests, one query token each, split evenly into ``groups`` contiguous groups. Each
group shares a P-token prefix (its own pages); each request then holds S own tokens (its own
pages), so every request attends to P + S tokens. Llama-3-8B attention (32 q / 8 kv heads,
head_dim 128), bf16, page 16. Per row, the same query and the same KV cache go through:

- ``fi_decode``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` as vLLM 0.26's FlashInfer
  backend builds and plans it for decode on an H200 without the flashinfer-cubin package
  (tensor cores, ``backend="auto"``, no CUDA graph, fixed_split_size -1), over every request's
  full page list.
- ``fi_cascade``: FlashInfer's ``MultiLevelCascadeAttentionWrapper``, 2 levels (each group's
  prefix, then every request's own pages).
- ``fa3_decode``: vLLM's bundled FA3 ``flash_attn_varlen_func`` with a block table, called as
  vLLM 0.26's FLASH_ATTN backend calls it in eager mode (AOT scheduler metadata, num_splits 0).
- ``fa3_cascade``: vLLM 0.26's own ``cascade_attention`` (prefix, suffix, merge). It takes one
  prefix common to the whole batch; rows with groups > 1 call it once per group, in sequence,
  inside one timed region (see ``fa3_cascade_note``).
- ``plugin``: what the plugin runs for this step: the planner's plan, the cost model's
  decision, then ``FlashInferCascadeExecutor.run`` when it chose cascade, else vLLM's flat
  decode (the ``fi_decode`` measurement). The executor is always timed, as ``plugin_cascade``.

One KV cache serves all five: vLLM 0.26 allocates FLASHINFER's and FLASH_ATTN's caches alike,
``(num_blocks, block_size, num_kv_heads, 2 * head_dim)`` in memory (NHD), and both backends
pass the K and V halves of the last dimension as strided views (no copy). Pages are distinct,
shuffled, never block 0, scattered over a pool of ``--pool-pages`` pages.

Timing: GPU time of one layer call, median over ``--reps`` after warm-up, CUDA events. Before
each repetition the L2 cache is flushed (``--l2-flush-mib``: in a model, 31 other layers run
between two calls of one layer) and the GPU spins (``torch.cuda._sleep``) for three times the
call's host time, so every launch is queued before the start event fires: the number is the
kernels' time, not Python's. ``host_us`` is what the host spends per call.
Host planning is timed separately (median of ``--plan-reps``): ``plan_us`` (planner + cost
model + executor.plan, steady state), ``fi_decode_plan_us`` and the like; it is paid once per
step, across all layers.

Correctness, per row, before timing: every output against ``fi_decode`` (and ``fi_decode``
against an fp32 reference on two requests), max abs error <= 2e-2 (bf16 outputs of averages
over >= 640 N(0, 1) values). A disagreement marks the row ``"ok": false``, is printed, lands
in the summary, and makes the exit status 1.

Writes ``kernel_grid.json`` (a list of rows), ``kernel_grid.meta.json`` (provenance) and
``kernel_grid.summary.json`` (the issue's four targets, correctness) into ``--out``.

Here: the command line, the run and its files (and ``--redecide``). The parts: ``kernels/grid.py``
(the grid, the floor, each row's pages), ``kernels/methods.py`` (one row), ``kernels/gpu.py`` (the
kernels every row reuses, the timer, the fp32 reference), ``kernels/targets.py`` (the plugin's
choice, ratios, targets, the summary table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, command_line, tqdm_write
from benchmarks.kernels.gpu import Gpu, Timer
from benchmarks.kernels.grid import (
    EXECUTOR_COLUMNS,
    GRID_S,
    HBM_BYTES_PER_S,
    HEAD_DIM,
    METHODS,
    NUM_KV_HEADS,
    NUM_QO_HEADS,
    PAGE,
    PEAK_FLOPS,
    QUICK,
    TOLERANCE,
    Case,
    build_layout,
    grid,
    parse_rows,
)
from benchmarks.kernels.methods import run_case
from benchmarks.kernels.targets import (
    evaluate_targets,
    fmt,
    record_choice,
    row_label,
    summary_lines,
)


def progress(cases: Sequence[Case]) -> Iterable[Case]:
    try:
        from tqdm import tqdm
    except ImportError:
        return cases
    # On a terminal only (disable=None), like the other benchmarks: logs stay clean.
    return tqdm(cases, desc="kernel grid", unit="row", disable=None)


def _vllm_has_flashinfer_cubin() -> bool | str:
    """vLLM's own test (no network): True means vLLM 0.26 on sm_90 would decode with XQA."""
    try:
        from vllm.utils.flashinfer import has_flashinfer_cubin

        return bool(has_flashinfer_cubin())
    except Exception as exc:
        return f"unknown ({type(exc).__name__})"


def provenance(gpu: Gpu, args: argparse.Namespace, timer: Timer, extra: dict[str, Any]) -> dict:
    import flashinfer
    import torch
    import vllm

    return {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
        "vllm": vllm.__version__, "flashinfer": flashinfer.__version__,
        "torch": torch.__version__, "python": platform.python_version(),
        "command": command_line(),
        "cuda": torch.version.cuda, "num_sms": gpu.num_sms,
        "shape": {"num_qo_heads": NUM_QO_HEADS, "num_kv_heads": NUM_KV_HEADS,
                  "head_dim": HEAD_DIM, "dtype": "bfloat16", "page_size": PAGE},
        "kv_cache": "one (num_blocks, 16, 8, 256) bf16 tensor (vLLM 0.26 NHD, K|V packed in the "
                    "last dim); K and V are strided views for all five methods",
        "pool_pages": args.pool_pages, "seed": args.seed,
        "timing": {"reps": args.reps, "warmup": args.warmup, "plan_reps": args.plan_reps,
                   "statistic": "median", "l2_flush_mib": timer.flush_mib,
                   "spin": "torch.cuda._sleep before each rep, >= max(200 us, 3x host time)",
                   "sleep_cycles_per_us": timer.cycles_per_us},
        "floor": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "flops": PEAK_FLOPS},
        "tolerance": TOLERANCE,
        "vllm_has_flashinfer_cubin": _vllm_has_flashinfer_cubin(),
        "fi_decode_note": "vLLM 0.26 on sm_90 decodes with XQA only when flashinfer-cubin is "
                          "installed or NVIDIA's artifactory is reachable (see vllm_has_flashinfer_"
                          "cubin; the H200 machine is offline), otherwise with the tensor-core "
                          "BatchDecode wrapper fi_decode times",
        **extra,
    }



def redecide(out: Path, argv: Sequence[str] | None) -> int:
    """The plugin column of a measured grid under the shipped cost model (CPU only).

    The choice is the one ``run_case`` makes (same layout, planner and ``decide``); the times
    are the row's own measurements of the chosen method, so nothing is re-measured.
    """
    from vllm_cascade_plugin.planning.planner import plan_cascade

    rows = json.loads((out / "kernel_grid.json").read_text())
    changed = []
    for row in rows:
        kernel = row.get("plugin_kernel", "flashinfer")
        case = Case(row["B"], row["P"], row["S"], row["groups"])
        layout = build_layout(case, np.random.default_rng(0))
        plan = plan_cascade(layout.block_table, layout.seq_lens, np.ones(case.B, np.int32), PAGE)
        before = row.get("plugin_choice")
        choice = record_choice(row, plan, kernel)
        if choice != before:
            changed.append(f"{row_label(row)}: {before} -> {choice}")
        column = EXECUTOR_COLUMNS[kernel] if choice == "cascade" else "fi_decode"
        row["ms"]["plugin"] = row["ms"].get(column)
        errors = row.get("max_abs_err") or {}
        errors["plugin"] = errors.get(column) if choice == "cascade" else 0.0
    targets = evaluate_targets(rows)
    lines = summary_lines(rows, targets)
    print("\n".join(lines))
    print("changed:", changed or "none")
    meta = json.loads((out / "kernel_grid.meta.json").read_text())
    meta["plugin_column_redecided"] = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", "benchmarks/kernels/bench.py", *(argv or sys.argv[1:])]),
        "why": "the plugin column holds the choice of the shipped cost model; the rows were "
               "measured with the model of the commit named in 'command'",
        "changed": changed}
    (out / "kernel_grid.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "kernel_grid.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    summary = json.loads((out / "kernel_grid.summary.json").read_text())
    summary.update(targets=targets, table=lines)
    (out / "kernel_grid.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=RESULTS / "gpu")
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(QUICK)} rows only: " + ", ".join(c.label for c in QUICK))
    parser.add_argument("--rows", help="only these rows: BxP[xGROUPS[xS]],... e.g. 256x8192x4")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per method")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per method first")
    parser.add_argument("--plan-reps", type=int, default=5, help="repetitions of host planning")
    parser.add_argument("--pool-pages", type=int, default=32768,
                        help="KV pool the pages are scattered over (x 64 KiB)")
    parser.add_argument("--l2-flush-mib", type=int, default=256,
                        help="MiB written before each timed call to flush the L2 (0: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redecide", action="store_true",
                        help="no GPU: re-take the plugin's flat/cascade choice of every row in "
                             "--out's kernel_grid.json with the shipped cost model (after a "
                             "recalibration) and rewrite the plugin column and the summary")
    args = parser.parse_args(argv)
    if args.redecide:
        return redecide(args.out, argv)
    try:
        cases = parse_rows(args.rows) if args.rows else list(QUICK) if args.quick else grid()
    except ValueError as exc:
        parser.error(str(exc))
    if min(args.reps, args.warmup, args.plan_reps) < 1 or args.l2_flush_mib < 0:
        parser.error("--reps, --warmup and --plan-reps must be >= 1, --l2-flush-mib >= 0")
    started = time.perf_counter()
    gpu = Gpu()
    timer = Timer(gpu, args.reps, args.warmup, flush_mib=args.l2_flush_mib)
    # JIT compilation and first-use costs outside the measurements: a small two-group row.
    warm = run_case(Case(8, 512, GRID_S, 2), gpu, timer, np.random.default_rng(1), 1,
                    0, 1)
    warmup_s = time.perf_counter() - started
    tqdm_write(f"warm-up (imports, JIT, first launches): {warmup_s:.1f} s"
               + ("" if warm["ok"] else f"; warm-up row problems: {warm['errors']}"))
    rng = np.random.default_rng(args.seed)
    rows = []
    for i, case in enumerate(progress(cases)):
        row = run_case(case, gpu, timer, rng, args.seed + i, args.pool_pages, args.plan_reps)
        rows.append(row)
        ms = row["ms"]
        tqdm_write(f"{case.label}: " + " ".join(f"{m} {fmt(ms.get(m))}" for m in METHODS)
                   + f" floor {row['floor_ms']:.4f} plugin={row.get('plugin_choice')}"
                   + ("" if row["ok"] else f"  !!! {'; '.join(row['errors'])}"))
        gpu.torch.cuda.empty_cache()
    targets = evaluate_targets(rows)
    lines = summary_lines(rows, targets)
    print("\n".join(lines), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_grid.json").write_text(json.dumps(rows, indent=1) + "\n")
    meta = provenance(gpu, args, timer, {"warmup_s": round(warmup_s, 1),
                                    "total_s": round(time.perf_counter() - started, 1)})
    (args.out / "kernel_grid.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    summary = {"targets": targets, "all_correct": all(r["ok"] for r in rows),
               "problems": {row_label(r): r["errors"] for r in rows if not r["ok"]},
               "table": lines}
    (args.out / "kernel_grid.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"benchmarks.kernels.bench: wrote {args.out}/kernel_grid{{,.meta,.summary}}.json "
          f"in {time.perf_counter() - started:.0f} s", flush=True)
    return 0 if summary["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
