"""The ``vllm-cascade`` command: ``check``, ``demo`` and ``bench``.

``check`` reports what the plugin finds and what it will do at vLLM's startup (:mod:`.check`),
``demo`` shows
what it does to a shared-prefix workload (with vLLM on a GPU, planned and checked on a CPU), and
``bench`` runs the benchmarks of a source checkout and plots them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..config import ConfigError, load_config
from .check import check
from .check import say as _say

__all__ = ["bench", "check", "demo", "main"]


# -------------------------------------------------------------------------------------- demo


def demo(args: argparse.Namespace) -> int:
    """0 when the plan checks out (CPU), or (GPU) the engines ran and the plugin's run agrees
    with the plugin-off run as closely as two correct kernels do, else 1."""
    import torch

    from . import demo as d
    from . import demo_engine

    config = load_config()  # ConfigError: reported by main()
    policy = args.policy or config.policy
    workload = d.Workload(args.system_tokens, args.documents, args.document_tokens,
                          args.questions, args.question_tokens, args.max_tokens)
    gpu = torch.cuda.is_available() and not args.cpu
    plan = d.plan_demo(workload, args.model, config)
    _say(d.describe_plan(plan, config))
    if not gpu:
        print()
        _say(d.describe_gpu_run(workload, args.model, policy))
        return 0 if plan.check.passed else 1
    print()
    _say([f"vLLM on {torch.cuda.get_device_name()}, {args.model} with random weights "
          "(load_format='dummy', then transformers' init: no download), FLASHINFER, prefix "
          "caching on:"])
    logs = Path(tempfile.mkdtemp(prefix="vllm-cascade-demo-"))
    first, second = demo_engine.BACKENDS
    engines = (("plugin-off", False, first, "plugin off"),
               ("plugin-on", True, first, f"plugin on (CASCADE_POLICY={policy})"),
               ("plugin-off-second-kernel", False, second,
                f"plugin off, {second} (how far two correct kernels differ)"))
    runs = []
    for i, (name, plugin, backend, label) in enumerate(engines, start=1):
        print(f"  [{i}/{len(engines)}] {label}: starting vLLM, a minute or two (log: "
              f"{logs / name}.log)", flush=True)
        try:
            runs.append(demo_engine.run_engine(args.model, workload, plugin=plugin,
                                               policy=policy, log=logs / f"{name}.log",
                                               backend=backend))
        except RuntimeError as exc:
            print(f"  {exc}")
            return 1
    lines, ok = demo_engine.describe_runs(runs[1], runs[0], runs[2])
    _say(lines)
    return 0 if ok and plan.check.passed else 1


# ------------------------------------------------------------------------------------- bench


def _checkout() -> Path | None:
    """The source checkout whose benchmarks/ to run: this package's, else the current folder."""
    for root in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (root / "benchmarks" / "host" / "planner.py").is_file():
            return root
    return None


