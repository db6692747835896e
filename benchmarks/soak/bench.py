"""Soak: vLLM with cascade attention under a long, mixed load that preempts and aborts.

Usage (on the GPU machine):
    python3 -m benchmarks.soak.bench --out DIR [--duration 600] [--min-requests 2000] \
        [--concurrency 64]
        [--model DIR] [--num-gpu-blocks 1024] [--seed 0]
    python3 -m benchmarks.soak.bench --dry-run [--min-requests N]   # the request mix only: no GPU

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
(``vllm_cascade_plugin.face.agreement``, the engine tests' rule); the watchdog never fired; the
engine process's device memory that lives after the drive is within 1% of a baseline taken after
its first minute (both read idle, after ``torch.cuda.empty_cache()``: the process's own figure,
so other work on the GPU does not count, less what the allocator still holds free, so its cache
is not mistaken for a leak; ``soak_judge.live_mib``); neither
log has an ERROR line, a traceback or a CUDA error; aborts, preemptions, ``n`` > 1 and cascade
steps all happened; no CUDA-graph capture failed; the plugin caught no error of its own (a
fallback for an error); both phases exited 0.

The model is ``--model``'s weights, or, for a folder with a ``config.json`` only (the default,
``examples/models/llama-tiny``), transformers' random initialisation (std 0.02, bf16, seed 0):
vLLM's dummy weights make attention nearly uniform and would hide a wrong page.

Here: the command line and the orchestrator (the phases' processes, soak.json). The parts:
``soak/mix.py`` (the request mix, the engine settings), ``soak/drive.py`` (the run and replay
phases), ``soak/worker.py`` (the readings taken inside the engine's worker) and ``soak/judge.py``
(the criteria and the verdict).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from benchmarks.common import ROOT, child_path, command_line, module_command, version
from benchmarks.soak.drive import replay_phase, run_phase
from benchmarks.soak.judge import ISSUE_FIELDS, WATCHDOG_S, error_lines, judge
from benchmarks.soak.mix import ENGINE, PLUGIN_ENV, drive_cap_s, dry_run

DEFAULT_MODEL = ROOT / "examples" / "models" / "llama-tiny"
STARTUP_ALLOWANCE_S = 1800.0  # engine start, warm-up, drain and shutdown, on top of the drive
REPLAY_TIMEOUT_S = 1800.0


def build_model(config_dir: Path, out: Path) -> None:
    """tests/gpu/test_engine.py's model: transformers' init (std 0.02) in bf16, seed 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_pretrained(config_dir)).to(torch.bfloat16).save_pretrained(out)


def child_env(plugin: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASCADE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = child_path(inherited=env.get("PYTHONPATH"))
    if plugin:
        # collective_rpc with a function (the plugin's counters live in the engine process).
        env.update(PLUGIN_ENV, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    return env


def run_child(phase: str, argv: list[str], log_path: Path, plugin: bool, timeout_s: float) -> int:
    """One phase in its own process group: everything it prints goes to ``log_path``, its
    ``soak:`` lines to our stdout too; killed with its engine after ``timeout_s``."""
    killed = threading.Event()
    with open(log_path, "w", buffering=1) as log:
        proc = subprocess.Popen([*module_command(__spec__.name), "--phase", phase, *argv],
                                env=child_env(plugin), stdout=subprocess.PIPE,
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
            "vllm": version("vllm"), "flashinfer": version("flashinfer-python"),
            "torch": version("torch"), "python": platform.python_version(),
            "command": command_line(),
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
