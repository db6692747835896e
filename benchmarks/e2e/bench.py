"""End-to-end throughput: vLLM's LLM with and without the plugin, one engine per configuration.

Usage (on the GPU machine):
    python3 -m benchmarks.e2e.bench --model examples/models/llama3-8b --out DIR \
        [--workloads one_8k_prefix_x64] [--configs flash_attn,flashinfer,cascade] [--dry-run]

Dummy weights (``load_format="dummy"``: timing only), prefix caching on, vLLM's default compilation
and CUDA-graph settings, and vLLM's default engine process (the engine core in a process of its
own; ``--in-process`` runs it in the benchmark's process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
as ``history/e2e_in_process.json`` did). A workload is run once untimed (warms the prefix cache and
kernels), then timed; the planner's CPU time is inside the timed region, since it runs in the
engine step. The plugin's counters come from the worker through ``LLM.collective_rpc`` (a
function sent to the worker: ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in the child's environment).
Writes ``e2e.json`` (rows ``{"workload", "config", "out_tok_per_s", ...}``) with provenance.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.common import RESULTS, child_path, module_command

CONFIGS = {  # name -> (attention backend, plugin environment)
    "flash_attn": ("FLASH_ATTN", {}),
    "flashinfer": ("FLASHINFER", {}),
    "cascade": ("FLASHINFER", {"CASCADE_ATTENTION": "1"}),
    # The plugin in vLLM's default backend (FA3 kernels), against plain flash_attn.
    "cascade_flash_attn": ("FLASH_ATTN", {"CASCADE_ATTENTION": "1"}),
    # Cascade on every step with a shared level, whatever the cost model says.
    "cascade_always": ("FLASHINFER", {"CASCADE_ATTENTION": "1", "CASCADE_POLICY": "always"}),
    # The same in vLLM's default backend: against flash_attn, what a cascade step costs there.
    "cascade_flash_attn_always": ("FLASH_ATTN", {"CASCADE_ATTENTION": "1",
                                                 "CASCADE_POLICY": "always"}),
    # The FA3 executor without the fused decode kernel (A/B of decode_level end to end).
    "cascade_unfused": ("FLASHINFER", {"CASCADE_ATTENTION": "1", "CASCADE_FUSED_DECODE": "0"}),
    # Without the executor's CUDA graphs of decode steps (A/B of CASCADE_CUDA_GRAPHS).
    "cascade_nographs": ("FLASHINFER", {"CASCADE_ATTENTION": "1", "CASCADE_CUDA_GRAPHS": "0"}),
    # Per-layer graphs only, no whole-step graphs (A/B of CASCADE_FULL_GRAPHS).
    "cascade_layergraphs": ("FLASHINFER", {"CASCADE_ATTENTION": "1", "CASCADE_FULL_GRAPHS": "0"}),
}

# The longest workload: a 16K-token prefix, 64 own tokens and 256 generated ones.
MAX_MODEL_LEN = 16384 + 512



def workloads() -> dict[str, tuple[list[list[int]], dict]]:
    rng = np.random.default_rng(0)

    def tokens(n: int) -> list[int]:
        return rng.integers(100, 30000, size=n).tolist()

    greedy = {"max_tokens": 256, "temperature": 0.0, "ignore_eos": True}
    prefix = tokens(8192)
    w = {"one_8k_prefix_x64": ([prefix + tokens(16) for _ in range(64)], greedy)}
    # The performance issue's four targets.
    prefix = tokens(16384)
    w["b128_16k_prefix_64_own"] = ([prefix + tokens(64) for _ in range(128)], greedy)
    prefixes = [tokens(8192) for _ in range(8)]
    w["8_prefixes_8k_x16_interleaved"] = (
        [prefixes[i % 8] + tokens(64) for i in range(128)], greedy)
    w["n16_sampling_32_prompts_4k"] = (
        [tokens(4096) for _ in range(32)],
        {**greedy, "n": 16, "temperature": 0.8, "seed": 0})
    w["no_sharing_256_random_2k"] = ([tokens(2048) for _ in range(256)], greedy)
    # Batches the size a server decodes at moderate load (SERVING_BATCHES), behind the serving
    # benchmark's shared prefixes: 16 documents of 2K tokens and 4 of 8K (128 own tokens each,
    # requests interleaved over the documents), and a chat's one system prompt of 1.5K tokens
    # with 640 own. Appended last: the workloads above keep their tokens.
    for name, count, length, own in SERVING_SHAPES:
        shared = [tokens(length) for _ in range(count)]
        for rows in SERVING_BATCHES[name]:
            w[f"{name}_b{rows}"] = ([shared[i % count] + tokens(own) for i in range(rows)],
                                    greedy)
    return w


# (name, shared prefixes, their tokens, own tokens per request) -> SERVING_BATCHES rows each.
SERVING_SHAPES = (("serving_2k_x16", 16, 2048, 128), ("serving_8k_x4", 4, 8192, 128),
                  ("serving_chat_1k5", 1, 1536, 640))
SERVING_BATCHES = {"serving_2k_x16": (32, 64, 128), "serving_8k_x4": (32, 64),
                   "serving_chat_1k5": (64, 128)}


def run_one(model: str, config: str, names: list[str], in_process: bool) -> list[dict]:
    """Runs inside the child process: one engine, the chosen workloads."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    backend, _ = CONFIGS[config]
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True,
              attention_backend=backend, enable_prefix_caching=True, max_model_len=MAX_MODEL_LEN,
              gpu_memory_utilization=0.85, seed=0, enable_flashinfer_autotune=False)
    plugin_on = config.startswith("cascade")
    rows = []
    for name in names:
        prompts, params = workloads()[name]
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.generate(batch, SamplingParams(**{**params, "max_tokens": 4}), use_tqdm=False)
        before = _plugin_counters(llm) if plugin_on else None
        start = time.perf_counter()
        outputs = llm.generate(batch, SamplingParams(**params), use_tqdm=False)
        elapsed = time.perf_counter() - start
        out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        row = {"workload": name, "config": config, "out_tok_per_s": out_tokens / elapsed,
               "output_tokens": out_tokens, "seconds": elapsed,
               "engine_process": "in-process" if in_process else "multiprocessing"}
        if before is not None and "error" in before:
            row["plugin_counters"] = before
        elif before is not None:  # this workload's timed steps only
            after = _plugin_counters(llm)
            if "error" in after:
                row["plugin_counters"] = after
                rows.append(row)
                continue
            row["plugin_counters"] = {
                "steps_planned": after["steps_planned"] - before["steps_planned"],
                "steps_cascade": after["steps_cascade"] - before["steps_cascade"],
                **{k: after.get(k, 0) - before.get(k, 0) for k in GRAPH_COUNTERS},
                "fallbacks": {k: v - before["fallbacks"].get(k, 0)
                              for k, v in after["fallbacks"].items()
                              if v > before["fallbacks"].get(k, 0)}}
            row["kernel"] = after["executors"]
        rows.append(row)
    return rows


