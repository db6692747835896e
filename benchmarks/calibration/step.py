"""The per-step half of the cost-model calibration (``calibration/cost.py`` runs it): what a
cascade step costs beyond its kernels, from end-to-end runs with cascade on every step against
flat attention, and the decode plans those runs' steps are modelled with. numpy/stdlib only."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from benchmarks.e2e import bench as e2e_bench
from benchmarks.kernels import grid as kernel_grid
from vllm_cascade_plugin.face.demo import Workload, prefix_cached_step
from vllm_cascade_plugin.planning.cost import (
    AttentionShape,
    CostModel,
    decide,
    flash_attn_flat,
    missed_pages,
)
from vllm_cascade_plugin.planning.planner import CascadePlan, plan_cascade

LLAMA3_8B_LAYER = AttentionShape(num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)


def decode_plan(requests: int, prefix: int, own: int, groups: int = 1,
                interleaved: bool = False) -> CascadePlan:
    """The plan of a decode step: ``groups`` prefixes of ``prefix`` tokens, ``own`` more each;
    each group's requests side by side (the kernel grid's layout), or ``interleaved``: request
    ``i`` behind prefix ``i % groups`` (how ``e2e/bench.py``'s serving workloads submit them)."""
    case = kernel_grid.Case(requests, prefix, own, groups)
    layout = kernel_grid.build_layout(case, np.random.default_rng(0))
    table = layout.block_table
    if interleaved:  # row j <- the (j // groups)-th request of group j % groups
        j = np.arange(requests)
        table = np.ascontiguousarray(table[(j % groups) * (requests // groups) + j // groups])
    return plan_cascade(table, layout.seq_lens, np.ones(requests, np.int32), kernel_grid.PAGE)

# End-to-end workloads (e2e/bench.py) -> (sequences decoding together, the plan of a decode step
# halfway through their 256 generated tokens).
E2E_WORKLOADS: dict[str, tuple[int, Callable[[], CascadePlan]]] = {
    "one_8k_prefix_x64": (64, lambda: decode_plan(64, 8192, 16 + 128)),
    "b128_16k_prefix_64_own": (128, lambda: decode_plan(128, 16384, 64 + 128)),
    "8_prefixes_8k_x16_interleaved": (128, lambda: decode_plan(128, 8192, 64 + 128, 8)),
    "n16_sampling_32_prompts_4k": (512, lambda: decode_plan(512, 4096, 128, 32)),
}

# End-to-end results with cascade-on-every-step runs (``cascade_always``), oldest first:
# FlashInfer's executor, the FA3 executor with whole-step graphs, the current table (which has
# such rows only when it was run with that configuration). benchmarks/README.md says what each is.
E2E_FILES = ("e2e_step_cost_flashinfer.json", "e2e_step_cost_fa3.json", "e2e.json")
# `vllm-cascade demo`'s output with FlashInfer's executor: a per-step point of FlashInfer's model.
DEMO_FILE = "demo_flashinfer_executor.txt"


def e2e_rows(results: Path) -> list[dict]:
    """Every end-to-end row, with its ``file``; rows without ``kernel`` predate the FA3
    executor (FlashInfer's)."""
    rows = []
    for name in E2E_FILES:
        if (results / name).exists():
            for row in json.loads((results / name).read_text()):
                rows.append({**row, "file": name, "kernel": row.get("kernel") or (
                    ["flashinfer"] if row["config"].startswith("cascade") else [])})
    return rows


def e2e_points(results: Path, kernel: str = "flashinfer", max_requests: int = 256
               ) -> list[tuple[str, CascadePlan, float, float]]:
    """(name, mid-generation decode plan, flat step µs, cascade step µs) of each end-to-end run
    that measured flat FlashInfer against ``kernel``'s cascade on (nearly) every step, Llama-3-8B
    shape, with at most ``max_requests`` sequences decoding together (the grid's largest B)."""
    rows = e2e_rows(results)
    points = []
    for workload, (sequences, plan) in E2E_WORKLOADS.items():
        if sequences > max_requests:
            continue  # beyond the kernel grid's batch sizes: its per-layer terms do not reach
        on = [r for r in rows if r["workload"] == workload and r["config"] == "cascade_always"
              and r["kernel"] == [kernel]]
        # Flat FlashInfer of the same file (the same engine build and machine).
        flat = [r for r in rows if r["workload"] == workload and r["config"] == "flashinfer"
                and on and r["file"] == on[-1]["file"]]
        if not flat or not on:
            continue
        counters = on[-1].get("plugin_counters")
        if counters and counters["steps_cascade"] < 0.9 * counters["steps_planned"]:
            continue  # not cascade on (nearly) every step
        flat_us, cascade_us = (1e6 * r["seconds"] / (r["output_tokens"] / sequences)
                               for r in (flat[-1], on[-1]))
        points.append((f"e2e {workload}", plan(), flat_us, cascade_us))
    demo = results / DEMO_FILE
    found = re.search(r"plugin off ([\d,]+) tok/s, plugin on ([\d,]+) tok/s",
                      demo.read_text()) if demo.exists() and kernel == "flashinfer" else None
    if found:  # `vllm-cascade demo`'s default workload, FlashInfer's executor then; cascade ran
        workload = Workload()  # on 127 of its 128 steps
        table, seq_lens, query_lens = prefix_cached_step(workload.prompts(32000),
                                                         workload.max_tokens // 2)
        off, on_ = (float(x.replace(",", "")) for x in found.groups())
        points.append(("vllm-cascade demo", plan_cascade(table, seq_lens, query_lens, 16),
                       1e6 * workload.requests / off, 1e6 * workload.requests / on_))
    return points


def host_plan_us(grid: Sequence[dict], kernel: str, requests: int) -> float | None:
    """The executor's host planning per step (grid ``plan_us_parts``) at ``requests`` rows."""
    key = {"flashinfer": ("executor_plan_flashinfer", "executor_plan"),
           "fa3": ("executor_plan_fa3",)}[kernel]
    found = [(r["B"], v) for r in grid if r["groups"] == 1
             for v in [next((r.get("plan_us_parts", {}).get(k) for k in key
                             if r.get("plan_us_parts", {}).get(k) is not None), None)]
             if v is not None]
    if not found:
        return None
    sizes = sorted({b for b, _ in found})
    means = [float(np.mean([v for b, v in found if b == size])) for size in sizes]
    return float(np.interp(requests, sizes, means))


def step_cost(points: Sequence[tuple[str, CascadePlan, float, float]], per_layer: CostModel,
              num_layers: int = 32, flat_side: Callable[[CostModel], CostModel] = lambda m: m,
              ) -> tuple[float, list[dict]]:
    """``step_fixed_us``: a cascade step's measured cost beyond the model's kernel estimates.

    For each end-to-end point: (cascade step - flat step) + the model's per-step kernel saving
    (``num_layers`` x (flat - cascade) per layer), averaged over the points. No per-request
    term: FlashInfer's executor's host planning grows ~14 µs per request in isolation
    (``kernel_grid.json`` ``plan_us_parts``), but its two end-to-end points (64 and 128 requests)
    show no such growth (async scheduling hides part).
    """
    model = flat_side(dataclasses.replace(per_layer, step_fixed_us=0.0))
    rows = []
    for name, plan, flat_us, cascade_us in points:
        d = decide(plan, LLAMA3_8B_LAYER, model)
        saving = num_layers * (d.flat_us - d.cascade_us)
        rows.append({"point": name, "requests": plan.stats.num_requests,
                     "levels": plan.num_levels, "flat_step_us": round(flat_us, 1),
                     "cascade_step_us": round(cascade_us, 1),
                     "model_kernel_saving_us": round(saving, 1),
                     "overhead_us": round(cascade_us - flat_us + saving, 1)})
    return float(np.mean([r["overhead_us"] for r in rows])), rows


# End-to-end runs at the batch sizes a server decodes at (e2e/bench.py SERVING_SHAPES), on vLLM's
# default backend: flat FLASH_ATTN (``flash_attn``) against the FA3 executor with cascade on every
# step (``cascade_flash_attn_always``), one file, one machine. Where present, the FA3 executor's
# per-step cost comes from these alone (see ``serving_step_cost``).
SERVING_FILE = "e2e_step_cost_fa3_serving.json"


def serving_points(results: Path) -> list[tuple[str, CascadePlan, float, float]]:
    """(name, decode plan halfway through the 256 generated tokens, flat step µs, cascade step
    µs) of each serving-sized workload in ``SERVING_FILE`` with cascade on (nearly) every step."""
    path = results / SERVING_FILE
    rows = json.loads(path.read_text()) if path.exists() else []
    points = []
    for name, count, length, own in e2e_bench.SERVING_SHAPES:
        for requests in e2e_bench.SERVING_BATCHES[name]:
            workload = f"{name}_b{requests}"
            found = {config: [r for r in rows if r["workload"] == workload
                              and r["config"] == config]
                     for config in ("flash_attn", "cascade_flash_attn_always")}
            if not all(found.values()):
                continue
            flat, on = found["flash_attn"][-1], found["cascade_flash_attn_always"][-1]
            if flat.get("machine") != on.get("machine"):
                continue  # a pair measured on two machines
            counters = on.get("plugin_counters") or {}
            if counters.get("steps_cascade", 0) < 0.9 * counters.get("steps_planned", 1):
                continue  # not cascade on (nearly) every step
            flat_us, cascade_us = (1e6 * r["seconds"] / (r["output_tokens"] / requests)
                                   for r in (flat, on))
            points.append((f"serving {workload}",
                           decode_plan(requests, length, own + 128, count, interleaved=True),
                           flat_us, cascade_us))
    return points


def serving_step_cost(points: Sequence[tuple[str, CascadePlan, float, float]],
                      per_layer: CostModel, num_layers: int = 32,
                      ) -> tuple[float, float | None, list[dict]]:
    """The FA3 executor's ``step_fixed_us`` and FLASH_ATTN's flat ``miss_bandwidth`` from
    ``SERVING_FILE``'s points (their requests interleaved over the documents).

    First the per-step cost of the points whose flat decode reads no shared page again past
    the L2 window (``cost.missed_pages``: one document, or 4 with rows 4 apart): the most a
    cascade step cost beyond the model's kernel saving against FLASH_ATTN's flat decode (never
    below 0; the largest, not the mean: an upper bound keeps a step in doubt flat). Then, for
    each other point, the miss bandwidth at which its modelled saving, that per-step cost
    included, is the measured one (the extra flat time is linear in 1 / bandwidth), and of
    those the largest, rounded up: the least extra time any of them shows, so no point costs
    more than the per-step cost with it. (None: no point reads a page again past the window.)
    The per-step cost is then checked over every point."""
    def flat_side(bandwidth: float | None) -> Callable[[CostModel], CostModel]:
        return lambda m: dataclasses.replace(flash_attn_flat(m), miss_bandwidth=bandwidth)

    probe = flat_side(1.0)(per_layer)  # any bandwidth: which pages are missed
    missed = [missed_pages(plan, probe) for _, plan, _, _ in points]
    clean = [p for p, m in zip(points, missed, strict=True) if not m]
    _, rows = step_cost(clean or points, per_layer, num_layers, flat_side(None))
    fixed = max(0.0, max(r["overhead_us"] for r in rows))
    bandwidth = None
    if any(missed):
        base = flat_side(None)(dataclasses.replace(per_layer, step_fixed_us=0.0))
        token_bytes = 2 * LLAMA3_8B_LAYER.num_kv_heads * LLAMA3_8B_LAYER.head_dim * (
            LLAMA3_8B_LAYER.dtype_bytes)
        slopes = []  # each point's 1/bw - 1/flat_bw: its extra flat µs per layer / (1e6 bytes)
        for (_, plan, flat_us, cascade_us), pages in zip(points, missed, strict=True):
            if pages:
                d = decide(plan, LLAMA3_8B_LAYER, base)
                extra = (flat_us - cascade_us + fixed) / num_layers - (d.flat_us - d.cascade_us)
                slopes.append(extra / (1e6 * pages * plan.page_size * token_bytes))
        fastest = 1 / (max(min(slopes), 0.0) + 1 / base.flat_bandwidth)
        bandwidth = float(np.ceil(fastest / 1e11) * 1e11)  # rounded up to 0.1 TB/s
    _, rows = step_cost(points, per_layer, num_layers, flat_side(bandwidth))
    return max(fixed, max(r["overhead_us"] for r in rows)), bandwidth, rows
