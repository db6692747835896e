"""The soak's run and replay phases (``bench.py --phase``, each a process of its own): one
``AsyncLLM`` kept busy with the mix, a watchdog, and the readings taken from its worker.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.soak import judge as soak_judge
from benchmarks.soak import worker as soak_worker
from benchmarks.soak.judge import completion_problem
from benchmarks.soak.mix import (
    ENGINE,
    SUBSET_SIZE,
    RequestSpec,
    baseline_s,
    drive_cap_s,
    request_stream,
    shared_prefixes,
    subset_due_s,
    subset_requests,
    warmup_requests,
)
from vllm_cascade_plugin.face import agreement

PROGRESS_S = 30.0
WARMUP_TIMEOUT_S = 1200.0  # first cascade steps may JIT-compile FlashInfer kernels (minutes)
RPC_TIMEOUT_S = 60.0
MAX_REQUEST_ERRORS = 20  # the drive stops early after this many failed requests


@dataclasses.dataclass
class Tally:
    submitted: int = 0
    finished: int = 0  # requests whose stream ended, however
    completed: int = 0  # not aborted, and complete
    aborts: int = 0  # aborted mid-generation
    aborts_raced: int = 0  # picked for an abort but finished first: judged as not aborted
    incomplete: int = 0
    errors: int = 0
    output_tokens: int = 0
    kinds: Counter[str] = dataclasses.field(default_factory=Counter)
    problems: list[str] = dataclasses.field(default_factory=list)  # the first few
    subset: dict[str, dict] = dataclasses.field(default_factory=dict)

    def account(self, spec: RequestSpec, aborted: bool, final: Any, latest: dict[int, Any]) -> None:
        self.finished += 1
        self.output_tokens += sum(len(c.token_ids) for c in latest.values())
        if aborted:
            self.aborts += 1
            return
        self.aborts_raced += spec.abort_after is not None
        problem = completion_problem(
            spec.params.get("n", 1), spec.params["max_tokens"],
            final is not None and final.finished,
            [(c.finish_reason, len(c.token_ids)) for c in latest.values()])
        if problem is not None:
            self.incomplete += 1
            if len(self.problems) < 20:
                self.problems.append(f"{spec.request_id}: {problem}")
            return
        self.completed += 1
        if spec.kind == "subset":
            self.subset[spec.request_id] = agreement.record(final)


class Drive:
    """One AsyncLLM, the requests in flight, the watchdog's clock and the run's measurements."""

    def __init__(self, engine: Any, args: argparse.Namespace, prefixes: list[list[int]]):
        self.engine, self.args, self.prefixes = engine, args, prefixes
        self.tally = Tally()
        self.tasks: dict[asyncio.Task, RequestSpec] = {}
        self.heartbeat = time.monotonic()  # last output of any request
        self.hang: str | None = None
        self.failures: list[str] = []
        self.start = time.monotonic()
        self.memory_before: dict | None = None
        self.memory_samples: list[dict] = []
        self.counters_start: dict | None = None
        self.preemptions_start = 0

    async def request(self, spec: RequestSpec, tally: Tally) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        latest: dict[int, Any] = {}  # completion index -> its latest (cumulative) output
        final, aborted = None, False
        tally.submitted += 1
        tally.kinds[spec.kind] += 1
        try:
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=spec.prompt),
                                                  SamplingParams(**spec.params), spec.request_id):
                self.heartbeat = time.monotonic()
                final = out
                latest.update((c.index, c) for c in out.outputs)
                if (spec.abort_after is not None and not aborted and not out.finished
                        and max(len(c.token_ids) for c in latest.values()) >= spec.abort_after):
                    aborted = True
                    await self.engine.abort(spec.request_id)
        except Exception:
            tally.errors += 1
            print(f"soak: request {spec.request_id} failed:", flush=True)
            traceback.print_exc()
            return
        tally.account(spec, aborted, final, latest)

    def submit(self, spec: RequestSpec) -> None:
        self.tasks[asyncio.create_task(self.request(spec, self.tally))] = spec

    async def wait(self) -> None:
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        for task in [t for t in self.tasks if t.done()]:
            del self.tasks[task]

    async def quiesce(self) -> None:
        """Let every request in flight finish (the watchdog keeps watching)."""
        while self.tasks:
            await self.wait()

    async def rpc(self, function: Any) -> Any:
        result = await asyncio.wait_for(self.engine.collective_rpc(function), RPC_TIMEOUT_S)
        return result[0]

    async def measure(self, function: Any, what: str) -> dict | None:
        """``function``'s result from the engine's worker; None (and a line saying why) if not."""
        try:
            return await self.rpc(function)
        except Exception as exc:
            print(f"soak: {what} could not be read ({type(exc).__name__}: {exc})", flush=True)
            return None

    async def counters(self) -> dict | None:
        return await self.measure(soak_worker.plugin_counters, "the plugin's counters")

    async def memory(self) -> dict | None:
        memory = await self.measure(soak_worker.device_memory, "device memory")
        print(f"soak: device memory {memory}", flush=True)
        return memory

    async def warm_up(self) -> None:
        tally = Tally()
        specs = warmup_requests(self.prefixes, self.args.seed)
        try:
            await asyncio.wait_for(asyncio.gather(*(self.request(s, tally) for s in specs)),
                                   WARMUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"warm-up: not done after {WARMUP_TIMEOUT_S:.0f} s") from None
        if tally.completed != len(specs):
            raise RuntimeError(f"warm-up: {tally.completed} of {len(specs)} requests completed "
                               f"({tally.errors} raised; {tally.problems})")

    async def drive(self) -> None:
        """Keep --concurrency requests in flight until the duration and the count are reached."""
        args = self.args
        stream = request_stream(self.prefixes, args.seed)
        subset = subset_requests(self.prefixes, args.seed)
        next_subset, next_progress, baseline_taken = 0, self.start + PROGRESS_S, False
        while True:
            elapsed = time.monotonic() - self.start
            if self.engine.errored:
                self.failures.append("the engine died")
                break
            if self.tally.errors >= MAX_REQUEST_ERRORS:
                self.failures.append(f"{self.tally.errors} requests raised; stopped early")
                break
            if not baseline_taken and elapsed >= baseline_s(args.duration):
                await self.quiesce()
                self.memory_before, baseline_taken = await self.memory(), True
            reached = (elapsed >= args.duration and self.tally.submitted >= args.min_requests
                       and next_subset == len(subset))
            if reached or elapsed >= drive_cap_s(args.duration):
                break
            while len(self.tasks) < args.concurrency:
                if next_subset < len(subset) and elapsed >= subset_due_s(next_subset,
                                                                         args.duration):
                    self.submit(subset[next_subset])
                    next_subset += 1
                else:
                    self.submit(next(stream))
            await self.wait()
            if time.monotonic() >= next_progress:
                await self.progress()
                next_progress += PROGRESS_S
        await self.quiesce()

    async def watchdog(self, drive: asyncio.Task) -> None:
        while not drive.done():
            await asyncio.sleep(1.0)
            now = time.monotonic()
            if not self.tasks:
                self.heartbeat = now
            elif now - self.heartbeat > soak_judge.WATCHDOG_S:
                stuck = [spec.request_id for spec in list(self.tasks.values())[:8]]
                self.hang = (f"no request produced output for {now - self.heartbeat:.0f} s with "
                             f"{len(self.tasks)} in flight (e.g. {', '.join(stuck)})")
                print(f"soak: watchdog: {self.hang}; stopping", flush=True)
                drive.cancel()
                return

    async def progress(self) -> None:
        t = self.tally
        counters = await self.counters() if self.counters_start else None
        cascade = "?"
        if counters and self.counters_start:
            planned = counters["decode_steps_planned"] - self.counters_start[
                "decode_steps_planned"]
            done = counters["decode_steps_cascade"] - self.counters_start["decode_steps_cascade"]
            cascade = f"{done / planned:.1%}" if planned else "n/a"
        sample = await self.measure(soak_worker.memory_sample, "memory sample")
        if sample is not None:
            self.memory_samples.append({"t_s": round(time.monotonic() - self.start, 1),
                                        **sample})
        print(f"soak: {time.monotonic() - self.start:.0f} s: {t.submitted:,} submitted, "
              f"{t.finished:,} finished, {len(self.tasks)} in flight, {t.aborts:,} aborted, "
              f"{t.incomplete} incomplete, {t.errors} raised, "
              f"{preemptions() - self.preemptions_start:,} preemptions, "
              f"cascade on {cascade} of decode steps", flush=True)
        await self.engine.do_log_stats()

    def summary(self, counters_end: dict | None, memory_after: dict | None,
                duration_s: float) -> dict[str, Any]:
        t, start = self.tally, self.counters_start
        counters = None
        if counters_end and start:
            counters = {k: counter_delta(counters_end[k], start.get(k)) for k in counters_end}
        return {"requests": t.submitted, "completed": t.completed, "aborts": t.aborts,
                "aborts_raced": t.aborts_raced, "incomplete": t.incomplete,
                "request_errors": t.errors, "output_tokens": t.output_tokens,
                "kinds": dict(t.kinds), "problems": t.problems,
                "preemptions": preemptions() - self.preemptions_start,
                "counters": counters, "memory_before": self.memory_before,
                "memory_after": memory_after, "memory_samples": self.memory_samples,
                "duration_s": duration_s, "hang": self.hang,
                "failures": self.failures,
                "gpu": (memory_after or self.memory_before or {}).get("gpu"),
                "subset": t.subset}


def counter_delta(end: Any, start: Any) -> Any:
    """One of the plugin's counters over the soak: a number, counts by reason (a dict: the
    reasons that grew) or a histogram's bucket counts (a list)."""
    if isinstance(end, dict):
        before = start or {}
        return {k: v - before.get(k, 0) for k, v in end.items() if v != before.get(k, 0)}
    if isinstance(end, list):
        return [a - b for a, b in zip(end, start or [0] * len(end), strict=True)]
    return end - (start or 0)


