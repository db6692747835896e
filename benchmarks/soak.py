"""Soak: vLLM with cascade attention under a long, mixed load that preempts and aborts.

Usage (on the GPU machine):
    python benchmarks/soak.py --out DIR [--duration 600] [--min-requests 2000] [--concurrency 64]
        [--model DIR] [--num-gpu-blocks 1024] [--seed 0]
    python benchmarks/soak.py --dry-run [--min-requests N]   # the request mix only: no GPU

Three steps; each engine runs in a process of its own, because the plugin registers at startup
from the environment and is never switched inside a process:

1. ``run`` (``CASCADE_ATTENTION=1``; ``CASCADE_POLICY=always`` so that every step with a shared
   level runs cascade, whatever the cost model would pick for this small model;
   ``CASCADE_DEBUG=1`` so that every plan's invariants are checked): an ``AsyncLLM`` kept at
   ``--concurrency`` requests in flight until ``--duration`` seconds have passed and
   ``--min-requests`` were submitted. The mix: 8 shared-prefix groups (512-4,096 tokens; half of
   them behind one 512-token system prompt, so steps have three levels) with 16-128-token
   suffixes, 10% of prompts unshared, 15% ``n`` = 4 or 8 sampling, 10% aborted after a random
   number of output tokens, 16-128 tokens each, a KV cache of ``--num-gpu-blocks`` pages that
   cannot hold every group at once (preemption), and a fixed-seed greedy subset (64 requests,
   logprobs) submitted evenly through the run. A watchdog fails the run when no request
   produces output for 60 s while some are in flight.
2. ``replay`` (every ``CASCADE_*`` variable removed): the greedy subset alone, in one batch.
3. judge: ``DIR/soak.json`` (the issue's fields, every criterion, the reasons for a failure) and
   ``DIR/soak.meta.json``; the phases' logs and raw results lie beside them. Exit 0 on pass.

It passes when: at least ``--min-requests`` were submitted over at least ``--duration`` s; every
request that was not aborted finished with ``length`` (all its tokens) or ``stop``, ``n`` times;
the subset's chosen-token logprobs agree with the replay within 0.02 on average and 0.1 at most
(``vllm_cascade_plugin.face.agreement``, the engine tests' rule); the watchdog never fired; the engine
process's device memory after the drive is within 1% of a baseline taken after its first minute
(both read idle, after ``torch.cuda.empty_cache()``, so the allocator's cache is not mistaken for
a leak; the process's own figure, so other work on the GPU does not count); neither
log has an ERROR line, a traceback or a CUDA error; aborts, preemptions, ``n`` > 1 and cascade
steps all happened; no CUDA-graph capture failed; the plugin caught no error of its own (a
fallback for an error); both phases exited 0.

The model is ``--model``'s weights, or, for a folder with a ``config.json`` only (the default,
``examples/models/llama-tiny``), transformers' random initialisation (std 0.02, bf16, seed 0):
vLLM's dummy weights make attention nearly uniform and would hide a wrong page.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vllm_cascade_plugin.face import agreement

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "examples" / "models" / "llama-tiny"
ISSUE_FIELDS = ("requests", "aborts", "preemptions", "cascade_step_fraction", "max_abs_dlogprob",
                "duration_s", "outcome")

# The request mix. Token ids stay clear of the special ids at both ends of the 32,000 vocabulary.
TOKEN_RANGE = (100, 31900)
GROUPS = 8
SYSTEM_TOKENS = 512  # groups 0-3 start with this shared system prompt
PREFIX_TOKENS = (512, 4096)
SUFFIX_TOKENS = (16, 128)
UNSHARED_FRACTION = 0.1
UNSHARED_TOKENS = (64, 1024)
SAMPLING_FRACTION = 0.15
SAMPLING_N = (4, 8)
TEMPERATURE = 0.8
ABORT_FRACTION = 0.1
MAX_TOKENS = (16, 128)
SUBSET_SIZE = 64
SUBSET_SUFFIX_TOKENS = (16, 64)
SUBSET_SPAN = 0.8  # the subset is submitted evenly over the first 80% of --duration
GREEDY = {"temperature": 0.0, "max_tokens": 24, "logprobs": 2, "ignore_eos": True}

# The engine: as tests/gpu/engine_driver.py, with a smaller KV cache and max_model_len.
ENGINE = {"skip_tokenizer_init": True, "attention_backend": "FLASHINFER",
          "enable_prefix_caching": True, "max_model_len": 8192, "max_num_batched_tokens": 2048,
          "max_num_seqs": 128, "seed": 0, "enable_flashinfer_autotune": False,
          # A fixed KV cache and a small share of the GPU: the soak can run beside other work
          # (scripts/gpu_validate.sh), and vLLM skips its memory profiling, which that work
          # would disturb. --num-gpu-blocks sets the cache's size within these bytes.
          "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 1 << 30}
PLUGIN_ENV = {"CASCADE_ATTENTION": "1", "CASCADE_POLICY": "always", "CASCADE_DEBUG": "1"}

# Judging (logprobs: vllm_cascade_plugin.face.agreement, the rule of tests/gpu/test_engine.py).
MEMORY_TOL = 0.01
WATCHDOG_S = 60.0
# Fallbacks that mean the plugin caught an error of its own (the step then ran flat).
ERROR_FALLBACK = re.compile(r"error|invariant|out of range")
ERROR_LINE = re.compile(r"(?:^|\s)(?:ERROR|CRITICAL)\s|Traceback \(most recent call last\)"
                        r"|CUDA error|Task exception was never retrieved")

# Timing.
PROGRESS_S = 30.0
BASELINE_S = 60.0  # memory baseline after this much of the mix (or a quarter of --duration)
WARMUP_TIMEOUT_S = 1200.0  # first cascade steps may JIT-compile FlashInfer kernels (minutes)
STARTUP_ALLOWANCE_S = 1800.0  # engine start, warm-up, drain and shutdown, on top of the drive
REPLAY_TIMEOUT_S = 1800.0
RPC_TIMEOUT_S = 60.0
MAX_REQUEST_ERRORS = 20  # the drive stops early after this many failed requests


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    request_id: str
    kind: str  # "plain", "sampling", "subset" or "warmup"
    group: int  # shared-prefix group; -1: none
    prompt: list[int]
    params: dict[str, Any]  # SamplingParams keyword arguments
    abort_after: int | None = None  # abort once a completion has this many tokens


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(*TOKEN_RANGE, size=n).tolist()


def _between(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def shared_prefixes(seed: int) -> list[list[int]]:
    """The groups' prefixes; the first half share a system prompt (a three-level tree)."""
    rng = np.random.default_rng([seed, 0])
    system = _tokens(rng, SYSTEM_TOKENS)
    prefixes = []
    for group in range(GROUPS):
        length = _between(rng, PREFIX_TOKENS)
        if group < GROUPS // 2:
            prefixes.append(system + _tokens(rng, length - SYSTEM_TOKENS))
        else:
            prefixes.append(_tokens(rng, length))
    return prefixes


