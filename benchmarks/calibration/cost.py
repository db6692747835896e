"""Fit the cost models (``vllm_cascade_plugin.planning.cost.COST_MODELS``) to the H200 measurements.

    PYTHONPATH=src python3 -m benchmarks.calibration.cost [--results benchmarks/results/gpu]

One model per cascade executor (``CASCADE_KERNEL``: ``flashinfer``, ``fa3``); flat attention is
vLLM's FlashInfer decode in both. Per layer call, from ``kernel_grid.json`` (``kernels/bench.py``):
for every row the planner plans the row's layout and the model estimates flat attention
(measured: ``fi_decode``) and the executor (measured: ``plugin_cascade`` for FlashInfer's,
``plugin_cascade_fa3`` for FA3's; on a grid measured before the FA3 executor existed, vLLM's own
FA3 cascade ``fa3_cascade``, the same kernels, on the single-group rows, stands in). The fit
minimises the squared log error of both over all rows (Nelder-Mead in log-parameter space, numpy
only, under the H200's physical ceilings). Per step, what a cascade step costs beyond its kernels
(host planning, attention outside FULL CUDA graphs): ``step_fixed_us`` closes the gap between the
model's kernel saving over 32 layers and what end-to-end runs measured between flat FlashInfer
and cascade on every step (``cascade_always``), both from one file of ``E2E_FILES`` (rows of
that executor), and for FlashInfer's also ``DEMO_FILE`` (the demo's default workload). The FA3
executor's comes from ``SERVING_FILE`` where it exists: batches of 32 to 128 requests, the sizes a
server decodes at, flat FLASH_ATTN against cascade on every step, the largest overhead. An
executor without such runs gets FlashInfer's step cost less the difference of their host
planning measured in the grid (``plan_us_parts``). Writes ``cost_calibration.json`` with every
row's estimates and the pick the fitted model makes there (``regret``: the measured time of what
it picks over the faster of the two; 1.0 = the right pick). Paste the fitted values into
``COST_MODELS``; ``tests/planning/test_cost.py`` checks the shipped models against the same files.

The flat side alone, per vLLM attention backend (``FLAT_BACKENDS``): ``flat_fixed_us`` and
``flat_bandwidth`` fitted the same way to the flat estimates alone, on every grid row that
measured that backend's flat decode (FLASHINFER: ``fi_decode``; FLASH_ATTN: FlashAttention 3's
``fa3_decode``), from ``START``. Written under ``flat_backends`` with every row's measured and
model time; FLASH_ATTN's values go into ``cost.FLASH_ATTN_FLAT``, which the FLASH_ATTN backend
puts in place of the executor's flat terms (FLASHINFER's are those of the executors' fits).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.calibration.step import (
    DEMO_FILE,
    E2E_FILES,
    LLAMA3_8B_LAYER,
    SERVING_FILE,
    decode_plan,
    e2e_points,
    host_plan_us,
    serving_points,
    serving_step_cost,
    step_cost,
)
from benchmarks.common import RESULTS
from vllm_cascade_plugin.planning.cost import COST_MODELS, CostModel, decide
from vllm_cascade_plugin.planning.planner import CascadePlan

FITTED = ("flat_fixed_us", "flat_bandwidth", "level_fixed_us", "request_us", "flops",
          "group_bandwidth", "shared_bandwidth")
# Physical ceilings on an H200: no kernel computes faster than the tensor cores' dense bf16 peak,
# and a level's groups together stream no faster than HBM. (The grid is all decode, so nothing
# in it pins the compute rate down; without the ceiling the fit drifts above the hardware.)
CEILINGS = {"flops": 790e12, "shared_bandwidth": 4.8e12}
# Where the fit starts: the first model's values (fitted by hand to seven early measurements).
# The problem has flat directions (a ceiling or a max() that never binds), so the start is fixed
# to make the result reproducible.
START = CostModel(flat_fixed_us=40.0, flat_bandwidth=9e12, level_fixed_us=50.0, request_us=1.3,
                  flops=400e12, group_bandwidth=0.35e12, shared_bandwidth=4e12, step_fixed_us=0.0)


# Executor -> (its kernel-grid column, a stand-in column for grids measured before it existed).
COLUMNS = {"flashinfer": ("plugin_cascade", None), "fa3": ("plugin_cascade_fa3", "fa3_cascade")}
def grid_column(rows: Sequence[dict], kernel: str) -> tuple[str, bool]:
    """The grid column that measured ``kernel``'s executor, and whether it is the stand-in."""
    column, proxy = COLUMNS[kernel]
    if any(r.get("ms", {}).get(column) for r in rows) or proxy is None:
        return column, False
    return proxy, True


def grid_points(rows: Sequence[dict], column: str = "plugin_cascade",
                proxy: bool = False) -> list[tuple[dict, CascadePlan]]:
    """The grid's rows that measured both methods, each with the plan of its layout.

    A stand-in column (vLLM's FA3 cascade) counts on single-group rows only: vLLM runs one
    prefix per call, so its multi-group rows time several calls in sequence.
    """
    return [(row, decode_plan(row["B"], row["P"], row["S"], row["groups"])) for row in rows
            if row.get("ms", {}).get("fi_decode") and row["ms"].get(column)
            and not (proxy and row["groups"] > 1)]


