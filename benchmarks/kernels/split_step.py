"""What a mixed prefill+decode step costs run split (``execution.fa3_split``) against flat, on the
GPU, for all of a model's attention layers: the number behind ``cost.FA3_SPLIT_STEP_FIXED_US``.

A mixed step is what ``vllm serve`` runs every few steps: the running requests each decode one
token, and a new request's prompt is prefilled in the same batch. Each case is ``decode`` rows
behind ``docs`` documents of ``doc_tokens`` (prefix-cache pages shared by the rows of a
document, then ``own_tokens`` of each row's own), plus one prefill row of ``prefill`` query
tokens: behind a document (a new question about a cached document) or alone (a prompt of its
own). Per step, over ``LAYERS`` layers (each its own KV cache, as a model's are):

* ``flat``: one FlashAttention 3 varlen call per layer over every row, as vLLM's ``FLASH_ATTN``
  backend runs the step;
* ``split``: the plugin's FA3 executor planned with the decode rows alone and ``split=`` (its
  flat call for the prefill row, the decode rows' cascade replayed from its per-layer CUDA
  graphs, their gather and scatter), as the plugin runs the step with CUDA graphs.

Each is timed as a step is launched in vLLM's piecewise path (attention between the model's
graph pieces): the GPU time of the layers launched back to back (CUDA events), and the host time
to launch them. ``implied_step_us`` is what the cost model's per-step term of a split step would
have to be for the model to predict the measured difference: the measured split - flat minus the
model's per-layer estimate of the decode rows' cascade (without its per-step term) minus their
flat attention, times the layers. The model charges the larger of the GPU and host differences.

    python3 -m benchmarks.kernels.split_step [--out benchmarks/results/gpu/split_step.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import command_line, commit, error_text, use_checkout, version

PAGE = 16
LAYERS = 32  # Llama-3-8B
QO_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


@dataclasses.dataclass(frozen=True)
class Case:
    decode: int  # decode rows (one query token each)
    docs: int  # documents they share, rows spread over them round-robin
    doc_tokens: int
    own_tokens: int  # each decode row's own tokens behind its document
    prefill: int  # the prefill row's query tokens
    prefill_behind_doc: bool  # the prefill row's prompt starts with document 0 (cached)

    @property
    def label(self) -> str:
        where = "behind a document" if self.prefill_behind_doc else "alone"
        return (f"{self.decode} decode rows x {self.docs} x {self.doc_tokens} shared, "
                f"prefill {self.prefill} {where}")


CASES = tuple(Case(d, docs, doc, 256, prefill, behind)
              for docs, doc in ((4, 8192), (16, 2048))
              for d in (16, 32, 64, 128)
              for prefill, behind in ((512, True), (2048, False)))


@dataclasses.dataclass
class Batch:
    block_table: np.ndarray  # int32 [rows, pages]
    seq_lens: np.ndarray  # int32 [rows]
    query_lens: np.ndarray  # int32 [rows]
    num_blocks: int


def build_batch(case: Case, rng: np.random.Generator) -> Batch:
    """The step's rows: the decode rows round-robin over the documents (interleaved, as a
    server's batch is), the prefill row in the middle; every page id distinct except a
    document's, which its rows share; page ids shuffled over the cache."""
    doc_pages = -(-case.doc_tokens // PAGE)
    rows: list[tuple[list[int], int, int]] = []  # (pages, seq len, query len)
    next_page = 0

    def take(n: int) -> list[int]:
        nonlocal next_page
        next_page += n
        return list(range(next_page - n, next_page))

    docs = [take(doc_pages) for _ in range(case.docs)]
    for r in range(case.decode):
        seq = case.doc_tokens + case.own_tokens + 1 + r % 7
        rows.append((docs[r % case.docs] + take(-(-seq // PAGE) - doc_pages), seq, 1))
    prefix = case.doc_tokens if case.prefill_behind_doc else 0
    seq = prefix + case.prefill
    pages = (docs[0] if prefix else []) + take(-(-seq // PAGE) - (doc_pages if prefix else 0))
    rows.insert(case.decode // 2, (pages, seq, case.prefill))
    width = max(len(p) for p, _, _ in rows)
    shuffle = rng.permutation(next_page).astype(np.int32)
    table = np.zeros((len(rows), width), np.int32)
    for i, (p, _, _) in enumerate(rows):
        table[i, :len(p)] = shuffle[p]
    return Batch(table, np.array([s for _, s, _ in rows], np.int32),
                 np.array([q for _, _, q in rows], np.int32), next_page)


def implied_step_us(flat_us: float, split_us: float, model_cascade_us: float,
                    model_flat_us: float, layers: int = LAYERS) -> float:
    """The per-step term that makes the model's split - flat equal the measured one (per step:
    ``flat_us``, ``split_us``; per layer: the model's cascade without its per-step term and
    flat estimates of the decode rows)."""
    return (split_us - flat_us) - layers * (model_cascade_us - model_flat_us)


def model_estimates(case: Case, batch: Batch) -> tuple[float, float]:
    """The cost model's per-layer estimates for the decode rows (as the step session plans a
    mixed step: the other rows padding), cascade without its per-step term, and flat."""
    from vllm_cascade_plugin.planning.cost import (
        AttentionShape,
        cost_model_for,
        decide,
        flash_attn_flat,
    )
    from vllm_cascade_plugin.planning.planner import plan_cascade

    decode = (batch.query_lens == 1).astype(np.int32)
    plan = plan_cascade(batch.block_table, batch.seq_lens, decode, PAGE)
    model = dataclasses.replace(flash_attn_flat(cost_model_for("fa3", split=True)),
                                step_fixed_us=0.0)
    shape = AttentionShape(QO_HEADS, KV_HEADS, HEAD_DIM, 2, num_layers=LAYERS)
    decision = decide(plan, shape, model)
    return decision.cascade_us, decision.flat_us


def run_case(case: Case, torch: Any, reps: int) -> dict[str, Any]:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from vllm_cascade_plugin.execution.fa3_split import flat_rows
    from vllm_cascade_plugin.execution.kernels import FlashAttnCascadeExecutor
    from vllm_cascade_plugin.planning.planner import CascadePlanner

    dev, dtype = torch.device("cuda"), torch.bfloat16
    batch = build_batch(case, np.random.default_rng(0))
    rows, tokens = len(batch.seq_lens), int(batch.query_lens.sum())
    caches = [(torch.randn(batch.num_blocks, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype),
               torch.randn(batch.num_blocks, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype))
              for _ in range(LAYERS)]
    q = torch.randn(tokens, QO_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    qsl = np.concatenate([[0], np.cumsum(batch.query_lens)]).astype(np.int32)
    qsl_d = torch.from_numpy(qsl).to(dev)
    table_d = torch.from_numpy(batch.block_table).to(dev)
    seq_d = torch.from_numpy(batch.seq_lens).to(dev)
    scale = HEAD_DIM ** -0.5
    max_q, max_k = int(batch.query_lens.max()), int(batch.seq_lens.max())

    def flat_step() -> None:
        for k, v in caches:
            flash_attn_varlen_func(q=q, k=k, v=v, out=out, cu_seqlens_q=qsl_d,
                                   max_seqlen_q=max_q, seqused_k=seq_d, max_seqlen_k=max_k,
                                   softmax_scale=scale, causal=True, block_table=table_d,
                                   fa_version=3)

    executor = FlashAttnCascadeExecutor("NHD", max_levels=3, fused_decode=True, cuda_graphs=True)
    decode = batch.query_lens == 1
    plan = CascadePlanner().plan(batch.block_table, batch.seq_lens, decode.astype(np.int32), PAGE)

    def plan_split() -> None:
        split = flat_rows(qsl_d, table_d, max_q, max_k, qsl, batch.seq_lens, decode, dev)
        executor.plan(plan, num_qo_heads=QO_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                      page_size=PAGE, sm_scale=scale, logits_soft_cap=None, q_dtype=dtype,
                      kv_dtype=dtype, device=dev, padded_rows=int(decode.sum()), split=split)

    def split_step() -> None:
        for k, v in caches:
            executor.run(q, k, v, out)

    def check() -> float:
        """Largest |split - flat| over the step's outputs (last layer): the split must compute
        the same attention, or its time means nothing."""
        flat_step()
        want = out.clone()
        split_step()
        return float((out.float() - want.float()).abs().max())

    plan_split()
    max_diff = check()
    timings = {}
    for name, step in (("flat", flat_step), ("split", split_step)):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        gpu, host = [], []
        for _ in range(reps):
            torch.cuda._sleep(20_000_000)  # the GPU busy, so the launches queue behind it
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            step()
            host.append(1e6 * (time.perf_counter() - t0))
            end.record()
            torch.cuda.synchronize()
            gpu.append(1e3 * start.elapsed_time(end))
        timings[name] = (statistics.median(gpu), statistics.median(host))
    plan_us = []
    for _ in range(reps):
        t0 = time.perf_counter()
        plan_split()
        plan_us.append(1e6 * (time.perf_counter() - t0))
    model_cascade, model_flat = model_estimates(case, batch)
    (flat_gpu, flat_host), (split_gpu, split_host) = timings["flat"], timings["split"]
    flat_us, split_us = max(flat_gpu, flat_host), max(split_gpu, split_host)
    return {"case": case.label, **dataclasses.asdict(case), "rows": rows,
            "flat_gpu_us": round(flat_gpu, 1), "flat_host_us": round(flat_host, 1),
            "split_gpu_us": round(split_gpu, 1), "split_host_us": round(split_host, 1),
            "split_plan_host_us": round(statistics.median(plan_us), 1),
            "split_over_flat": round(split_us / flat_us, 3),
            "model_decode_cascade_us_per_layer": round(model_cascade, 2),
            "model_decode_flat_us_per_layer": round(model_flat, 2),
            "implied_step_us": round(implied_step_us(flat_us, split_us, model_cascade,
                                                     model_flat), 1),
            "graph_captures": executor.graphs.captures if executor.graphs else 0,
            "max_abs_diff_vs_flat": max_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="two cases, few repetitions")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    use_checkout()
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks.kernels.split_step needs a CUDA GPU; on a CPU its layouts and the "
                 "cost model's "
                 "estimates: tests/benchmarks/kernels/test_split_step_cpu.py")
    cases = CASES[:2] if args.quick else CASES
    rows = []
    for case in cases:
        try:
            row = run_case(case, torch, 5 if args.quick else args.reps)
        except Exception as exc:  # one case's failure must not lose the others' rows
            row = {"case": case.label, **dataclasses.asdict(case), "error": error_text(exc)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "vllm": version("vllm"), "torch": torch.__version__,
            "python": platform.python_version(), "code": commit(),
            "command": command_line(), "layers": LAYERS, "reps": args.reps}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