# Per-layer graphs (kernels.graph_stats) and whole-step graphs (fullgraph.graph_stats).
GRAPH_COUNTERS = ("graph_captures", "graph_replays", "full_graph_captures", "full_graph_replays")


def _worker_counters(worker: object) -> dict:
    """Runs in the worker's process (``LLM.collective_rpc``): the plugin's counters there and
    its executors."""
    from vllm_cascade_plugin import stats

    del worker
    counters = stats.snapshot()
    kernels = sys.modules.get("vllm_cascade_plugin.execution.kernels")
    executors = [] if kernels is None else list(kernels.EXECUTORS)
    graphs = {} if kernels is None else kernels.graph_stats()
    fullgraph = sys.modules.get("vllm_cascade_plugin.graphs.fullgraph")
    graphs.update({} if fullgraph is None else fullgraph.graph_stats())
    return {"steps_planned": counters.steps_planned, "steps_cascade": counters.steps_cascade,
            "fallbacks": dict(counters.fallbacks),
            **{k: graphs.get(k, 0) for k in GRAPH_COUNTERS},
            "executors": sorted({e.kernel for e in executors})}


def _plugin_counters(llm: object) -> dict:
    """The one worker's counters; ``{"error": ...}`` rather than losing the timings."""
    try:
        (counters,) = llm.collective_rpc(_worker_counters)  # type: ignore[attr-defined]
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return dict(counters)


DEFAULT_CONFIGS = "flash_attn,flashinfer,cascade,cascade_always,cascade_flash_attn"


def child_command(args: argparse.Namespace, config: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of the child process that runs ``config``'s engine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASCADE_")}
    env.update(CONFIGS[config][1], VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    if args.in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["PYTHONPATH"] = child_path(inherited=env.get("PYTHONPATH"))
    cmd = [*module_command(__spec__.name), "--model", args.model, "--workloads", args.workloads,
           "--child", config, *(["--in-process"] if args.in_process else [])]
    return cmd, env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/models/llama3-8b")
    parser.add_argument("--out", default=str(RESULTS / "gpu"))
    parser.add_argument("--workloads", default=",".join(workloads()))
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--in-process", action="store_true",
                        help="the engine core in the benchmark's process, not vLLM's default "
                             "separate process")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each engine's command and plugin environment; run nothing")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    configs = args.configs.split(",")
    if bad := [c for c in configs if c not in CONFIGS] + [w for w in names
                                                           if w not in workloads()]:
        parser.error(f"unknown {', '.join(bad)}")
    if args.dry_run:
        for config in configs:
            cmd, env = child_command(args, config)
            shown = [f"{k}={env[k]}" for k in sorted(env) if k.startswith("CASCADE_")]
            print(f"# {config}: {CONFIGS[config][0]} {' '.join(shown)} {' '.join(cmd)}")
        return 0
    if args.child:
        print("ROWS" + json.dumps(run_one(args.model, args.child, names, args.in_process)))
        return 0
    rows = []
    # One engine per configuration, each a few minutes: progress on a terminal only.
    for config in tqdm(configs, desc="engines", unit="engine", disable=None):
        cmd, env = child_command(args, config)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        # The engine's whole log beside the results: JIT compilations during inference (vLLM
        # warns about them), graph captures and the plugin's lines explain outliers.
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"e2e-{config}.log").write_text(proc.stdout + proc.stderr)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("ROWS")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
            return 1
        rows += json.loads(line[4:])
        tqdm.write(json.dumps(rows[-1]))
        write_results(out, rows, argv)  # after every engine: a run cut short keeps its rows
    return 0


def write_results(out: Path, rows: list[dict], argv: list[str] | None) -> None:
    """``e2e.json`` and its provenance, ``e2e.meta.json``."""
    import flashinfer
    import torch
    import vllm

    meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "vllm": vllm.__version__, "flashinfer": flashinfer.__version__,
            "torch": torch.__version__, "python": platform.python_version(),
            "command": " ".join([Path(sys.executable).name, "-m", __spec__.name,
                                 *(sys.argv[1:] if argv is None else argv)])}
    (out / "e2e.json").write_text(json.dumps(rows, indent=1))
    (out / "e2e.meta.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    sys.exit(main())