def preemptions() -> int:
    """vLLM's ``vllm:num_preemptions`` counter (this process's Prometheus registry)."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return int(sum(sample.value for family in get_prometheus_registry().collect()
                   if family.name == "vllm:num_preemptions" for sample in family.samples
                   if sample.name == "vllm:num_preemptions_total"))


def make_engine(args: argparse.Namespace) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model, num_gpu_blocks_override=args.num_gpu_blocks, **ENGINE))


def worker_functions_by_value() -> None:
    """Have cloudpickle (vLLM's ``collective_rpc``) send :mod:`benchmarks.soak.worker`'s
    functions by value, as it sends a function of ``__main__``: the engine's processes need not
    find the ``benchmarks`` package."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(soak_worker)


async def run_phase(args: argparse.Namespace) -> int:
    worker_functions_by_value()
    engine = make_engine(args)
    drive = Drive(engine, args, shared_prefixes(args.seed))
    counters_end = memory_after = None
    try:
        await drive.warm_up()
        print("soak: warm-up done; driving", flush=True)
        drive.counters_start = await drive.counters()
        drive.preemptions_start = preemptions()
        drive.start = drive.heartbeat = time.monotonic()
        main = asyncio.create_task(drive.drive())
        watchdog = asyncio.create_task(drive.watchdog(main))
        await asyncio.wait({main})
        await watchdog
        if not main.cancelled():
            main.result()
            memory_after = await drive.memory()
        counters_end = await drive.counters()
    except Exception as exc:
        drive.failures.append(f"{type(exc).__name__}: {exc}")
        print("soak: the run phase failed:", flush=True)
        traceback.print_exc()
    finally:
        duration = time.monotonic() - drive.start
        for task in drive.tasks:
            task.cancel()
        await asyncio.gather(*drive.tasks, return_exceptions=True)
        result = drive.summary(counters_end, memory_after, duration)
        Path(args.out, "soak.run.json").write_text(json.dumps(result))
        engine.shutdown(timeout=60)
    failed = drive.hang or drive.failures
    return 1 if failed else 0


async def replay_phase(args: argparse.Namespace) -> int:
    engine = make_engine(args)
    drive = Drive(engine, args, shared_prefixes(args.seed))
    tally = Tally()
    try:
        subset = subset_requests(drive.prefixes, args.seed)
        await asyncio.gather(*(drive.request(spec, tally) for spec in subset))
    finally:
        Path(args.out, "soak.replay.json").write_text(json.dumps(
            {"subset": tally.subset, "incomplete": tally.incomplete, "errors": tally.errors,
             "problems": tally.problems}))
        engine.shutdown(timeout=60)
    return 0 if len(tally.subset) == SUBSET_SIZE else 1
