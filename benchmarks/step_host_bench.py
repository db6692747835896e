"""Time the plugin's host work per engine step, as the V1 runner hooks do it, on serving batches.

What ``vllm serve``'s log calls planning: the runner hook's whole path for one step
(``hooks_dispatch.plan_rows``: the pre-check on the rows' first block ids, the row keys, the
planner, the cost model's decision, the step's plan) and the step's end (its counters), with the
step session set up as vLLM's default backend, ``FLASH_ATTN``, sets it up on an H200: the FA3
executor's eager and graphed cost models, vLLM's default CUDA-graph capture sizes (1, 2, 4, 8,
..., 512). The batches are ``planner_bench.py``'s: steady decode (every row one token longer),
and churn (every step one request finishes and a new one arrives and prefills its own tokens, so
every churn step is a mixed prefill+decode step). Each case runs ``--rounds`` times over the same
steps; a figure is the rounds' median of the round's p50 or p99.

It times the code it runs: to compare two versions of the plugin, run it from both checkouts in
turn on the same machine (this CPU's medians drift between invocations: alternate them and give
the spread).

    PYTHONPATH=src:benchmarks python benchmarks/step_host_bench.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from planner_bench import PAGE_SIZE, Case, ChurnBatch, DecodeBatch
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.integration import hooks_dispatch
from vllm_cascade_plugin.planning.cost import (
    AttentionShape,
    cost_model_for,
    decide,
    flash_attn_flat,
)
from vllm_cascade_plugin.planning.planner import plan_cascade
from vllm_cascade_plugin.step import session

LLAMA3_8B = AttentionShape(num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                           num_layers=32)
# vLLM's default capture sizes with max_num_seqs 1024: 1, 2, 4, then multiples of 8 to 512.
CAPTURE_SIZES = (1, 2, 4, *range(8, 513, 8))
CASES = (
    # few rows per document: the cost model keeps every decode step flat
    Case("4x8K, 8 rows", requests=8, groups=4, shared_pages=512, own_tokens=(64, 320)),
    Case("4x8K, 32 rows", requests=32, groups=4, shared_pages=512, own_tokens=(64, 320)),
    Case("4x8K, 64 rows", requests=64, groups=4, shared_pages=512, own_tokens=(64, 320)),
    Case("chat 1.5K, 128 rows", requests=128, groups=1, shared_pages=96, own_tokens=(256, 1152)),
    Case("1x32K, 256 rows", requests=256, groups=1, shared_pages=2048, own_tokens=(64, 256)),
)


def set_up_session() -> None:
    """The step session as the FLASH_ATTN backend's builder sets it up (FA3, whole-step
    graphs)."""
    session.configure(CascadeConfig(enabled=True), LLAMA3_8B, PAGE_SIZE, None,
                      cost_model=flash_attn_flat(cost_model_for("fa3", decode_graphs=False)),
                      steady_cost_model=flash_attn_flat(cost_model_for("fa3")),
                      capture_sizes=CAPTURE_SIZES)


def one_step(batch: DecodeBatch) -> tuple[int, bool, object]:
    """The hooks' planning of ``batch``'s current step and its end: (nanoseconds, cascade?,
    the step's plan or None where the pre-check skipped the planner)."""
    table, seq, query = batch.block_table, batch.seq_lens, batch.query_lens
    start = time.perf_counter_ns()
    cascade = hooks_dispatch.plan_rows(table[:, 0], lambda: table,
                                       np.full(len(seq), table.shape[1]), seq, query,
                                       lambda: batch.keys)
    planned = session.current
    session.end_step()
    return time.perf_counter_ns() - start, cascade, planned and planned.plan


def run(case: Case, batch_type: type[DecodeBatch], steps: int, check: bool
        ) -> tuple[list[int], int]:
    """Nanoseconds of each of ``steps`` steps, and how many ran cascade. With ``check``, every
    step's plan is compared with a fresh :func:`plan_cascade` of the same rows, and a step the
    hooks did not plan must be one the cost model keeps flat on that fresh plan."""
    set_up_session()
    batch = batch_type(case, np.random.default_rng(1))
    one_step(batch)  # the first plan is built from scratch
    times, cascade = [], 0
    for _ in range(steps):
        batch.step()
        ns, ran, plan = one_step(batch)
        times.append(ns)
        cascade += ran
        if check:
            fresh = plan_cascade(batch.block_table, batch.seq_lens, batch.query_lens, PAGE_SIZE)
            if plan is not None:
                assert plan.stats == fresh.stats, (plan.stats, fresh.stats)
            else:  # not planned (nothing shared, or the cost model's floor): flat in any case
                decode = bool(np.all(batch.query_lens == 1))
                model = (session.steady_cost_model if decode and session.steady_cost_model
                         and session.graphable(fresh.stats.num_tokens) else session.cost_model)
                assert session.shape is not None
                assert not ran and not decide(fresh, session.shape, model).use_cascade
    return times, cascade


def measure(case: Case, steps: int, rounds: int, check: bool) -> dict[str, object]:
    out: dict[str, object] = {"case": case.name, "requests": case.requests}
    for name, batch_type in (("steady", DecodeBatch), ("churn", ChurnBatch)):
        p50, p99, cascade = [], [], 0
        for _ in range(rounds):
            times, cascade = run(case, batch_type, steps, check)
            p50.append(float(np.percentile(times, 50)) / 1e3)
            p99.append(float(np.percentile(times, 99)) / 1e3)
        out[f"{name}_p50_us"] = round(statistics.median(p50), 1)
        out[f"{name}_p99_us"] = round(statistics.median(p99), 1)
        out[f"{name}_p50_us_rounds"] = [round(x, 1) for x in p50]
        out[f"{name}_cascade_steps"] = f"{cascade} of {steps}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps (smoke test)")
    parser.add_argument("--check", action="store_true",
                        help="compare every plan with a fresh plan_cascade (slow)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu")
    args = parser.parse_args()
    steps, rounds = (20, 1) if args.quick else (args.steps, args.rounds)
    stats.reset()
    rows = [measure(case, steps, rounds, args.check) for case in CASES]
    for row in rows:
        print(json.dumps(row))
    result = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
              "cpus": __import__("os").cpu_count(), "numpy": np.__version__,
              "python": platform.python_version(), "steps": steps, "rounds": rounds,
              "command": "PYTHONPATH=src:benchmarks python benchmarks/step_host_bench.py",
              "rows": rows}
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_host.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