def request_stream(prefixes: list[list[int]], seed: int) -> Iterator[RequestSpec]:
    """The drive's requests, endless and the same for a seed."""
    rng = np.random.default_rng([seed, 1])
    for i in range(sys.maxsize):
        group = -1 if rng.random() < UNSHARED_FRACTION else int(rng.integers(len(prefixes)))
        prompt = (_tokens(rng, _between(rng, UNSHARED_TOKENS)) if group < 0
                  else prefixes[group] + _tokens(rng, _between(rng, SUFFIX_TOKENS)))
        max_tokens = _between(rng, MAX_TOKENS)
        request_seed = int(rng.integers(2**31))
        if rng.random() < SAMPLING_FRACTION:
            kind = "sampling"
            params = {"n": int(rng.choice(SAMPLING_N)), "temperature": TEMPERATURE}
        else:
            kind = "plain"
            params = {"temperature": float(rng.choice([0.0, TEMPERATURE]))}
        params.update(max_tokens=max_tokens, seed=request_seed)
        abort_after = _between(rng, (1, max_tokens - 1)) if rng.random() < ABORT_FRACTION else None
        yield RequestSpec(f"r{i}", kind, group, prompt, params, abort_after)


def subset_requests(prefixes: list[list[int]], seed: int) -> list[RequestSpec]:
    """The greedy requests replayed without the plugin: every group, never aborted."""
    rng = np.random.default_rng([seed, 2])
    return [RequestSpec(f"s{i}", "subset", i % len(prefixes),
                        prefixes[i % len(prefixes)] + _tokens(rng, _between(rng,
                                                                              SUBSET_SUFFIX_TOKENS)),
                        dict(GREEDY))
            for i in range(SUBSET_SIZE)]


