"""Where a cascade decode step's time goes with FlashAttention 3, level by level.

Usage (on the GPU machine, after ``source .devb/setup_device.sh``):
    python3 -m benchmarks.kernels.fa3_levels [--out DIR] [--rows 128x8192,256x8192x4] [--reps N]

For each row (the kernel grid's cases and layout: B requests, one query each, behind a P-token
prefix per group, S own tokens each), times on the GPU, with the kernel grid's timer (L2 flushed,
launches queued behind a spin, median of ``--reps``):

- ``shared_s<N>``: the shared level alone (one FA3 call, non-causal, every group one sequence)
  with ``num_splits=N`` (0: FA3's own heuristic, what vLLM's ``cascade_attention`` and the
  plugin's executor ran until now);
- ``own``: the per-request level alone (causal, one sequence per request);
- ``merge``: one ``merge_attn_states`` of two ``[B, heads, head_dim]`` states;
- ``decode_level``: the plugin's Triton kernel for the per-request level fused with the last
  merge (``decode_level.decode_level``), what replaces ``own`` + ``merge`` in a decode step;
- ``executor``: the plugin's FA3 executor, whole (``kernels.FlashAttnCascadeExecutor.run``,
  fused: shared levels in FA3, then ``decode_level``); ``executor_unfused``: the same executor
  with ``fused_decode=False`` (FA3 per-request level + merge, as through 0.3);
- ``fa3_decode``: flat FA3 decode over every request's pages, for scale;
- with ``--sweep``, ``decode_level_n<BLOCK_N>_w<warps>_s<stages>``: ``decode_level`` in each
  launch configuration of ``SWEEP``.

Each split variant's output is checked against ``num_splits=1`` (max abs error <= 2e-2). Writes
``fa3_levels.json`` (rows) and ``fa3_levels.meta.json`` (provenance) into ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, error_text
from benchmarks.kernels import grid as kg
from benchmarks.kernels.bench import provenance
from benchmarks.kernels.gpu import Gpu, Timer

SPLITS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
SWEEP = ((32, 64, 128), (1, 2, 4, 8), (1, 2, 3))  # decode_level: BLOCK_N, num_warps, num_stages
DEFAULT_ROWS = ("64x8192,128x2048,128x8192,128x16384,128x32768,256x2048,256x8192,256x16384,"
                "256x32768,256x8192x4,256x8192x16")


def run_row(case: kg.Case, gpu: Gpu, timer: Timer, rng: np.random.Generator,
            seed: int, pool_pages: int, sweep: bool = False) -> dict[str, Any]:
    from vllm_cascade_plugin.execution import vllm_kernels
    from vllm_cascade_plugin.execution.decode_level import decode_level
    from vllm_cascade_plugin.execution.kernels import FlashAttnCascadeExecutor
    from vllm_cascade_plugin.planning.planner import plan_cascade

    torch = gpu.torch
    dev, dtype = gpu.device, gpu.dtype
    sm_scale = kg.HEAD_DIM ** -0.5
    layout = kg.build_layout(case, rng, pool_pages)
    gen = torch.Generator(dev).manual_seed(seed)
    cache = torch.randn(layout.num_blocks, kg.PAGE, kg.NUM_KV_HEADS, 2 * kg.HEAD_DIM,
                        generator=gen, device=dev, dtype=dtype)
    k, v = cache.split(kg.HEAD_DIM, dim=-1)
    q = torch.randn(case.B, kg.NUM_QO_HEADS, kg.HEAD_DIM, generator=gen, device=dev, dtype=dtype)
    plan = plan_cascade(layout.block_table, layout.seq_lens, np.ones(case.B, np.int32), kg.PAGE)
    executors = {"executor": gpu.executors["fa3"],
                 "executor_unfused": FlashAttnCascadeExecutor("NHD", 3, fused_decode=False)}
    for executor in executors.values():
        executor.plan(plan, num_qo_heads=kg.NUM_QO_HEADS, num_kv_heads=kg.NUM_KV_HEADS,
                      head_dim=kg.HEAD_DIM, page_size=kg.PAGE, sm_scale=sm_scale,
                      logits_soft_cap=None, q_dtype=dtype, kv_dtype=dtype, device=dev)
    if not executors["executor"]._step.fused_decode:
        raise RuntimeError("the FA3 executor did not fuse this decode step")
    step = executors["executor_unfused"]._step
    shared, own = step.shared[0].level, step.last
    attention, merge = vllm_kernels.fa3_kernels()  # what the executor calls
    row: dict[str, Any] = {"B": case.B, "P": case.P, "S": case.S, "groups": case.groups,
                           "floor_ms": kg.floor_ms(case), "ms": {}, "errors": []}

    def call(fl: Any, out: Any, causal: bool, splits: int) -> Any:
        return attention(q=q, k=k, v=v, out=out, cu_seqlens_q=fl.cu_q, max_seqlen_q=fl.max_q,
                         seqused_k=fl.kv_lens, max_seqlen_k=fl.max_k, softmax_scale=sm_scale,
                         causal=causal, window_size=[-1, -1], block_table=fl.block_table,
                         softcap=0.0, return_softmax_lse=True, fa_version=3,
                         num_splits=splits)

    outs = {}
    for splits in SPLITS:
        out = torch.empty_like(q)
        try:
            call(shared, out, False, splits)
        except Exception as exc:  # a split count FA3 refuses: say so, go on
            row["errors"].append(f"shared_s{splits}: {error_text(exc)}")
            continue
        outs[splits] = out
        row["ms"][f"shared_s{splits}"] = timer.time(
            lambda out=out, splits=splits: call(shared, out, False, splits)).ms
    for splits, out in outs.items():
        err = float((out.float() - outs[1].float()).abs().max())
        if err > kg.TOLERANCE:
            row["errors"].append(f"shared_s{splits}: max error {err:.3g} vs num_splits=1")
    own_out = torch.empty_like(q)
    row["ms"]["own"] = timer.time(lambda: call(own, own_out, True, 0)).ms
    _, lse_a = call(shared, outs[1], False, 1)
    _, lse_b = call(own, own_out, True, 0)
    merged, merged_lse = torch.empty_like(q), torch.empty_like(lse_a)
    row["ms"]["merge"] = timer.time(lambda: merge(merged, outs[1], lse_a, own_out, lse_b,
                                                  output_lse=merged_lse)).ms
    state, state_lse = outs[1].clone(), lse_a.clone()
    fused_out, fused_lse = torch.empty_like(q), torch.empty_like(lse_a)
    # The shipped launch configuration, then (--sweep) every one of SWEEP.
    configs = {"decode_level": {}}
    if sweep:
        configs.update({f"decode_level_n{n}_w{w}_s{st}": {"block_n": n, "num_warps": w,
                                                           "num_stages": st}
                        for n, w, st in itertools.product(*SWEEP)})
    for name, config in configs.items():
        def launch(config: dict[str, int] = config) -> None:
            decode_level(q, k, v, own.block_table, own.kv_lens, state, state_lse, fused_out,
                         fused_lse, sm_scale=sm_scale, **config)
        try:
            launch()
            err = float((fused_out.float() - merged.float()).abs().max())
            if err > kg.TOLERANCE:
                row["errors"].append(f"{name}: max error {err:.3g} vs FA3 + merge")
            row["ms"][name] = timer.time(launch).ms
        except Exception as exc:  # a configuration Triton cannot build: say so, go on
            row["errors"].append(f"{name}: {error_text(exc)}")
    results = {}
    for name, executor in executors.items():
        results[name] = out = torch.empty_like(q)
        row["ms"][name] = timer.time(lambda executor=executor, out=out: executor.run(q, k, v,
                                                                                    out)).ms
    seq_lens = gpu.on_device(layout.seq_lens)
    block_table = gpu.on_device(layout.block_table)
    cu_q = torch.arange(case.B + 1, dtype=torch.int32, device=dev)
    flat_out = torch.empty_like(q)
    row["ms"]["fa3_decode"] = timer.time(lambda: attention(
        q=q, k=k, v=v, out=flat_out, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=seq_lens,
        max_seqlen_k=case.P + case.S, softmax_scale=sm_scale, causal=True,
        window_size=[-1, -1], block_table=block_table, softcap=0.0, fa_version=3)).ms
    for name, out in results.items():
        err = float((out.float() - flat_out.float()).abs().max())
        if err > kg.TOLERANCE:
            row["errors"].append(f"{name}: max error {err:.3g} vs flat FA3 decode")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=RESULTS / "gpu")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="BxP[xGROUPS[xS]],...")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--pool-pages", type=int, default=32768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sweep", action="store_true",
                        help="also time decode_level's launch configurations (SWEEP)")
    args = parser.parse_args(argv)
    args.plan_reps = 0  # the kernel grid's provenance field: no host planning is timed here
    started = time.perf_counter()
    gpu = Gpu()
    if "fa3" not in gpu.executors:
        print(f"fa3_levels: FA3 cannot run here ({gpu.kernel_line})", file=sys.stderr)
        return 1
    timer = Timer(gpu, args.reps, args.warmup)
    rng = np.random.default_rng(args.seed)
    rows = []
    for i, case in enumerate(kg.parse_rows(args.rows)):
        row = run_row(case, gpu, timer, rng, args.seed + i, args.pool_pages, args.sweep)
        rows.append(row)
        ms = row["ms"]
        best = min((k for k in ms if k.startswith("shared_s")), key=ms.__getitem__)
        print(f"{case.label}: " + " ".join(f"{k} {v * 1e3:.1f}" for k, v in ms.items())
              + f" us; best {best}; floor {row['floor_ms'] * 1e3:.1f} us"
              + (f" !!! {row['errors']}" if row["errors"] else ""), flush=True)
        gpu.torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fa3_levels.json").write_text(json.dumps(rows, indent=1) + "\n")
    meta = provenance(gpu, args, timer, {"total_s": round(time.perf_counter() - started, 1)})
    (args.out / "fa3_levels.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return 0 if not any(r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
