"""Kernel benchmark: one decode step of attention, five ways, over the issue #5 grid.

Usage (on the GPU machine, after ``source .devb/setup_device.sh``):
    python3 benchmarks/kernel_bench.py [--out DIR] [--quick] [--rows 256x8192x4,8x512] [--reps N]

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
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PAGE = 16
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE_BYTES = 2  # bf16
NUM_LAYERS = 32  # Llama-3-8B: the plugin's per-step cost is spread over them
HBM_BYTES_PER_S = 4.3e12  # H200 HBM3e, achievable
PEAK_FLOPS = 790e12  # H200 dense bf16 tensor cores, achievable
TOLERANCE = 2e-2
WORKSPACE_BYTES = 394 * 1024 * 1024  # vLLM 0.26's VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE
METHODS = ("plugin", "fi_decode", "fi_cascade", "fa3_decode", "fa3_cascade")
TIMED = ("fi_decode", "plugin_cascade", "plugin_cascade_fa3", "fi_cascade", "fa3_decode",
         "fa3_cascade")
# The plugin's two executors (CASCADE_KERNEL): their timing columns.
EXECUTOR_COLUMNS = {"flashinfer": "plugin_cascade", "fa3": "plugin_cascade_fa3"}

GRID_B = (8, 32, 64, 128, 256)
GRID_P = (512, 2048, 8192, 32768)
GRID_S = 128
GROUP_ROWS = ((256, 8192, 4), (256, 8192, 16))  # (B, P, groups)


# ----------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Case:
    B: int  # requests (= query tokens)
    P: int  # shared prefix tokens per group
    S: int = GRID_S  # own tokens per request
    groups: int = 1

    def __post_init__(self) -> None:
        if self.B < 1 or self.P < PAGE or self.S < 1 or self.groups < 1:
            raise ValueError(f"{self}: need B >= 1, P >= {PAGE}, S >= 1, groups >= 1")
        if self.P % PAGE:
            raise ValueError(f"{self}: P must be whole pages of {PAGE} (FA3's cascade asserts it)")
        if self.B % self.groups or self.B // self.groups < 2:
            raise ValueError(f"{self}: groups must divide B into groups of >= 2 requests")

    @property
    def label(self) -> str:
        return f"B={self.B} P={self.P} S={self.S} G={self.groups}"


def grid() -> list[Case]:
    """The issue's grid: B x P at S = 128, one group; plus 4 and 16 groups at P = 8192, B = 256."""
    return [Case(b, p) for p in GRID_P for b in GRID_B] + [
        Case(b, p, GRID_S, g) for b, p, g in GROUP_ROWS]


QUICK = (Case(8, 512), Case(256, 8192), Case(256, 8192, GRID_S, 4))


def parse_rows(text: str) -> list[Case]:
    """``"256x8192,256x8192x4,8x512x1x64"``: B x P [x groups [x S]] per row, S default 128."""
    cases = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            numbers = [int(n) for n in item.lower().split("x")]
        except ValueError:
            raise ValueError(f"row {item!r}: expected BxP[xGROUPS[xS]]") from None
        if not 2 <= len(numbers) <= 4:
            raise ValueError(f"row {item!r}: expected BxP[xGROUPS[xS]]")
        b, p, *rest = numbers
        groups = rest[0] if rest else 1
        s = rest[1] if len(rest) > 1 else GRID_S
        cases.append(Case(b, p, s, groups))
    if not cases:
        raise ValueError("no rows given")
    return cases


def unique_kv_bytes(case: Case) -> int:
    """KV bytes a step must read at least: each group's prefix once, each request's own tokens."""
    tokens = case.groups * case.P + case.B * case.S
    return tokens * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE_BYTES  # K and V


def attention_flops(case: Case) -> int:
    """QK^T and PV: 2 * 2 * head_dim FLOPs per query head and key token."""
    return 4 * case.B * NUM_QO_HEADS * HEAD_DIM * (case.P + case.S)


def floor_ms(case: Case) -> float:
    """max(unique KV bytes / 4.3 TB/s, attention FLOPs / 790 TFLOP/s), in ms."""
    return 1e3 * max(unique_kv_bytes(case) / HBM_BYTES_PER_S, attention_flops(case) / PEAK_FLOPS)


# ---------------------------------------------------------------------------- page layout


@dataclass(frozen=True)
class PagedLevel:
    """One level in FlashInfer's paged format (int32 numpy arrays)."""

    qo_indptr: np.ndarray  # [G + 1]
    kv_page_indptr: np.ndarray  # [G + 1]
    kv_page_indices: np.ndarray  # [nnz]
    kv_last_page_len: np.ndarray  # [G]


