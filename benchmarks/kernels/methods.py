"""One row of the kernel benchmark (``kernels/bench.py``): the same step five ways (FlashInfer
decode and cascade, FA3 decode and vLLM's cascade, the plugin), checked against each other and an
fp32 reference, then timed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common import error_text, tqdm_write
from benchmarks.kernels.gpu import Gpu, Timer, Timing, host_us, reference
from benchmarks.kernels.grid import (
    DTYPE_BYTES,
    EXECUTOR_COLUMNS,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    NUM_QO_HEADS,
    PAGE,
    TIMED,
    TOLERANCE,
    Case,
    attention_flops,
    build_layout,
    floor_ms,
    unique_kv_bytes,
)
from benchmarks.kernels.targets import record_choice, row_ratios


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
            errors.append(f"{name}: {error_text(exc)}")
            tqdm_write(f"!!! {case.label} {name}: {error_text(exc)}")

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

    # The plugin, as the step session (policy auto) and backend.py run it for a decode step.
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

