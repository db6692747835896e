"""Time the plugin's host work per engine step, as the runner hooks do it, on serving batches.

What ``vllm serve``'s log calls planning: the runner hook's whole path for one step
(``hooks_dispatch.plan_rows``: the pre-check on the rows' first block ids, the row keys, the
planner, the cost model's decision, the step's plan) and the step's end (its counters). Columns
``v2_*``: the same through Model Runner V2's hook (``hooks_dispatch.v2_plan``, what ``vllm serve``
runs by default), which first puts the rows in vLLM's batch order (vLLM's own
``sort_batch_req_ids``: vLLM must be installed) and reads them from the CPU mirror of the block ids;
columns ``v1_*``: the same through the V1 runner's hook (``hooks_dispatch.v1_plan``), which reads
the rows from its persistent batch (with ``CASCADE_UNVERIFIED``, which its known-unshared steps
need). The step session is set up as vLLM's default backend,
``FLASH_ATTN``, sets it up on an H200: the FA3 executor's eager and graphed cost models, vLLM's
default CUDA-graph capture sizes (1, 2, 4, 8, ..., 512). The batches are ``host/planner.py``'s:
steady decode (every row one token longer), and churn (every step one request finishes and a new one
arrives and prefills its own tokens, so every churn step is a mixed prefill+decode step). Each case
runs ``--rounds`` times over the same steps; a figure is the rounds' median of the round's p50 or
p99.

It times the code it runs: to compare two versions of the plugin, run
``host/step_compare.py`` (each version's source in turn, on the same machine). ``--parts``
also splits each variant's p50 into the planner, the cost model's decision and the rest
(columns ``<variant>_planner_p50_us`` ..., file ``step_host_parts.json``).

``--cold`` runs, untimed between two steps, work that evicts the planner's code and data from
the CPU's caches (:func:`evict_caches`), as the rest of a ``vllm serve`` step does (the
scheduler, vLLM's input preparation, sampling, the API server's output): a step then takes
what the same step takes inside ``vllm serve``, several times what it takes back to back
(file ``step_host_cold.json``).

    PYTHONPATH=src python3 -m benchmarks.host.step [--quick] [--parts] [--cold]
        [--cases TEXT] [--name FILE] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from benchmarks.common import RESULTS
from benchmarks.host.planner import PAGE_SIZE, Case, ChurnBatch, DecodeBatch
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.integration import hooks_dispatch, row_keys
from vllm_cascade_plugin.integration.hooks_step import PendingStep
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
    # nothing shared (every request's prompt its own): the hooks' pre-check keeps each step flat
    Case("no sharing, 128 rows", requests=128, groups=128, shared_pages=96,
         own_tokens=(256, 1152)),
    Case("no sharing, 256 rows", requests=256, groups=256, shared_pages=96,
         own_tokens=(256, 1152)),
)


def set_up_session() -> None:
    """The step session as the FLASH_ATTN backend's builder sets it up (FA3, whole-step
    graphs), in a server whose layouts' graphs are worth capturing from their second step
    (what a long-running server's steady state is: the host time measured here is the
    planning's, not the capture policy's)."""
    session.configure(CascadeConfig(enabled=True), LLAMA3_8B, PAGE_SIZE, None,
                      cost_model=flash_attn_flat(cost_model_for("fa3", decode_graphs=False)),
                      steady_cost_model=flash_attn_flat(cost_model_for("fa3")),
                      capture_sizes=CAPTURE_SIZES)
    session.capture_cost_us = 0.0


EVICT_BYTES = 64 << 20  # more than the last-level cache of a server CPU's core complex
EVICT_OBJECTS = 50_000  # Python objects walked: the interpreter's own working set
_evict_array: np.ndarray | None = None
_evict_objects: dict[int, str] = {}


def evict_caches() -> None:
    """Read ``EVICT_BYTES`` of an array and walk ``EVICT_OBJECTS`` Python objects (a dict of
    strings): little of the planner's code or data stays in the caches afterwards."""
    global _evict_array
    if _evict_array is None:
        _evict_array = np.ones(EVICT_BYTES // 8)
        _evict_objects.update((i, str(i)) for i in range(EVICT_OBJECTS))
    _evict_array.sum()
    sum(map(len, _evict_objects.values()))


def one_step(batch: DecodeBatch) -> tuple[int, bool, object]:
    """The hooks' planning of ``batch``'s current step and its end: (nanoseconds, cascade?,
    the step's plan or None where the pre-check skipped the planner)."""
    table, seq, query = batch.block_table, batch.seq_lens, batch.query_lens
    start = time.perf_counter_ns()
    cascade = hooks_dispatch.plan_rows(table[:, 0], table,
                                       np.full(len(seq), table.shape[1]), seq, query,
                                       lambda: batch.keys)
    planned = session.current
    session.end_step()
    return time.perf_counter_ns() - start, cascade, planned and planned.plan


SLOTS = 1024  # Model Runner V2's request slots (max_num_seqs)


class V2Rows:
    """``batch`` as Model Runner V2's hook reads it: each row a request in the slot of its row
    number, its block ids in the CPU mirror the plugin keeps, its key the slot's, and vLLM's
    scheduler output (tokens per request id)."""

    def __init__(self, batch: DecodeBatch) -> None:
        self.batch = batch
        self.req_ids = [f"cmpl-{row:08x}-0" for row in range(len(batch.seq_lens))]
        self.tables = SimpleNamespace(num_kv_cache_groups=1,
                                      num_blocks=SimpleNamespace(np=np.zeros((1, SLOTS), np.int32)))
        self.mirror = np.zeros((SLOTS, batch.block_table.shape[1]), np.int32)
        self.keys = np.zeros(SLOTS, np.int64)
        vars(self.tables)[hooks_dispatch.MIRROR] = [self.mirror]
        vars(self.tables)[row_keys.V2_KEYS] = self.keys
        self.computed = np.zeros(SLOTS, np.int32)
        self.first: np.ndarray | None = None  # each row's first block id, last step
        self.runner = SimpleNamespace(
            block_tables=self.tables, decode_query_len=1,
            req_states=SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(self.req_ids)},
                                       num_computed_tokens_np=self.computed))

    def written(self) -> PendingStep:
        """vLLM's writes for the batch's current step (not timed: vLLM makes them), and the
        step as the hook gets it."""
        b, n = self.batch, len(self.batch.seq_lens)
        self.mirror[:n] = b.block_table
        self.tables.num_blocks.np[0, :n] = b.block_table.shape[1]
        self.keys[:n] = b.keys
        self.computed[:n] = b.seq_lens - b.query_lens
        return PendingStep(self.runner, self.scheduled())

    def scheduled(self) -> SimpleNamespace:
        """vLLM's scheduler output of the batch's current step: every request is new in the
        first (untimed) step; later, a churn step's prefilling row is a new request, and so is a
        row another request moved into (the bench keeps the rows' ids: each such id finished
        and arrived again)."""
        b = self.batch
        first = b.block_table[:, 0].copy()
        changed = b.query_lens > 1
        changed |= True if self.first is None else first != self.first
        self.first = first
        new = [self.req_ids[r] for r in np.flatnonzero(changed)]
        return SimpleNamespace(
            num_scheduled_tokens=dict(zip(self.req_ids, b.query_lens.tolist(), strict=True)),
            scheduled_spec_decode_tokens={},
            scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
            finished_req_ids=set(new),
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()))

    def order(self, step: PendingStep) -> np.ndarray:
        """The rows in vLLM's batch order (what the V2 hook planned)."""
        return np.array([int(r.split("-")[1], 16) for r in
                         hooks_dispatch.compat.v2_batch_order(self.runner, step.scheduler_output)])