@dataclass(frozen=True)
class Layout:
    """A case's pages: ``block_table[r]`` = its group's prefix pages, then its own pages."""

    case: Case
    block_table: np.ndarray  # int32 [B, P/PAGE + ceil(S/PAGE)]
    seq_lens: np.ndarray  # int32 [B], all P + S
    prefix_pages: np.ndarray  # int32 [groups, P/PAGE]
    own_pages: np.ndarray  # int32 [B, ceil(S/PAGE)]
    num_blocks: int  # pages in the cache; ids are in 1..num_blocks-1

    @property
    def group_size(self) -> int:
        return self.case.B // self.case.groups

    def group_rows(self, g: int) -> slice:
        return slice(g * self.group_size, (g + 1) * self.group_size)

    def _last_page_len(self, tokens: int, n: int) -> np.ndarray:
        return np.full(n, tokens - PAGE * (-(-tokens // PAGE) - 1), np.int32)

    def flat(self) -> PagedLevel:
        """Every request over its full page list (one query each): the decode kernels' input."""
        b, width = self.block_table.shape
        return PagedLevel(
            qo_indptr=np.arange(b + 1, dtype=np.int32),
            kv_page_indptr=(np.arange(b + 1) * width).astype(np.int32),
            kv_page_indices=self.block_table.reshape(-1).copy(),
            kv_last_page_len=self._last_page_len(self.case.P + self.case.S, b),
        )

    def cascade(self) -> tuple[PagedLevel, PagedLevel]:
        """The two cascade levels: each group's prefix (non-causal), each request's own pages."""
        c = self.case
        prefix_width, own_width = self.prefix_pages.shape[1], self.own_pages.shape[1]
        shared = PagedLevel(
            qo_indptr=(np.arange(c.groups + 1) * self.group_size).astype(np.int32),
            kv_page_indptr=(np.arange(c.groups + 1) * prefix_width).astype(np.int32),
            kv_page_indices=self.prefix_pages.reshape(-1).copy(),
            kv_last_page_len=np.full(c.groups, PAGE, np.int32),
        )
        own = PagedLevel(
            qo_indptr=np.arange(c.B + 1, dtype=np.int32),
            kv_page_indptr=(np.arange(c.B + 1) * own_width).astype(np.int32),
            kv_page_indices=self.own_pages.reshape(-1).copy(),
            kv_last_page_len=self._last_page_len(c.S, c.B),
        )
        return shared, own


def build_layout(case: Case, rng: np.random.Generator, pool_pages: int = 0) -> Layout:
    """Distinct random page ids (never block 0, vLLM's null block) over a pool of
    ``max(pool_pages, pages needed + 1)`` pages, groups contiguous in batch order."""
    prefix_width, own_width = case.P // PAGE, -(-case.S // PAGE)
    needed = case.groups * prefix_width + case.B * own_width
    num_blocks = max(pool_pages, needed + 1)
    ids = (rng.permutation(num_blocks - 1)[:needed] + 1).astype(np.int32)
    prefix = ids[: case.groups * prefix_width].reshape(case.groups, prefix_width)
    own = ids[case.groups * prefix_width :].reshape(case.B, own_width)
    group_of = np.arange(case.B) // (case.B // case.groups)
    return Layout(
        case=case,
        block_table=np.ascontiguousarray(np.concatenate([prefix[group_of], own], axis=1)),
        seq_lens=np.full(case.B, case.P + case.S, np.int32),
        prefix_pages=prefix,
        own_pages=own,
        num_blocks=num_blocks,
    )


# ------------------------------------------------------------------------- targets, summary


def _ms(row: dict[str, Any], method: str) -> float | None:
    value = (row.get("ms") or {}).get(method)
    return float(value) if isinstance(value, (int, float)) else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def row_ratios(row: dict[str, Any]) -> dict[str, float | None]:
    plugin = _ms(row, "plugin")
    return {
        "fi_decode/plugin": _ratio(_ms(row, "fi_decode"), plugin),
        "fa3_cascade/plugin": _ratio(_ms(row, "fa3_cascade"), plugin),
        "plugin/floor": _ratio(plugin, row.get("floor_ms")),
    }


def _label(row: dict[str, Any]) -> str:
    return f"B={row['B']} P={row['P']} G={row['groups']}"


def evaluate_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's four targets on ``rows``; ``pass`` is None where no row is eligible.

    A row whose numbers are missing (a method failed) fails the target it is eligible for.
    """

    def each(name: str, rule: str, eligible: Callable[[dict], bool],
             value: Callable[[dict], float | None], ok: Callable[[float], bool],
             worst: Callable[[Iterable[float]], float], threshold: float) -> dict[str, Any]:
        chosen = [r for r in rows if eligible(r)]
        values = {_label(r): value(r) for r in chosen}
        missing = [k for k, v in values.items() if v is None]
        present = {k: v for k, v in values.items() if v is not None}
        failing = [k for k, v in present.items() if not ok(v)]
        return {"name": name, "rule": rule, "rows": list(values), "threshold": threshold,
                "value": worst(present.values()) if present else None,
                "failing": failing, "missing": missing,
                "pass": None if not chosen else not failing and not missing}

    def both(r: dict, a: str, b: str) -> tuple[float, float] | None:
        x, y = _ms(r, a), _ms(r, b)
        return None if x is None or y is None else (x, y)

    targets = [
        each("plugin_never_slower", "plugin <= fi_decode on every row (value: worst "
             "plugin/fi_decode)", lambda r: True,
             lambda r: (lambda p: p and p[0] / p[1])(both(r, "plugin", "fi_decode")),
             lambda v: v <= 1.0, max, 1.0),
    ]
    eligible2 = [r for r in rows if r["groups"] == 1 and r["B"] * r["P"] >= 262144]
    speedups = [row_ratios(r)["fi_decode/plugin"] for r in eligible2]
    missing2 = [_label(r) for r, s in zip(eligible2, speedups, strict=True) if s is None]
    present2 = [s for s in speedups if s is not None and s > 0]
    geomean = math.exp(statistics.fmean(math.log(s) for s in present2)) if present2 else None
    targets.append({
        "name": "geomean_speedup_vs_fi_decode",
        "rule": "geomean(fi_decode/plugin) >= 3 over single-group rows with B*P >= 262144",
        "rows": [_label(r) for r in eligible2], "threshold": 3.0, "value": geomean,
        "failing": [] if geomean is None or geomean >= 3.0 else ["geomean"],
        "missing": missing2,
        "pass": None if not eligible2 else (geomean is not None and geomean >= 3.0
                                            and not missing2),
    })
    targets.append(each(
        "beats_fa3_cascade", "plugin <= fa3_cascade / 1.3 for B >= 64 and P >= 8192 (value: "
        "smallest fa3_cascade/plugin)", lambda r: r["B"] >= 64 and r["P"] >= 8192,
        lambda r: (lambda p: p and p[1] / p[0])(both(r, "plugin", "fa3_cascade")),
        lambda v: v >= 1.3, min, 1.3))
    targets.append(each(
        "near_floor", "plugin <= 3 * floor for B*P >= 2,000,000 (value: largest plugin/floor)",
        lambda r: r["B"] * r["P"] >= 2_000_000,
        lambda r: row_ratios(r)["plugin/floor"], lambda v: v <= 3.0, max, 3.0))
    return targets


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def summary_lines(rows: Sequence[dict[str, Any]], targets: Sequence[dict[str, Any]]) -> list[str]:
    """The compact table printed at the end: ms per method, ratios, targets, correctness."""
    head = (f"{'B':>4} {'P':>6} {'G':>3} | {'plugin':>13} {'fi_dec':>7} {'fi_casc':>7} "
            f"{'fa3_dec':>7} {'fa3_casc':>8} {'floor':>7} | {'fi/pl':>6} {'fa3c/pl':>7} "
            f"{'pl/floor':>8} | {'plan_us':>7} ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratios = row_ratios(r)
        choice = {"cascade": "c", "flat": "f"}.get(r.get("plugin_choice") or "", "?")
        lines.append(
            f"{r['B']:>4} {r['P']:>6} {r['groups']:>3} | {_fmt(_ms(r, 'plugin')):>11} {choice}"
            f" {_fmt(_ms(r, 'fi_decode')):>7} {_fmt(_ms(r, 'fi_cascade')):>7}"
            f" {_fmt(_ms(r, 'fa3_decode')):>7} {_fmt(_ms(r, 'fa3_cascade')):>8}"
            f" {_fmt(r.get('floor_ms'), '.4f'):>7} | {_fmt(ratios['fi_decode/plugin'], '.2f'):>6}"
            f" {_fmt(ratios['fa3_cascade/plugin'], '.2f'):>7}"
            f" {_fmt(ratios['plugin/floor'], '.1f'):>8} | {_fmt(r.get('plan_us'), '.0f'):>7}"
            f" {'yes' if r.get('ok') else 'NO'}")
    lines.append("ms per layer call (median GPU time); plugin: c = cascade, f = flat (fi_decode)")
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["pass"]]
        extra = ""
        if t["failing"]:
            extra += f"; failing: {', '.join(t['failing'])}"
        if t["missing"]:
            extra += f"; missing data: {', '.join(t['missing'])}"
        lines.append(f"target {verdict:<4} {t['rule']}: value {_fmt(t['value'], '.3g')}{extra}")
    bad = [r for r in rows if not r.get("ok")]
    if bad:
        lines.append(f"!!! CORRECTNESS/ERRORS in {len(bad)} row(s): numbers of those rows are "
                     "not trustworthy")
        lines += [f"!!!   {_label(r)}: {'; '.join(r.get('errors', []))}" for r in bad]
    else:
        lines.append(f"correctness: all {len(rows)} rows agree with fi_decode within {TOLERANCE}")
    return lines


# ------------------------------------------------------------------------------- the GPU part


class Gpu:
    """The heavy imports and the objects every row reuses (as vLLM keeps its wrappers)."""

    def __init__(self) -> None:
        if importlib.util.find_spec("vllm_cascade_plugin") is None:  # not installed: the checkout
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        import flashinfer
        import torch
        from vllm.v1.attention.backends.flash_attn import (
            cascade_attention,
            use_cascade_attention,
        )
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        from vllm_cascade_plugin.execution.kernels import (
            FlashInferCascadeExecutor,
            choose_kernel,
            make_executor,
        )

        if not torch.cuda.is_available():
            raise RuntimeError("kernel_bench needs a CUDA GPU")
        self.torch, self.flashinfer = torch, flashinfer
        self.flash_attn_varlen_func = flash_attn_varlen_func
        self.get_scheduler_metadata = get_scheduler_metadata
        self.cascade_attention = cascade_attention
        self.use_cascade_attention = use_cascade_attention
        self.device = torch.device("cuda")
        self.dtype = torch.bfloat16
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # One float workspace for every FlashInfer wrapper, as vLLM's builder shares its own.
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=False, use_tensor_cores=True, backend="auto")
        self.fi_cascade = flashinfer.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
        self.executors = {"flashinfer": FlashInferCascadeExecutor(workspace, "NHD", max_levels=3)}
        # What CASCADE_KERNEL=auto runs on this GPU: FA3 on Hopper, else FlashInfer.
        self.kernel, self.kernel_line = choose_kernel("auto", "NHD")
        if self.kernel == "fa3":
            self.executors["fa3"] = make_executor("fa3", workspace, "NHD", 3)

    def pinned(self, array: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(array, np.int32)).pin_memory()

    def on_device(self, array: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(array, np.int32)).to(self.device)


@dataclass(frozen=True)
class Timing:
    ms: float  # median GPU time per call
    ms_min: float
    host_us: float  # median host time to launch one call
    spin_us: float  # GPU spin before each repetition (must exceed host_us)


class Timer:
    """GPU time per call, free of host launch gaps and of a warm L2 (see the module docstring)."""

    def __init__(self, gpu: Gpu, reps: int, warmup: int, flush_mib: int = 256,
                 min_spin_us: float = 200.0) -> None:
        self.torch, self.reps, self.warmup, self.min_spin_us = gpu.torch, reps, warmup, min_spin_us
        self.flush_mib = flush_mib
        self.flush = gpu.torch.empty(max(flush_mib, 1) << 20, dtype=gpu.torch.uint8,
                                     device=gpu.device)
        self.cycles_per_us = self._calibrate()

    def _calibrate(self) -> float:
        torch = self.torch
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # first launch of the kernel
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        return cycles / (start.elapsed_time(end) * 1e3)

    def time(self, fn: Callable[[], Any]) -> Timing:
        torch = self.torch
        host = []
        for _ in range(self.warmup):
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        spin_us = max(self.min_spin_us, 3e6 * statistics.median(host))
        cycles = int(spin_us * self.cycles_per_us)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        host = []
        for start, end in zip(starts, ends, strict=True):
            if self.flush_mib:
                self.flush.zero_()
            torch.cuda._sleep(cycles)
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            end.record()
        torch.cuda.synchronize()
        ms = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
        return Timing(statistics.median(ms), min(ms), 1e6 * statistics.median(host), spin_us)


def host_us(fn: Callable[[], Any], reps: int) -> float:
    """Median host time of ``fn`` in µs (planning: no GPU sync inside)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def _error_text(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {str(exc)[:300]}{where}"


def reference(gpu: Gpu, q: Any, k: Any, v: Any, layout: Layout, rows: Sequence[int],
              sm_scale: float) -> Any:
    """fp32 attention of ``rows`` from the cache, GQA as the kernels do (q head h -> kv h // 4)."""
    torch = gpu.torch
    per_kv = NUM_QO_HEADS // NUM_KV_HEADS
    outs = []
    for r in rows:
        pages = gpu.on_device(layout.block_table[r]).long()
        n = int(layout.seq_lens[r])
        keys = k[pages].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].float()
        values = v[pages].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].float()
        query = q[r].float().view(NUM_KV_HEADS, per_kv, HEAD_DIM)
        probs = torch.softmax(torch.einsum("hgd,nhd->hgn", query, keys) * sm_scale, dim=-1)
        outs.append(torch.einsum("hgn,nhd->hgd", probs, values).reshape(NUM_QO_HEADS, HEAD_DIM))
    return torch.stack(outs)


def run_case(case: Case, gpu: Gpu, timer: Timer, rng: np.random.Generator, seed: int,
             pool_pages: int, plan_reps: int) -> dict[str, Any]:
    """Plan, check and time the five methods on one case; returns its row."""
    from vllm_cascade_plugin.planning.cost import COST_MODELS, AttentionShape, decide
    from vllm_cascade_plugin.planning.planner import CascadePlanner, plan_cascade

    torch = gpu.torch
    dev, dtype = gpu.device, gpu.dtype
    sm_scale = HEAD_DIM ** -0.5
    layout = build_layout(case, rng, pool_pages)
    gen = torch.Generator(dev).manual_seed(seed)
    # vLLM 0.26's cache for both backends: (blocks, block_size, kv_heads, 2 * head_dim) in memory.
    cache = torch.randn(layout.num_blocks, PAGE, NUM_KV_HEADS, 2 * HEAD_DIM, generator=gen,
                        device=dev, dtype=dtype)
    k, v = cache.split(HEAD_DIM, dim=-1)
    q = torch.randn(case.B, NUM_QO_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=dtype)
    row: dict[str, Any] = {
        "B": case.B, "P": case.P, "S": case.S, "groups": case.groups,
        "ms": {}, "floor_ms": floor_ms(case),
        "unique_kv_bytes": unique_kv_bytes(case), "flops": attention_flops(case),
    }
    errors: list[str] = []
    runs: dict[str, Callable[[], Any]] = {}
    outputs: dict[str, Any] = {}

    def attempt(name: str, body: Callable[[], None]) -> None:
        try:
            body()
        except Exception as exc:  # one failing method must not hide the other four
            errors.append(f"{name}: {_error_text(exc)}")
            tqdm_write(f"!!! {case.label} {name}: {_error_text(exc)}")

    # fi_decode: vLLM 0.26 FlashInferMetadataBuilder -> fast_plan_decode -> wrapper.plan (no
    # CUDA graph): indptr and last_page_len on the host, indices on the GPU.
    def fi_decode() -> None:
        flat = layout.flat()
        indptr, last = gpu.pinned(flat.kv_page_indptr), gpu.pinned(flat.kv_last_page_len)
        indices = gpu.on_device(flat.kv_page_indices)

        def plan() -> None:
            gpu.decode.plan(indptr, indices, last, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE,
                            pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
                            q_data_type=dtype, kv_data_type=dtype, o_data_type=dtype,
                            sm_scale=sm_scale, non_blocking=True, fixed_split_size=-1,
                            disable_split_kv=False)

        row["fi_decode_plan_us"] = host_us(plan, plan_reps)
        out = torch.empty_like(q)
        runs["fi_decode"] = lambda: gpu.decode.run(q, (k, v), out=out)
        runs["fi_decode"]()
        outputs["fi_decode"] = out

    def fi_cascade() -> None:
        levels = layout.cascade()

        def plan() -> None:
            gpu.fi_cascade.plan(
                [gpu.pinned(lv.qo_indptr) for lv in levels],
                [gpu.pinned(lv.kv_page_indptr) for lv in levels],
                [gpu.pinned(lv.kv_page_indices) for lv in levels],
                [gpu.pinned(lv.kv_last_page_len) for lv in levels],
                NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE, causal=True, sm_scale=sm_scale,
                q_data_type=dtype, kv_data_type=dtype)

        row["fi_cascade_plan_us"] = host_us(plan, plan_reps)
        runs["fi_cascade"] = lambda: gpu.fi_cascade.run(q, (k, v))
        outputs["fi_cascade"] = runs["fi_cascade"]()

    # The plugin, as step.py (policy auto) and backend.py run it for a decode step.
    def plugin() -> None:
        query_lens = np.ones(case.B, np.int32)
        args = (layout.block_table, layout.seq_lens, query_lens, PAGE)
        planner = CascadePlanner()
        planner.plan(*args)
        # The decision the plugin makes in Llama-3-8B: its per-step cost spread over 32 layers,
        # with the calibration of the executor CASCADE_KERNEL=auto picks on this GPU.
        shape = AttentionShape(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE_BYTES,
                               num_layers=NUM_LAYERS)
        model = COST_MODELS[gpu.kernel]
        parts = {"planner_cold": host_us(lambda: plan_cascade(*args), plan_reps),
                 "planner_steady": host_us(lambda: planner.plan(*args), plan_reps)}
        plan = planner.plan(*args)
        parts["decide"] = host_us(lambda: decide(plan, shape, model), plan_reps)
        row["plugin_kernel"] = gpu.kernel
        record_choice(row, plan, gpu.kernel)
        row["plan"] = {"levels": plan.num_levels, "group_sizes": list(plan.stats.group_sizes),
                       "pages_flat": plan.stats.pages_flat,
                       "pages_cascade": plan.stats.pages_cascade}
        if plan.num_levels != 2 or len(plan.stats.group_sizes) != case.groups:
            errors.append(f"plugin: planner found {plan.num_levels} levels and groups "
                          f"{plan.stats.group_sizes}, expected 2 levels and {case.groups} groups")

        for kind, executor in gpu.executors.items():
            column = EXECUTOR_COLUMNS[kind]

            def plan_executor(executor: Any = executor) -> None:
                executor.plan(plan, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS,
                              head_dim=HEAD_DIM, page_size=PAGE, sm_scale=sm_scale,
                              logits_soft_cap=None, q_dtype=dtype, kv_dtype=dtype, device=dev)

            # The same plan again: the FA3 executor keeps every level that `is` the previous
            # plan's. "_decode": a new per-request level object each call, the shared ones kept,
            # as in steady decode. "_cold": a new plan from scratch (this includes the cold
            # planner call, "planner_cold").
            parts[f"executor_plan_{kind}"] = host_us(plan_executor, plan_reps)
            if kind == "fa3":
                def plan_fa3(new_plan: Callable[[], Any], executor: Any = executor) -> None:
                    executor.plan(new_plan(), num_qo_heads=NUM_QO_HEADS,
                                  num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE,
                                  sm_scale=sm_scale, logits_soft_cap=None, q_dtype=dtype,
                                  kv_dtype=dtype, device=dev)

                parts["executor_plan_fa3_decode"] = host_us(lambda: plan_fa3(
                    lambda: dataclasses.replace(plan, levels=(
                        *plan.levels[:-1], dataclasses.replace(plan.levels[-1])))), plan_reps)
                parts["executor_plan_fa3_cold"] = host_us(
                    lambda: plan_fa3(lambda: plan_cascade(*args)), plan_reps)
            plan_executor()
            out = torch.empty_like(q)
            runs[column] = lambda executor=executor, out=out: executor.run(q, k, v, out)
            runs[column]()
            outputs[column] = out
        row["plan_us_parts"] = parts
        row["plan_us"] = (parts["planner_steady"] + parts["decide"]
                          + parts[f"executor_plan_{gpu.kernel}"])

    # fa3_decode: vLLM 0.26 FlashAttentionMetadataBuilder.build (aot_schedule, eager:
    # max_num_splits 0) and FlashAttentionImpl.forward's flash_attn_varlen_func call.
    seq_lens = gpu.on_device(layout.seq_lens)
    block_table = gpu.on_device(layout.block_table)
    max_kv = case.P + case.S

    def schedule(batch: int, cu_q: Any, max_q: int, lens: Any, max_k: int, causal: bool) -> Any:
        return gpu.get_scheduler_metadata(
            batch_size=batch, max_seqlen_q=max_q, max_seqlen_k=max_k,
            num_heads_q=NUM_QO_HEADS, num_heads_kv=NUM_KV_HEADS, headdim=HEAD_DIM,
            cache_seqlens=lens, qkv_dtype=dtype, cu_seqlens_q=cu_q, page_size=PAGE,
            causal=causal, window_size=(-1, -1), num_splits=0)

    def fa3_decode() -> None:
        cu_q = torch.arange(case.B + 1, dtype=torch.int32, device=dev)
        row["fa3_decode_plan_us"] = host_us(
            lambda: schedule(case.B, cu_q, 1, seq_lens, max_kv, True), plan_reps)
        metadata = schedule(case.B, cu_q, 1, seq_lens, max_kv, True)
        out = torch.empty_like(q)
        runs["fa3_decode"] = lambda: gpu.flash_attn_varlen_func(
            q=q, k=k, v=v, out=out, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=seq_lens,
            max_seqlen_k=max_kv, softmax_scale=sm_scale, causal=True, window_size=[-1, -1],
            block_table=block_table, softcap=0.0, scheduler_metadata=metadata, fa_version=3,
            num_splits=0)
        runs["fa3_decode"]()
        outputs["fa3_decode"] = out

    # fa3_cascade: vLLM 0.26 build() with common_prefix_len = P (use_cascade) per group, and
    # FlashAttentionImpl.forward's cascade_attention call.
    def fa3_cascade() -> None:
        n = layout.group_size

        def plan() -> list[dict[str, Any]]:
            groups = []
            for g in range(case.groups):
                rows = layout.group_rows(g)
                cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
                cu_prefix = torch.tensor([0, n], dtype=torch.int32, device=dev)
                prefix_lens = torch.tensor([case.P], dtype=torch.int32, device=dev)
                suffix_lens = seq_lens[rows] - case.P
                groups.append({
                    "rows": rows, "cu_query_lens": cu_q, "cu_prefix_query_lens": cu_prefix,
                    "prefix_kv_lens": prefix_lens, "suffix_kv_lens": suffix_lens,
                    "block_table": block_table[rows],
                    "prefix_scheduler_metadata": schedule(1, cu_prefix, n, prefix_lens, case.P,
                                                          False),
                    "suffix_scheduler_metadata": schedule(n, cu_q, 1, suffix_lens,
                                                          max_kv - case.P, True),
                })
            return groups

        row["fa3_cascade_plan_us"] = host_us(plan, plan_reps)
        groups = plan()
        out = torch.empty_like(q)

        def run() -> None:
            for grp in groups:
                gpu.cascade_attention(
                    out[grp["rows"]], q[grp["rows"]], k, v,
                    cu_query_lens=grp["cu_query_lens"], max_query_len=1,
                    cu_prefix_query_lens=grp["cu_prefix_query_lens"],
                    prefix_kv_lens=grp["prefix_kv_lens"], suffix_kv_lens=grp["suffix_kv_lens"],
                    max_kv_len=max_kv, softmax_scale=sm_scale, alibi_slopes=None,
                    sliding_window=(-1, -1), logits_soft_cap=0.0,
                    block_table=grp["block_table"], common_prefix_len=case.P, max_num_splits=0,
                    fa_version=3,
                    prefix_scheduler_metadata=grp["prefix_scheduler_metadata"],
                    suffix_scheduler_metadata=grp["suffix_scheduler_metadata"])

        runs["fa3_cascade"] = run
        run()
        outputs["fa3_cascade"] = out
        row["fa3_cascade_note"] = (
            "one cascade_attention call over the whole batch, as vLLM <= 0.31 ran it"
            if case.groups == 1 else
            f"vLLM's cascade_attention takes one prefix for the whole batch: called once per "
            f"group ({case.groups} calls of {n} requests) in sequence inside one timed region")
        row["vllm_fa3_cascade_heuristic"] = (
            bool(gpu.use_cascade_attention(
                common_prefix_len=case.P, query_lens=np.ones(case.B, np.int32),
                num_query_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, use_alibi=False,
                use_sliding_window=False, use_local_attention=False, num_sms=gpu.num_sms,
                dcp_world_size=1))
            if case.groups == 1 else None)  # vLLM finds no batch-wide prefix with groups > 1

    for name, body in (("fi_decode", fi_decode), ("fi_cascade", fi_cascade),
                       ("plugin", plugin), ("fa3_decode", fa3_decode),
                       ("fa3_cascade", fa3_cascade)):
        attempt(name, body)

    # Correctness before any timing.
    expected = [m for m in TIMED[1:]
                if m != EXECUTOR_COLUMNS["fa3"] or "fa3" in gpu.executors]
    err: dict[str, float | None] = dict.fromkeys(("fi_decode", *expected, "plugin"))
    want = outputs.get("fi_decode")
    if want is not None:
        sample = sorted({0, case.B - 1})
        ref = reference(gpu, q, k, v, layout, sample, sm_scale)
        err["fi_decode"] = (want[sample].float() - ref).abs().max().item()
        row["ref_max_abs"] = want.float().abs().max().item()
        for name, got in outputs.items():
            if name != "fi_decode":
                err[name] = (got.float() - want.float()).abs().max().item()
    if "plugin_choice" in row:
        err["plugin"] = (err[EXECUTOR_COLUMNS[row["plugin_kernel"]]]
                         if row["plugin_choice"] == "cascade" else 0.0)
    row["max_abs_err"] = err
    for name, value in err.items():
        if value is None:
            if not any(e.startswith(f"{name}:") for e in errors) and name != "plugin":
                errors.append(f"{name}: no output to compare")
        elif not value <= TOLERANCE:  # NaN fails too
            errors.append(f"{name}: max abs error {value:.3g} vs "
                          f"{'fp32 reference' if name == 'fi_decode' else 'fi_decode'} "
                          f"> {TOLERANCE}")

    timings: dict[str, Timing] = {}
    for name in TIMED:
        if name in outputs:  # planned and ran once; a method that failed there is not timed
            attempt(f"{name} timing",
                    lambda name=name: timings.__setitem__(name, timer.time(runs[name])))
    ms = {name: (timings[name].ms if name in timings else None) for name in TIMED}
    if "plugin_choice" in row:
        ms["plugin"] = ms[EXECUTOR_COLUMNS[row["plugin_kernel"]]
                          if row["plugin_choice"] == "cascade" else "fi_decode"]
    else:
        ms["plugin"] = None
    row["ms"] = {name: ms[name] for name in ("plugin", *TIMED)}
    row["ms_min"] = {name: t.ms_min for name, t in timings.items()}
    row["host_us"] = {name: t.host_us for name, t in timings.items()}
    row["spin_us"] = {name: t.spin_us for name, t in timings.items()}
    late = [n for n, t in timings.items() if t.host_us > t.spin_us]
    if late:  # the GPU may have waited for the host: those times include launch gaps
        row["timing_warnings"] = [f"{n}: host {timings[n].host_us:.0f} us > spin "
                                  f"{timings[n].spin_us:.0f} us" for n in late]
    row["ratios"] = row_ratios(row)
    row["errors"] = errors
    row["ok"] = not errors
    return row


def tqdm_write(text: str) -> None:
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety: never fail a GPU run over it
        print(text, flush=True)
        return
    tqdm.write(text)


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


def _meta(gpu: Gpu, args: argparse.Namespace, timer: Timer, extra: dict[str, Any]) -> dict:
    import flashinfer
    import torch
    import vllm

    return {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
        "vllm": vllm.__version__, "flashinfer": flashinfer.__version__,
        "torch": torch.__version__, "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
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


def record_choice(row: dict[str, Any], plan: Any, kernel: str) -> str:
    """The plugin's flat/cascade choice for ``plan`` as ``step.py`` makes it (policy auto, the
    shipped model of ``kernel``'s executor, Llama-3-8B's layers), written into ``row``."""
    from vllm_cascade_plugin.planning.cost import COST_MODELS, AttentionShape, decide

    shape = AttentionShape(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE_BYTES,
                           num_layers=NUM_LAYERS)
    decision = decide(plan, shape, COST_MODELS[kernel])
    choice = "cascade" if plan.num_levels >= 2 and decision.use_cascade else "flat"
    row["plugin_choice"] = choice
    row["cost_model"] = {"flat_us": decision.flat_us, "cascade_us": decision.cascade_us,
                         "reason": decision.reason}
    return choice


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
            changed.append(f"{_label(row)}: {before} -> {choice}")
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
        "command": " ".join(["python", "benchmarks/kernel_bench.py", *(argv or sys.argv[1:])]),
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
                        default=Path(__file__).resolve().parent / "results" / "h200")
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
        tqdm_write(f"{case.label}: " + " ".join(f"{m} {_fmt(ms.get(m))}" for m in METHODS)
                   + f" floor {row['floor_ms']:.4f} plugin={row.get('plugin_choice')}"
                   + ("" if row["ok"] else f"  !!! {'; '.join(row['errors'])}"))
        gpu.torch.cuda.empty_cache()
    targets = evaluate_targets(rows)
    lines = summary_lines(rows, targets)
    print("\n".join(lines), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_grid.json").write_text(json.dumps(rows, indent=1) + "\n")
    meta = _meta(gpu, args, timer, {"warmup_s": round(warmup_s, 1),
                                    "total_s": round(time.perf_counter() - started, 1)})
    (args.out / "kernel_grid.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    summary = {"targets": targets, "all_correct": all(r["ok"] for r in rows),
               "problems": {_label(r): r["errors"] for r in rows if not r["ok"]},
               "table": lines}
    (args.out / "kernel_grid.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"kernel_bench: wrote {args.out}/kernel_grid{{,.meta,.summary}}.json "
          f"in {time.perf_counter() - started:.0f} s", flush=True)
    return 0 if summary["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