def warmup_requests(prefixes: list[list[int]], seed: int) -> list[RequestSpec]:
    """A small batch of every kind, run before the clock starts (kernels JIT-compile here)."""
    rng = np.random.default_rng([seed, 3])
    short = {"max_tokens": 8, "seed": seed}
    specs = [RequestSpec(f"w{i}", "warmup", 0, prefixes[0] + _tokens(rng, 16),
                         {**GREEDY, "max_tokens": 8}) for i in range(8)]
    specs.append(RequestSpec("w8", "warmup", 1, prefixes[1] + _tokens(rng, 16),
                             {**short, "n": 4, "temperature": TEMPERATURE}))
    specs.append(RequestSpec("w9", "warmup", -1, _tokens(rng, 256),
                             {**short, "temperature": TEMPERATURE}))
    return specs


def subset_due_s(index: int, duration_s: float) -> float:
    """When the drive submits subset request ``index``: evenly over its first SUBSET_SPAN."""
    return SUBSET_SPAN * duration_s * index / SUBSET_SIZE


def baseline_s(duration_s: float) -> float:
    return min(BASELINE_S, duration_s / 4)


def drive_cap_s(duration_s: float) -> float:
    """Submitting stops here even when --min-requests was not reached (the run then fails)."""
    return max(2 * duration_s, duration_s + 600)


def completion_problem(n: int, max_tokens: int, finished: bool,
                       completions: Sequence[tuple[str | None, int]]) -> str | None:
    """Why a request that was not aborted did not complete as asked; None when it did.

    ``completions``: (finish reason, token count) of each of its ``n`` completions.
    """
    if not finished:
        return "not finished"
    if len(completions) != n:
        return f"{len(completions)} of {n} completions"
    for reason, count in completions:
        if reason not in ("length", "stop"):
            return f"finish reason {reason!r}"
        if reason == "length" and count != max_tokens:
            return f"finish reason 'length' after {count} of {max_tokens} tokens"
    return None


def error_lines(log: str) -> list[str]:
    """Lines of a phase's log that report an error: vLLM's ERROR lines, tracebacks, CUDA errors."""
    return [line for line in log.splitlines() if ERROR_LINE.search(line)]