class V1Rows(V2Rows):
    """``batch`` as the V1 runner's hook reads it: its persistent batch (row ``r`` the request
    of the batch's row ``r``), the block table vLLM wrote for the step, the requests' keys as
    the hooks note them from the scheduler output."""

    def __init__(self, batch: DecodeBatch) -> None:
        super().__init__(batch)
        table = SimpleNamespace(block_table=SimpleNamespace(np=batch.block_table),
                                num_blocks_per_row=None)
        self.runner = SimpleNamespace(
            kv_cache_config=SimpleNamespace(kv_cache_groups=[0]),
            input_batch=SimpleNamespace(
                num_reqs=len(self.req_ids), req_ids=self.req_ids, block_table=[table],
                req_id_to_index={r: i for i, r in enumerate(self.req_ids)}))

    def written(self) -> PendingStep:
        b, batch = self.batch, self.runner.input_batch
        batch.block_table[0].block_table.np = b.block_table
        batch.block_table[0].num_blocks_per_row = np.full(len(b.seq_lens), b.block_table.shape[1])
        batch.num_computed_tokens_cpu = b.seq_lens - b.query_lens
        so = self.scheduled()
        row_keys.note_step(self.runner, so)  # the execute_model hook's, before the planning
        return PendingStep(self.runner, so)

    def order(self, step: PendingStep) -> np.ndarray:
        return np.arange(len(self.req_ids))


