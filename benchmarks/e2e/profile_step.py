"""Where a decode step's time goes: one engine, one workload, ``torch.profiler`` around a short
timed generate (engine core in this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

Usage (on the GPU machine; the configuration's environment is set here, as in e2e/bench.py):
    python3 -m benchmarks.e2e.profile_step --config cascade --out DIR [--workload NAME] \
        [--tokens 48]
    python3 -m benchmarks.e2e.profile_step --python --config cascade --out DIR   # Python's view

``--python`` profiles the same run with ``cProfile`` instead (the engine's Python: scheduler,
runner, plugin; the torch profiler sees operators only) and writes ``DIR/pyprofile-CONFIG.*``:
wall time, and the top functions by own and by cumulative time.

Writes ``DIR/profile-CONFIG.json``: wall time of the profiled generate, GPU busy time (union of
kernel intervals) and its share of the wall time, CUDA kernel time by kernel, CPU time by
operator and by vLLM's own annotated regions; and ``DIR/profile-CONFIG.txt`` (the same as
tables). The profiled run is a few dozen steps after an untimed warm-up of the same prompts,
so prefill is over (prefix cache hits) and what is profiled is mostly decode steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, child_path, command_line, module_command
from benchmarks.e2e.bench import CONFIGS, MAX_MODEL_LEN, workloads


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _warm_engine(model: str, config: str, workload: str, tokens: int) -> tuple:
    """An engine that has run the workload twice (every kernel and graph shape seen once), and
    what generates it again."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    backend, _ = CONFIGS[config]
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True,
              attention_backend=backend, enable_prefix_caching=True, max_model_len=MAX_MODEL_LEN,
              gpu_memory_utilization=0.85, seed=0, enable_flashinfer_autotune=False)
    prompts, params = workloads()[workload]
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(batch, SamplingParams(**{**params, "max_tokens": 8}), use_tqdm=False)
    sampling = SamplingParams(**{**params, "max_tokens": tokens})
    llm.generate(batch, sampling, use_tqdm=False)
    return llm, batch, sampling, len(prompts)


def python_profile(model: str, config: str, workload: str, tokens: int) -> dict:
    """cProfile around the same generate: where the engine's host time goes, by function."""
    import cProfile
    import pstats

    import torch

    llm, batch, sampling, requests = _warm_engine(model, config, workload, tokens)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    llm.generate(batch, sampling, use_tqdm=False)
    torch.cuda.synchronize()
    prof.disable()
    wall_ms = (time.perf_counter() - start) * 1e3
    rows = [(f"{Path(f).name}:{line}({name})", tt * 1e3, ct * 1e3, nc)
            for (f, line, name), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]
    return {"config": config, "workload": workload, "tokens": tokens, "requests": requests,
            "wall_ms": wall_ms,
            "own_ms": [[k, t, n] for k, t, _, n in sorted(rows, key=lambda r: -r[1])[:60]],
            "cumulative_ms": [[k, c, n] for k, _, c, n in sorted(rows, key=lambda r: -r[2])[:80]]}


def profile(model: str, config: str, workload: str, tokens: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity

    llm, batch, sampling, requests = _warm_engine(model, config, workload, tokens)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(batch, sampling, use_tqdm=False)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    kernels: dict[str, float] = {}
    intervals = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            intervals.append((event.time_range.start, event.time_range.end))
            kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us()
    cpu_ops = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()
                      if e.self_cpu_time_total > 0), key=lambda x: -x[1])
    regions = sorted(((e.key, e.cpu_time_total, e.count) for e in prof.key_averages()
                      if ":" in e.key or e.key.startswith(("execute", "forward", "sample"))),
                     key=lambda x: -x[1])
    busy = _busy_us(intervals)
    return {
        "config": config, "workload": workload, "tokens": tokens, "requests": requests,
        "wall_ms": wall_us / 1e3, "gpu_busy_ms": busy / 1e3, "gpu_busy_share": busy / wall_us,
        "kernels_ms": {k: v / 1e3 for k, v in sorted(kernels.items(), key=lambda x: -x[1])[:40]},
        "cpu_self_ms": [[k, t / 1e3, n] for k, t, n in cpu_ops[:40]],
        "regions_ms": [[k, t / 1e3, n] for k, t, n in regions[:30]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/models/llama3-8b")
    parser.add_argument("--out", default=str(RESULTS / "gpu"))
    parser.add_argument("--config", default="cascade", choices=list(CONFIGS))
    parser.add_argument("--workload", default="b128_16k_prefix_64_own")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--python", action="store_true",
                        help="cProfile the engine's Python instead of the torch profiler")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run = python_profile if args.python else profile
        print("ROW" + json.dumps(run(args.model, args.config, args.workload, args.tokens)))
        return 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASCADE_")}
    env.update(CONFIGS[args.config][1], VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=child_path(inherited=env.get("PYTHONPATH")))
    proc = subprocess.run([*module_command(__spec__.name), "--child", *sys.argv[1:]], env=env,
                          capture_output=True, text=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{'pyprofile' if args.python else 'profile'}-{args.config}"
    (out / f"{stem}.log").write_text(proc.stdout + proc.stderr)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    row = json.loads(line[3:])
    import flashinfer
    import torch
    import vllm

    row["meta"] = {"date": datetime.date.today().isoformat(),
                   "gpu": torch.cuda.get_device_name(), "vllm": vllm.__version__,
                   "flashinfer": flashinfer.__version__, "torch": torch.__version__,
                   "command": command_line()}
    (out / f"{stem}.json").write_text(json.dumps(row, indent=1))
    if args.python:
        lines = [f"{args.config} {args.workload}: wall {row['wall_ms']:.1f} ms (cProfile on)",
                 *_table("own time (ms, calls):", row["own_ms"], 40, 110),
                 *_table("cumulative time (ms, calls):", row["cumulative_ms"], 60, 110)]
    else:
        lines = [f"{args.config} {args.workload}: wall {row['wall_ms']:.1f} ms, GPU busy "
                 f"{row['gpu_busy_ms']:.1f} ms ({100 * row['gpu_busy_share']:.0f}%)",
                 "kernels (ms):",
                 *(f"  {v:9.2f}  {k[:110]}" for k, v in list(row["kernels_ms"].items())[:25]),
                 *_table("CPU self time (ms, calls):", row["cpu_self_ms"], 25, 100),
                 *_table("annotated regions (ms, calls):", row["regions_ms"], 20, 100)]
    (out / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _table(title: str, rows: list, count: int, width: int) -> list[str]:
    """``title`` and the first ``count`` ``[name, ms, calls]`` rows, one line each."""
    return [title, *(f"  {t:9.2f} {n:7d}  {k[:width]}" for k, t, n in rows[:count])]


if __name__ == "__main__":
    sys.exit(main())