def judge(run: dict | None, replay: dict | None, settings: dict[str, Any],
          exit_codes: dict[str, int | None], errors: dict[str, list[str]]) -> dict[str, Any]:
    """soak.json: the issue's fields, every criterion with its evidence, and the verdict.

    ``run``/``replay``: the phases' results (None when a phase wrote none); ``exit_codes``: each
    phase's exit status (None: not run); ``errors``: each phase's error lines.
    """
    run = run or {}
    counters = run.get("counters") or {}
    planned, cascade = counters.get("decode_steps_planned", 0), counters.get(
        "decode_steps_cascade", 0)
    fallbacks = counters.get("fallbacks", {})
    plugin_errors = {r: n for r, n in fallbacks.items() if ERROR_FALLBACK.search(r)}
    ran, replayed = run.get("subset", {}), (replay or {}).get("subset", {})
    ids = [i for i in ran if i in replayed]
    worst, mean, compared = agreement.compare([ran[i] for i in ids],
                                              [replayed[i] for i in ids])
    identical = sum(ran[i]["tokens"] == replayed[i]["tokens"] for i in ids)
    before, after = run.get("memory_before") or {}, run.get("memory_after") or {}
    memory_change = (after["used_mib"] - before["used_mib"]) / before["used_mib"] if (
        before and after) else None
    requests, aborts = run.get("requests", 0), run.get("aborts", 0)
    preemptions, duration = run.get("preemptions", 0), run.get("duration_s", 0.0)
    incomplete, failed = run.get("incomplete", 0), run.get("request_errors", 0)
    hang = run.get("hang")
    if hang is None and exit_codes.get("run") == -signal.SIGKILL:
        hang = "the run phase was killed (its time limit, or out of memory)"
    n_errors = sum(len(lines) for lines in errors.values())
    graphs = after.get("graphs") or {}
    graph_replays = graphs.get("graph_replays", 0) + graphs.get("full_graph_replays", 0)
    checks = [
        ("requests", requests >= settings["min_requests"],
         f"{requests:,} submitted, at least {settings['min_requests']:,} required"),
        ("duration", duration >= settings["duration"],
         f"drove for {duration:.0f} s, at least {settings['duration']:.0f} s required"),
        ("completion", incomplete == 0 and failed == 0 and run.get("completed", 0) > 0,
         f"{run.get('completed', 0):,} completed; {incomplete} not aborted but incomplete, "
         f"{failed} raised; {run.get('problems', [])[:5]}"),
        ("logprobs", len(ids) == SUBSET_SIZE and agreement.agrees(worst, mean, compared),
         f"{len(ids)} of {SUBSET_SIZE} subset requests compared ({identical} identical), "
         f"{compared} tokens: max |d| {worst:.4f} (<= {agreement.MAX_TOL}), mean {mean:.4f} "
         f"(<= {agreement.MEAN_TOL})"),
        ("no_hang", hang is None and exit_codes.get("run") is not None,
         hang or "a request produced output at least every "
         f"{WATCHDOG_S:.0f} s while any was in flight"),
        ("memory", memory_change is not None and abs(memory_change) <= MEMORY_TOL,
         "not measured" if memory_change is None else
         f"{before['used_mib']:,.0f} MiB -> {after['used_mib']:,.0f} MiB "
         f"({100 * memory_change:+.2f}%, limit {100 * MEMORY_TOL:.0f}%)"),
        ("no_error_lines", n_errors == 0,
         f"{n_errors} error lines: " + "; ".join(
             f"{phase}: {lines[:3]}" for phase, lines in errors.items() if lines)),
        ("exercised", aborts > 0 and preemptions > 0 and cascade > 0
         and run.get("kinds", {}).get("sampling", 0) > 0,
         f"{aborts} aborts, {preemptions} preemptions, {cascade:,} cascade decode steps, "
         f"{run.get('kinds', {}).get('sampling', 0)} n>1 requests (each must be > 0)"),
        ("capture_failures", bool(counters) and counters.get("graph_capture_failures", 0) == 0,
         f"{counters.get('graph_capture_failures', 0)} CUDA-graph captures failed; "
         f"{graph_replays:,} graph replays" if counters
         else "the plugin's counters could not be read"),
        ("plugin_errors", not plugin_errors and bool(counters),
         f"fallbacks caused by errors: {plugin_errors}" if counters
         else "the plugin's counters could not be read"),
        ("phases", exit_codes.get("run") == 0 and exit_codes.get("replay") == 0
         and not run.get("failures"),
         f"exit codes {exit_codes}; failures {run.get('failures', ['no results'])}"),
    ]
    criteria = {name: {"ok": bool(ok), "detail": detail} for name, ok, detail in checks}
    reasons = [f"{name}: {c['detail']}" for name, c in criteria.items() if not c["ok"]]
    return {
        "requests": requests,
        "aborts": aborts,
        "preemptions": preemptions,
        "cascade_step_fraction": cascade / planned if planned else None,
        "max_abs_dlogprob": worst if compared else None,
        "duration_s": round(duration, 1),
        "outcome": "fail" if reasons else "pass",
        "graph_replays": graph_replays,  # per-layer and whole-step, in the drive
        "capture_failures": counters.get("graph_capture_failures", 0),
        "date": datetime.date.today().isoformat(),
        "reasons": reasons,
        "criteria": criteria,
        "mean_abs_dlogprob": mean if compared else None,
        "compared_tokens": compared,
        "subset_compared": len(ids),
        "subset_identical": identical,
        "completed": run.get("completed", 0),
        "non_aborted_incomplete": incomplete,
        "request_errors": failed,
        "aborts_raced": run.get("aborts_raced", 0),
        "output_tokens": run.get("output_tokens", 0),
        "kinds": run.get("kinds", {}),
        "memory_before_mib": before.get("used_mib"),
        "memory_after_mib": after.get("used_mib"),
        "memory_change_fraction": memory_change,
        "memory_raw_mib": [before.get("used_raw_mib"), after.get("used_raw_mib")],
        "memory_samples": run.get("memory_samples", []),
        "memory_readings": {"before": before, "after": after},
        "executors": after.get("executors", before.get("executors")),
        "error_lines": n_errors,
        "plugin_counters": counters,
        "fallbacks": fallbacks,
        "settings": settings,
    }


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """What the drive would submit first (--min-requests of it), from the seed alone."""
    prefixes = shared_prefixes(args.seed)
    stream = request_stream(prefixes, args.seed)
    specs = [next(stream) for _ in range(args.min_requests)]
    subset = subset_requests(prefixes, args.seed)
    prompts = np.array([len(s.prompt) for s in specs])
    # Pages the groups' prefixes hold when all are cached (the system prompt once).
    prefix_tokens = SYSTEM_TOKENS + sum(len(p) - SYSTEM_TOKENS * (g < GROUPS // 2)
                                        for g, p in enumerate(prefixes))
    return {
        "requests": len(specs),
        "kinds": dict(Counter(s.kind for s in specs)),
        "sampling_n": {str(n): c for n, c in sorted(Counter(
            s.params.get("n", 1) for s in specs).items())},
        "planned_aborts": sum(s.abort_after is not None for s in specs),
        "unshared": sum(s.group < 0 for s in specs),
        "groups": [{"prefix_tokens": len(p), "requests": sum(s.group == g for s in specs)}
                   for g, p in enumerate(prefixes)],
        "prompt_tokens": {"min": int(prompts.min()), "mean": float(prompts.mean()),
                          "max": int(prompts.max())},
        "longest_request_tokens": max(len(s.prompt) + s.params["max_tokens"]
                                      for s in [*specs, *subset]),
        "max_model_len": ENGINE["max_model_len"],
        "prefix_kv_blocks": -(-prefix_tokens // 16),
        "num_gpu_blocks": args.num_gpu_blocks,
        "subset": {"requests": len(subset), "groups": len({s.group for s in subset}),
                   "first_due_s": subset_due_s(0, args.duration),
                   "last_due_s": subset_due_s(len(subset) - 1, args.duration)},
    }


# --- Inside the engine's worker process (through collective_rpc; VLLM_ALLOW_INSECURE_SERIALIZATION
# lets vLLM pickle these functions, which it does by value since they live in __main__).

def _plugin_counters(worker: object) -> dict[str, Any]:
    from vllm_cascade_plugin import stats

    counters = stats.snapshot()
    return {**{f.name: getattr(counters, f.name) for f in dataclasses.fields(counters)},
            "fallbacks": dict(counters.fallbacks)}


def _device_memory(worker: object) -> dict[str, Any]:
    """Device memory in use, after the torch allocator returned its cache of freed blocks.

    Read between engine steps, with no request in flight: what remains is what lives (weights,
    KV cache, CUDA graphs, workspaces), so growth between two readings is a leak, not the
    allocator's high-water mark. ``used_raw_mib`` is the reading before emptying the cache.
    """
    import torch

    torch.cuda.synchronize()
    raw, _ = _process_used_mib()
    torch.cuda.empty_cache()
    used, source = _process_used_mib()
    return {"used_mib": used, "used_raw_mib": raw, "used_source": source,
            "total_mib": torch.cuda.mem_get_info()[1] / 2**20,
            "allocated_mib": torch.cuda.memory_allocated() / 2**20,
            "plugin_mib": _plugin_mib(), "gpu": torch.cuda.get_device_name(),
            "executors": _executors(), "graphs": _graphs()}


def _process_used_mib() -> tuple[float, str]:
    """This (engine) process's device memory, whatever else runs on the GPU: the driver's
    per-process figure (NVML: the CUDA context, every allocation, CUDA graphs) where it lists
    this process (it does not where the process ids are a container's own), else what torch's
    allocator holds (tensors and CUDA-graph pools). Returns (MiB, which of the two)."""
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return proc.usedGpuMemory / 2**20, "nvml process"
    except Exception:  # no NVML here: the allocator's figure below
        pass
    return torch.cuda.memory_reserved() / 2**20, "torch reserved"


def _graphs() -> dict[str, int] | None:
    """The FA3 executor's per-layer CUDA graphs and the whole-step graphs of decode steps
    (held now: their pools are not in plugin_mib)."""
    kernels = sys.modules.get("vllm_cascade_plugin.execution.kernels")
    fullgraph = sys.modules.get("vllm_cascade_plugin.graphs.fullgraph")
    if kernels is None and fullgraph is None:
        return None
    return {**({} if kernels is None else kernels.graph_stats()),
            **({} if fullgraph is None else fullgraph.graph_stats())}


def _executors() -> list[str]:
    """Which cascade executor ran (CASCADE_KERNEL): FlashInfer's or FA3."""
    kernels = sys.modules.get("vllm_cascade_plugin.execution.kernels")
    return [] if kernels is None else sorted({e.kernel for e in list(kernels.EXECUTORS)})


def _plugin_mib() -> float | None:
    """The plugin's GPU buffers in this (engine) process; None where cascade cannot run."""
    kernels = sys.modules.get("vllm_cascade_plugin.execution.kernels")  # imported only where it can
    return None if kernels is None else kernels.device_bytes() / 2**20


def _memory_sample(worker: object) -> dict[str, Any]:
    """Live torch allocations and the plugin's buffers, read under load (no sync, no emptying).

    Taken with every progress line: a leak grows steadily through the run, one-time growth
    (a buffer sized by the largest step so far) levels off.
    """
    import torch

    return {"allocated_mib": torch.cuda.memory_allocated() / 2**20, "plugin_mib": _plugin_mib()}


# --- The run and replay phases (child processes).

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
        return await self.measure(_plugin_counters, "the plugin's counters")

    async def memory(self) -> dict | None:
        memory = await self.measure(_device_memory, "device memory")
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
            elif now - self.heartbeat > WATCHDOG_S:
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
        sample = await self.measure(_memory_sample, "memory sample")
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
            counters = {k: counters_end[k] - start[k] for k in counters_end if k != "fallbacks"}
            counters["fallbacks"] = dict(Counter(counters_end["fallbacks"])
                                         - Counter(start["fallbacks"]))
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


async def run_phase(args: argparse.Namespace) -> int:
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


# --- The orchestrator.

def build_model(config_dir: Path, out: Path) -> None:
    """tests/gpu/test_engine.py's model: transformers' init (std 0.02) in bf16, seed 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_pretrained(config_dir)).to(torch.bfloat16).save_pretrained(out)


def child_env(plugin: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASCADE_")}
    env["PYTHONUNBUFFERED"] = "1"
    if plugin:
        # collective_rpc with a function (the plugin's counters live in the engine process).
        env.update(PLUGIN_ENV, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    return env


def run_child(phase: str, argv: list[str], log_path: Path, plugin: bool, timeout_s: float) -> int:
    """One phase in its own process group: everything it prints goes to ``log_path``, its
    ``soak:`` lines to our stdout too; killed with its engine after ``timeout_s``."""
    killed = threading.Event()
    with open(log_path, "w", buffering=1) as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--phase", phase,
                                 *argv], env=child_env(plugin), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)

        def kill() -> None:
            killed.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if line.startswith("soak:"):
                    print(line, end="", flush=True)
            code = proc.wait()
        finally:
            timer.cancel()
    if killed.is_set():
        print(f"soak: the {phase} phase ran past {timeout_s:.0f} s and was killed", flush=True)
    return code


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def orchestrate(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("soak.json", "soak.meta.json", "soak.run.json", "soak.replay.json"):
        (out / stale).unlink(missing_ok=True)
    settings = {"duration": args.duration, "min_requests": args.min_requests,
                "concurrency": args.concurrency, "num_gpu_blocks": args.num_gpu_blocks,
                "seed": args.seed, "watchdog_s": WATCHDOG_S, "plugin_env": PLUGIN_ENV,
                "engine": ENGINE}
    exit_codes: dict[str, int | None] = {"run": None, "replay": None}
    with tempfile.TemporaryDirectory(prefix="soak-model-") as scratch:
        model = Path(args.model).resolve()
        if any(model.glob("*.safetensors")):
            settings["model"] = f"{model} (its weights)"
        else:
            print(f"soak: building random weights for {model}", flush=True)
            build_model(model, Path(scratch))
            settings["model"] = f"{model} config, transformers' init (std 0.02), bf16, seed 0"
            model = Path(scratch)
        argv = ["--model", str(model), "--out", str(out), "--duration", str(args.duration),
                "--min-requests", str(args.min_requests), "--concurrency", str(args.concurrency),
                "--num-gpu-blocks", str(args.num_gpu_blocks), "--seed", str(args.seed)]
        print(f"soak: run phase (plugin on), log {out / 'soak.run.log'}", flush=True)
        exit_codes["run"] = run_child("run", argv, out / "soak.run.log", True,
                                      drive_cap_s(args.duration) + STARTUP_ALLOWANCE_S)
        run = _read(out / "soak.run.json")
        replay = None
        if run and run["subset"]:
            print(f"soak: replay phase (plugin off), log {out / 'soak.replay.log'}", flush=True)
            exit_codes["replay"] = run_child("replay", argv, out / "soak.replay.log", False,
                                             REPLAY_TIMEOUT_S)
            replay = _read(out / "soak.replay.json")
    errors = {phase: error_lines((out / f"soak.{phase}.log").read_text(errors="replace"))
              for phase, code in exit_codes.items() if code is not None}
    result = judge(run, replay, settings, exit_codes, errors)
    meta = {"date": datetime.date.today().isoformat(), "gpu": (run or {}).get("gpu"),
            "vllm": _version("vllm"), "flashinfer": _version("flashinfer-python"),
            "torch": _version("torch"), "python": platform.python_version(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "model": settings["model"],
            "notes": "plugin on (run) with " + " ".join(f"{k}={v}" for k, v in PLUGIN_ENV.items())
                     + "; replay of the greedy subset with every CASCADE_* variable removed."}
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    (out / "soak.meta.json").write_text(json.dumps(meta, indent=1))
    print(f"soak: {result['outcome'].upper()}: " + json.dumps(
        {k: result[k] for k in ISSUE_FIELDS if k != "outcome"}), flush=True)
    for reason in result["reasons"]:
        print(f"soak:   {reason}", flush=True)
    print(f"soak: results in {out / 'soak.json'} (logs and raw results beside it)", flush=True)
    return 0 if result["outcome"] == "pass" else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for soak.json, soak.meta.json, the logs and the "
                        "raw results (required but for --dry-run)")
    parser.add_argument("--duration", type=float, default=600.0,
                        help="seconds to drive the engine, at least (default 600)")
    parser.add_argument("--min-requests", type=int, default=2000,
                        help="requests to submit, at least (default 2000)")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="requests in flight (an n>1 request counts once; default 64)")
    parser.add_argument("--model", default=str(DEFAULT_MODEL),
                        help="a model folder; one without *.safetensors gets random weights")
    parser.add_argument("--num-gpu-blocks", type=int, default=1024,
                        help="KV cache pages of 16 tokens: too few for every group (preemption)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument("--dry-run", action="store_true",
                        help="print a summary of the request mix as JSON and exit (no GPU)")
    parser.add_argument("--phase", choices=("run", "replay"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out is None and not args.dry_run:
        parser.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print(json.dumps(dry_run(args), indent=1))
        return 0
    if args.phase == "run":
        return asyncio.run(run_phase(args))
    if args.phase == "replay":
        return asyncio.run(replay_phase(args))
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