def one_v2_step(rows: V2Rows) -> tuple[int, bool, object]:
    """:func:`one_step` through Model Runner V2's hook (a :class:`V1Rows`: the V1 runner's)."""
    step = rows.written()
    plan = hooks_dispatch.v1_plan if isinstance(rows, V1Rows) else hooks_dispatch.v2_plan
    start = time.perf_counter_ns()
    cascade = hooks_dispatch.plan_once(step, plan)
    planned = session.current
    session.end_step()
    return time.perf_counter_ns() - start, cascade, planned and planned.plan


PARTS = ("planner", "decision")  # the session's calls --parts times apart


class PartTimer:
    """Nanoseconds a step spends in two of the step session's calls: the planner's ``plan``
    (block ids to plan) and ``_decide`` (the cost model's decision), wrapped in place."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys(PARTS, 0)
        planner = session._planner
        assert planner is not None, "set_up_session() first"
        planner.plan = self._timed(planner.plan, "planner")  # type: ignore[method-assign]
        session._decide = self._timed(session._decide, "decision")  # type: ignore[method-assign]

    def _timed(self, fn: Any, part: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[part] += time.perf_counter_ns() - start
        return timed

    def take(self) -> dict[str, int]:
        """The parts' nanoseconds since the last take."""
        out, self.ns = self.ns, dict.fromkeys(PARTS, 0)
        return out


def run(case: Case, batch_type: type[DecodeBatch], steps: int, check: bool, v2: bool = False,
        parts: dict[str, list[int]] | None = None, cold: bool = False,
        v1_hook: bool = False) -> tuple[list[int], int]:
    """Nanoseconds of each of ``steps`` steps, and how many ran cascade (``v2``: through
    Model Runner V2's hook; ``v1_hook``: through the V1 runner's). With ``check``, every step's
    plan is compared with a fresh :func:`plan_cascade` of the same rows (in the hook's order),
    and a step the hooks did not plan must be one the cost model keeps flat on that fresh plan.
    ``parts``: appended each step's nanoseconds in the planner and the decision
    (:class:`PartTimer`)."""
    set_up_session()
    if v1_hook and session.config is not None:  # its known-unshared steps: an opt-in there
        session.config = dataclasses.replace(session.config, unverified=True)
    timer = PartTimer() if parts is not None else None
    batch = batch_type(case, np.random.default_rng(1))
    rows = V1Rows(batch) if v1_hook else V2Rows(batch) if v2 else None
    one_v2_step(rows) if rows is not None else one_step(batch)  # the first plan from scratch
    if timer is not None:
        timer.take()
    times, cascade = [], 0
    for _ in range(steps):
        batch.step()
        if cold:
            evict_caches()
        ns, ran, plan = one_v2_step(rows) if rows is not None else one_step(batch)
        times.append(ns)
        cascade += ran
        if timer is not None and parts is not None:
            for part, part_ns in timer.take().items():
                parts.setdefault(part, []).append(part_ns)
        if check:
            order = (rows.order(rows.written()) if rows is not None
                     else np.arange(len(batch.seq_lens)))
            table, seq, query = (batch.block_table[order], batch.seq_lens[order],
                                 batch.query_lens[order])
            fresh = plan_cascade(table, seq, query, PAGE_SIZE)
            if plan is not None:
                assert plan.stats == fresh.stats, (plan.stats, fresh.stats)
            else:  # not planned (nothing shared, or the cost model's floor): flat in any case
                decode = bool(np.all(query == 1))
                model = (session.steady_cost_model if decode and session.steady_cost_model
                         and session.graphable(fresh.stats.num_tokens) else session.cost_model)
                assert session.shape is not None
                assert not ran and not decide(fresh, session.shape, model).use_cascade
    return times, cascade