def estimates(model: CostModel, points: Sequence[tuple[dict, CascadePlan]]) -> np.ndarray:
    """[rows, 2] model estimates (flat, cascade) in µs."""
    out = [decide(plan, LLAMA3_8B_LAYER, model) for _, plan in points]
    return np.array([[d.flat_us, d.cascade_us] for d in out])


def measured(points: Sequence[tuple[dict, CascadePlan]],
             column: str = "plugin_cascade") -> np.ndarray:
    """[rows, 2] measured (flat FlashInfer decode, the executor's ``column``) in µs."""
    return np.array([[1e3 * r["ms"]["fi_decode"], 1e3 * r["ms"][column]] for r, _ in points])


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.3,
                iterations: int = 4000, tol: float = 1e-10) -> np.ndarray:
    """Minimise ``f`` from ``x0`` (the textbook simplex method; enough for 7 parameters)."""
    n = len(x0)
    simplex = np.vstack([x0] + [x0 + step * np.eye(n)[i] for i in range(n)])
    values = np.array([f(x) for x in simplex])
    for _ in range(iterations):
        order = np.argsort(values)
        simplex, values = simplex[order], values[order]
        if values[-1] - values[0] < tol:
            break
        centroid = simplex[:-1].mean(axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best point
                simplex[1:] = simplex[0] + 0.5 * (simplex[1:] - simplex[0])
                values[1:] = [f(x) for x in simplex[1:]]
    return simplex[np.argmin(values)]


def fit(points: Sequence[tuple[dict, CascadePlan]], start: CostModel,
        column: str = "plugin_cascade") -> CostModel:
    """The per-layer terms (``FITTED``) that best explain the grid; ``start``'s others kept."""
    truth = np.log(measured(points, column))

    def model_at(x: np.ndarray) -> CostModel:
        values = dict(zip(FITTED, np.exp(x).tolist(), strict=True))
        return dataclasses.replace(start, **{name: min(value, CEILINGS.get(name, value))
                                             for name, value in values.items()})

    def loss(x: np.ndarray) -> float:
        return float(np.sum((np.log(estimates(model_at(x), points)) - truth) ** 2))

    x = np.log([getattr(start, name) for name in FITTED])
    # Restarts from the best point: the simplex collapses early on plateaus of max().
    for _ in range(4):
        x = nelder_mead(loss, x)
    return model_at(x)


def report(model: CostModel, points: Sequence[tuple[dict, CascadePlan]],
           column: str = "plugin_cascade") -> list[dict]:
    est, truth = estimates(model, points), measured(points, column)
    rows = []
    for (row, _), (flat, cascade), (flat_m, cascade_m) in zip(points, est, truth, strict=True):
        pick_cascade = cascade * (1 + model.margin) < flat
        picked = cascade_m if pick_cascade else flat_m
        rows.append({"B": row["B"], "P": row["P"], "S": row["S"], "groups": row["groups"],
                     "measured_us": {"flat": round(flat_m, 1), "cascade": round(cascade_m, 1)},
                     "model_us": {"flat": round(flat, 1), "cascade": round(cascade, 1)},
                     "picks": "cascade" if pick_cascade else "flat",
                     "regret": round(picked / min(flat_m, cascade_m), 3)})
    return rows


def calibrate(kernel: str, grid: Sequence[dict], results: Path,
              reference_fixed: float | None = None) -> dict[str, Any]:
    """Fit one executor's model; ``reference_fixed``: FlashInfer's per-step cost, for an
    executor without end-to-end runs of its own."""
    column, proxy = grid_column(grid, kernel)
    points = grid_points(grid, column, proxy)
    per_layer = fit(points, START, column)
    e2e = e2e_points(results, kernel, max(row["B"] for row in grid))
    serving = serving_points(results) if kernel == "fa3" else []
    note, miss = None, None
    if serving:
        fixed, miss, e2e_report = serving_step_cost(serving, per_layer)
        if e2e:  # reported beside, not fitted: runs at other batch sizes or of older code
            e2e_report += [{**row, "fitted": False} for row in step_cost(e2e, per_layer)[1]]
        note = (f"per-step cost: the largest overhead of the {len(serving)} serving-sized "
                f"points of {SERVING_FILE} against flat FLASH_ATTN")
    elif e2e:
        fixed, e2e_report = step_cost(e2e, per_layer)
    else:  # FlashInfer's step cost with this executor's host planning instead of FlashInfer's
        assert reference_fixed is not None, f"no end-to-end run of {kernel} or FlashInfer"
        b = [p.stats.num_requests for _, p, _, _ in e2e_points(results, "flashinfer")]
        theirs = [host_plan_us(grid, "flashinfer", n) for n in b]
        ours = [host_plan_us(grid, kernel, n) or 0.0 for n in b]
        fixed = reference_fixed - float(np.mean([t - o for t, o in zip(theirs, ours,
                                                                          strict=True)]))
        e2e_report = []
        note = (f"no end-to-end run with this executor: FlashInfer's per-step cost "
                f"{reference_fixed:.0f} us less the difference of the two executors' host "
                f"planning at {b} requests")
    fitted = dataclasses.replace(per_layer, step_fixed_us=float(f"{fixed:.3g}"))
    names = (*FITTED, "step_fixed_us")
    return {"grid_column": column, "stand_in": proxy, "note": note,
            "fitted": {name: float(f"{getattr(fitted, name):.3g}") for name in names},
            # FLASH_ATTN's flat decode of pages read again past the L2 window, fitted with the
            # per-step cost on the same runs (cost.FLASH_ATTN_MISS_BANDWIDTH)
            "flat_miss_bandwidth": miss,
            "shipped": {name: getattr(COST_MODELS[kernel], name) for name in names},
            "end_to_end": e2e_report, "grid_rows_per_layer": report(per_layer, points, column)}


# vLLM's attention backend -> the kernel-grid column of its flat decode.
FLAT_BACKENDS = {"FLASHINFER": "fi_decode", "FLASH_ATTN": "fa3_decode"}
FLAT_FITTED = ("flat_fixed_us", "flat_bandwidth")


def calibrate_flat(grid: Sequence[dict], column: str) -> dict[str, Any]:
    """Fit the flat side alone (``FLAT_FITTED``) to one flat decode's grid column: every row
    that measured it, the squared log error of the flat estimates, from ``START``'s values."""
    points = [(row, decode_plan(row["B"], row["P"], row["S"], row["groups"])) for row in grid
              if row.get("ms", {}).get(column)]
    truth = np.array([1e3 * row["ms"][column] for row, _ in points])

    def model_at(x: np.ndarray) -> CostModel:
        return dataclasses.replace(START, **dict(zip(FLAT_FITTED, np.exp(x).tolist(),
                                                     strict=True)))

    def flat_us(model: CostModel) -> np.ndarray:
        return np.array([decide(plan, LLAMA3_8B_LAYER, model).flat_us for _, plan in points])

    def loss(x: np.ndarray) -> float:
        return float(np.sum((np.log(flat_us(model_at(x))) - np.log(truth)) ** 2))

    x = np.log([getattr(START, name) for name in FLAT_FITTED])
    for _ in range(4):  # restarts, as in fit()
        x = nelder_mead(loss, x)
    fitted = {name: float(f"{value:.3g}") for name, value
              in zip(FLAT_FITTED, np.exp(x).tolist(), strict=True)}
    est = flat_us(dataclasses.replace(START, **fitted))
    return {"grid_column": column, "fitted": fitted,
            "worst_relative_error": round(float(np.max(np.abs(est / truth - 1))), 3),
            "rows": [{"B": row["B"], "P": row["P"], "S": row["S"], "groups": row["groups"],
                      "measured_us": round(m, 1), "model_us": round(e, 1)}
                     for (row, _), m, e in zip(points, truth, est, strict=True)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS / "gpu")
    args = parser.parse_args()
    grid = json.loads((args.results / "kernel_grid.json").read_text())
    executors: dict[str, Any] = {}
    for kernel in COLUMNS:  # FlashInfer's first: an executor without e2e runs starts from it
        fi = executors.get("flashinfer", {}).get("fitted", {})
        executors[kernel] = calibrate(kernel, grid, args.results, fi.get("step_fixed_us"))
    result = {"date": datetime.date.today().isoformat(),
              "inputs": ["kernel_grid.json", *E2E_FILES, SERVING_FILE, DEMO_FILE],
              "command": " ".join(["python", *sys.argv]), "margin": CostModel().margin,
              "executors": executors,
              "flat_backends": {backend: calibrate_flat(grid, column)
                                for backend, column in FLAT_BACKENDS.items()}}
    (args.results / "cost_calibration.json").write_text(json.dumps(result, indent=1) + "\n")
    for kernel, fitted in executors.items():
        regrets = [r["regret"] for r in fitted["grid_rows_per_layer"]]
        print(f"{kernel}: per layer: {len(regrets)} grid rows ({fitted['grid_column']}), worst "
              f"pick {max(regrets):.3f}x the faster one")
        for row in fitted["end_to_end"]:
            print(f"  per step: {row['point']}: cascade step costs {row['overhead_us']:.0f} us "
                  f"beyond its kernels{'' if row.get('fitted', True) else ' (not fitted)'}")
        if fitted["note"]:
            print(f"  per step: {fitted['note']}")
        print(f"  fitted: {json.dumps(fitted['fitted'])}")
    for backend, flat in result["flat_backends"].items():
        print(f"flat {backend}: {len(flat['rows'])} grid rows ({flat['grid_column']}), worst "
              f"estimate off by {100 * flat['worst_relative_error']:.1f}%")
        print(f"  fitted: {json.dumps(flat['fitted'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