def bench(args: argparse.Namespace) -> int:
    """Run what of the benchmarks this machine can run; 0 when none of those failed."""
    import torch

    root = _checkout()
    if root is None:
        print("bench runs the benchmarks of a source checkout: clone vllm-cascade-plugin, "
              "`pip install -e .` it and run `vllm-cascade bench` inside the clone.")
        return 1
    out = args.out.resolve()
    gpu = torch.cuda.is_available()
    python = [sys.executable, "-m"]  # the benchmarks' modules, run from the checkout's root
    steps: list[tuple[str, list[str] | str]] = [
        ("planner (CPU)", [*python, "benchmarks.host.planner", "--out", str(out),
                           *(["--quick"] if args.quick else [])])]
    steps.append(("kernels (GPU)", "needs a CUDA GPU" if not gpu
                  else [*python, "benchmarks.kernels.bench", "--out", str(out),
                        *(["--quick"] if args.quick else [])]))
    model = root / "examples" / "models" / args.model
    steps.append(("end to end, vLLM (GPU)", "needs a CUDA GPU" if not gpu else
                  [*python, "benchmarks.e2e.bench", "--out", str(out), "--model",
                   str(model if model.is_dir() else args.model)]))
    steps.append(("plots (PNG)", "matplotlib is not installed (pip install matplotlib)"
                  if importlib.util.find_spec("matplotlib") is None
                  else [*python, "benchmarks.plot_results", str(out)]))
    failed = []
    for i, (name, command) in enumerate(steps, start=1):
        if isinstance(command, str):
            print(f"[{i}/{len(steps)}] {name}: skipped, {command}")
            continue
        print(f"[{i}/{len(steps)}] {name}: {' '.join(command[1:])}", flush=True)
        if subprocess.run(command, cwd=root, check=False).returncode != 0:
            failed.append(name)
    print(f"Results in {out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


# -------------------------------------------------------------------------------------- main


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _model(text: str) -> str:
    from .demo import model_config

    try:
        model_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _parser() -> argparse.ArgumentParser:
    from .demo import MODELS, Workload

    parser = argparse.ArgumentParser(
        prog="vllm-cascade",
        description="Cascade attention for vLLM's FlashAttention and FlashInfer backends.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check_parser = commands.add_parser(
        "check", help="report the environment and what the plugin will do",
        description="What the plugin finds here and will do at vLLM's startup. Given the "
        "arguments vLLM will be started with (as for vllm serve: MODEL --kv-cache-dtype ...), "
        "also whether they leave the cascade anything to do. Exit status: 0 it will run here; "
        "1 it will not (the report says why); 3 it is set up, but this machine has no CUDA "
        "GPU.")
    check_parser.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="VLLM_ARGS",
                              help="vllm serve's arguments (the model and any flags)")

    demo_parser = commands.add_parser(
        "demo", help="show the plugin on a shared-prefix workload (vLLM on a GPU, else the plan)",
        description="A system prompt, documents, and questions about each document. On a GPU: "
        "vLLM with the plugin off and on, throughput and logprob agreement. Without a GPU: the "
        "cascade plan of one decode step, its predicted saving and a numerical check.")
    default = Workload()
    demo_parser.add_argument("--model", type=_model, default="llama3-8b", metavar="NAME|DIR",
                             help=f"{' or '.join(MODELS)} (shipped configs, dummy weights) or a "
                             "folder with a config.json (default: %(default)s)")
    demo_parser.add_argument("--policy", choices=("auto", "always"),
                             help="CASCADE_POLICY of the plugin-on engine (default: the "
                             "environment's, else auto)")
    demo_parser.add_argument("--cpu", action="store_true", help="plan on the CPU even on a GPU")
    for flag, help_text in (("--system-tokens", "system prompt length"),
                            ("--documents", "documents"),
                            ("--document-tokens", "document length"),
                            ("--questions", "questions per document"),
                            ("--question-tokens", "question length"),
                            ("--max-tokens", "tokens generated per request")):
        field = flag[2:].replace("-", "_")
        demo_parser.add_argument(flag, type=_positive, default=getattr(default, field),
                                 metavar="N", help=f"{help_text} (default: %(default)s)")

    bench_parser = commands.add_parser(
        "bench", help="run the benchmarks of a source checkout and plot them",
        description="Runs the planner, kernel and end-to-end benchmarks of benchmarks/ (GPU-only "
        "ones are skipped without a GPU), "
        "writes their JSON and renders PNG plots with matplotlib.")
    bench_parser.add_argument("--out", type=Path, default=Path("vllm-cascade-bench"),
                              help="folder for the JSON and PNG files (default: %(default)s)")
    bench_parser.add_argument("--model", default="llama3-8b", metavar="NAME|DIR",
                              help="model of the end-to-end benchmark (default: %(default)s)")
    bench_parser.add_argument("--quick", action="store_true", help="a few runs only (smoke test)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if argv[:1] == ["check"] and not {"-h", "--help"} & set(argv[1:2]):
        # vLLM's arguments as given (argparse would take their flags for check's own).
        vllm_args = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        argv = ["check"]
    args = _parser().parse_args(argv)
    if args.command == "check":
        # vLLM's own log lines would interleave with the report, which names every problem. The
        # level is read when vLLM is first imported; the caller's environment is left as it was.
        saved = os.environ.get("VLLM_LOGGING_LEVEL")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        try:
            return check(vllm_args)
        finally:
            if saved is None:
                del os.environ["VLLM_LOGGING_LEVEL"]
    try:
        return demo(args) if args.command == "demo" else bench(args)
    except ConfigError as exc:
        print(f"vllm-cascade {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