def measure(case: Case, steps: int, rounds: int, check: bool, with_parts: bool = False,
            cold: bool = False) -> dict[str, object]:
    """A case's row. ``with_parts``: also each variant's p50 of the planner's, the decision's
    and the rest's share of a step (the rest: reading the rows, the pre-check and the cost
    floor, the step's plan object and counters), rounds' medians."""
    out: dict[str, object] = {"case": case.name, "requests": case.requests}
    variants = (("steady", DecodeBatch, ""), ("churn", ChurnBatch, ""),
                ("v1_steady", DecodeBatch, "v1"), ("v1_churn", ChurnBatch, "v1"),
                ("v2_steady", DecodeBatch, "v2"), ("v2_churn", ChurnBatch, "v2"))
    for name, batch_type, hook in variants:
        p50, p99, cascade = [], [], 0
        shares: dict[str, list[float]] = {}
        for _ in range(rounds):
            parts: dict[str, list[int]] | None = {} if with_parts else None
            times, cascade = run(case, batch_type, steps, check, hook == "v2", parts, cold,
                                 hook == "v1")
            p50.append(float(np.percentile(times, 50)) / 1e3)
            p99.append(float(np.percentile(times, 99)) / 1e3)
            if parts is not None:
                spent = {p: np.asarray(parts[p]) for p in PARTS}
                spent["rest"] = np.asarray(times) - sum(spent.values())
                for part, ns in spent.items():
                    shares.setdefault(part, []).append(float(np.percentile(ns, 50)) / 1e3)
        for part, values in shares.items():
            out[f"{name}_{part}_p50_us"] = round(statistics.median(values), 1)
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
    parser.add_argument("--parts", action="store_true",
                        help="also time the planner and the decision apart (their calls "
                             "wrapped: a little slower), into step_host_parts.json")
    parser.add_argument("--cold", action="store_true",
                        help="evict the CPU caches between steps (untimed), as the rest of a "
                             "vllm serve step does, into step_host_cold.json")
    parser.add_argument("--cases", default="",
                        help="only the cases whose name contains this text (default: all)")
    parser.add_argument("--name", default=None,
                        help="the result file's name (default: step_host.json, "
                             "step_host_parts.json or step_host_cold.json, by the flags)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu")
    args = parser.parse_args()
    steps, rounds = (20, 1) if args.quick else (args.steps, args.rounds)
    stats.reset()
    rows = [measure(case, steps, rounds, args.check, args.parts, args.cold) for case in CASES
            if args.cases in case.name]
    for row in rows:
        print(json.dumps(row))
    result = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
              "cpus": __import__("os").cpu_count(), "numpy": np.__version__,
              "python": platform.python_version(), "steps": steps, "rounds": rounds,
              "command": "PYTHONPATH=src python3 -m benchmarks.host.step"
                         + (" --parts" if args.parts else "") + (" --cold" if args.cold else "")
                         + f" --steps {steps} --rounds {rounds}"
                         + (f" --cases '{args.cases}'" if args.cases else "")
                         + (f" --name {args.name}" if args.name else ""),
              "cold": args.cold,
              "rows": rows}
    if not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        name = args.name or ("step_host_parts.json" if args.parts
                             else "step_host_cold.json" if args.cold else "step_host.json")
        (args.out / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
