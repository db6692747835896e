"""The ``vllm-cascade`` command: ``check``, ``demo`` and ``bench``.

``check`` reports what the plugin finds and what it will do at vLLM's startup, ``demo`` shows
what it does to a shared-prefix workload (with vLLM on a GPU, planned and checked on a CPU), and
``bench`` runs the benchmarks of a source checkout and plots them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path

from . import BACKEND_PATH
from .compat import GPU_VERIFIED_VLLM, SUPPORTED_FLASHINFER, SUPPORTED_VLLM, check_environment
from .config import KNOBS, CascadeConfig, ConfigError, Knob, load_config


def _say(lines: Iterable[str], width: int = 100) -> None:
    """Print report lines, wrapping long ones under their own indentation."""
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()))
        print(textwrap.fill(line, width, subsequent_indent=indent + "  ", break_on_hyphens=False))


# ------------------------------------------------------------------------------------- check


def _entry_point_found() -> bool:
    return any(ep.value == "vllm_cascade_plugin:register"
               for ep in importlib.metadata.entry_points(group="vllm.general_plugins"))


def _plugin_filtered_out() -> bool:
    # vLLM loads only the entry points named in VLLM_PLUGINS when it is set ("" loads none).
    allowed = os.environ.get("VLLM_PLUGINS")
    return allowed is not None and "cascade" not in allowed.split(",")


def _torch_line() -> str:
    import torch
    from packaging.requirements import Requirement

    wanted = next((Requirement(r).specifier for r in
                   importlib.metadata.requires("vllm-cascade-plugin") or []
                   if Requirement(r).name == "torch"), None)
    ok = wanted is None or wanted.contains(torch.__version__.split("+")[0])
    return f"{torch.__version__} ({'supported' if ok else 'NOT supported'}: {wanted})"


def _gpu_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none (vLLM's FlashInfer backend needs a CUDA GPU)"
    major, minor = torch.cuda.get_device_capability()
    return (f"{torch.cuda.get_device_name()} (sm_{major}{minor}), CUDA {torch.version.cuda}, "
            f"{torch.cuda.device_count()} device(s); GPU-verified on NVIDIA H200 (sm_90)")


def _knob_value(knob: Knob, raw: str | None) -> str:
    """The value the plugin reads from ``raw``, or why it cannot (each knob on its own, so one
    bad value does not hide the others)."""
    if raw is None or raw.strip() == "":
        return str(knob.default)
    try:
        return str(knob.parse(raw))
    except ValueError:
        return f"INVALID (expected {knob.accepted})"


def check() -> int:
    """Print the environment report; 0 when vLLM will start with the plugin on, else 1."""
    reasons: list[str] = []
    report = check_environment()
    python = importlib.metadata.metadata("vllm-cascade-plugin")["Requires-Python"]
    _say([f"Python      {platform.python_version()} (supported: {python}; {sys.executable})",
          f"torch       {_torch_line()}",
          f"GPU         {_gpu_line()}",
          f"vLLM        {report.vllm or 'not installed'} (supported {SUPPORTED_VLLM}; "
          f"GPU-verified {GPU_VERIFIED_VLLM})",
          f"FlashInfer  {report.flashinfer or 'not installed'} (supported "
          f"{SUPPORTED_FLASHINFER})"])
    reasons += report.problems

    print("Settings (environment variable, raw value -> value used):")
    config: CascadeConfig | None = None
    refused: str | None = None
    try:
        config = load_config()
    except ConfigError as exc:
        refused = str(exc)
    for knob in KNOBS:
        raw = os.environ.get(knob.env)
        _say([f"  {knob.env:<26} {repr(raw) if raw is not None else 'unset':<10} -> "
              f"{_knob_value(knob, raw)}"])
    if refused is not None:  # register() raises the same error in every vLLM process
        _say(["At startup: vLLM refuses to start (the plugin's entry point raises this error "
              "before any model loads):", f"  - {refused}"])
        return 1

    found = _entry_point_found()
    print(f"Entry point vllm.general_plugins:cascade {'found' if found else 'NOT found'}")
    if not found:
        reasons.append("the entry point is not installed: pip install vllm-cascade-plugin")
    if _plugin_filtered_out():
        reasons.append("VLLM_PLUGINS does not list 'cascade', so vLLM will not load the plugin")
    if config is not None and not config.enabled:
        reasons.append("CASCADE_ATTENTION is off: set CASCADE_ATTENTION=1")
    if not reasons:
        reasons += _registration_problems()
    if reasons:
        print("At startup: the plugin stays OFF and vLLM runs unchanged, because:")
        _say(f"  - {reason}" for reason in reasons)
        return 1

    assert config is not None
    import torch

    interval = (f"every {config.log_interval_s:g} s" if config.log_interval_s > 0
                else "never (CASCADE_LOG_INTERVAL=0)")
    metrics = ("PROMETHEUS_MULTIPROC_DIR is set" if "PROMETHEUS_MULTIPROC_DIR" in os.environ
               else "only with PROMETHEUS_MULTIPROC_DIR set, see the README")
    _say([
        f"At startup: every vLLM process registers {BACKEND_PATH} for the FLASHINFER backend "
        "(checked here by running the entry point and importing the class).",
        "  vLLM uses it only with --attention-backend FLASHINFER (on Hopper vLLM picks "
        "FLASH_ATTN by default).",
        f"  CASCADE_POLICY={config.policy}: " + (
            "each step with a shared prefix runs as cascade where the cost model predicts a win, "
            "else flat." if config.policy == "auto"
            else "every step with a shared prefix runs as cascade."),
        f"  Each worker logs its cascade statistics {interval}; Prometheus metrics reach "
        f"/metrics {metrics}.",
    ])
    if not torch.cuda.is_available():
        _say(["  No GPU here: on a GPU machine the engine plans every step and runs shared "
              "prefixes as cascade attention (see it: vllm-cascade demo)."])
    return 0


def _registration_problems() -> list[str]:
    """Run the entry point as vLLM would and check that FLASHINFER resolves to our class."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from . import register

    register()
    path = AttentionBackendEnum.FLASHINFER.get_path()
    if path != BACKEND_PATH:
        return [f"FLASHINFER resolves to {path}, not {BACKEND_PATH}"]
    try:
        AttentionBackendEnum.FLASHINFER.get_class()
    except Exception as exc:  # report any import failure of the backend module
        return [f"{BACKEND_PATH} does not import: {type(exc).__name__}: {exc}"]
    return []


# -------------------------------------------------------------------------------------- demo


def demo(args: argparse.Namespace) -> int:
    """0 when the plan checks out (CPU) or both engines ran and agree (GPU), else 1."""
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
    runs = []
    for i, plugin in enumerate((False, True), start=1):
        name = "plugin-on" if plugin else "plugin-off"
        label = f"plugin on (CASCADE_POLICY={policy})" if plugin else "plugin off"
        print(f"  [{i}/2] {label}: starting vLLM, a minute or two (log: {logs / name}.log)",
              flush=True)
        try:
            runs.append(demo_engine.run_engine(args.model, workload, plugin=plugin,
                                               policy=policy, log=logs / f"{name}.log"))
        except RuntimeError as exc:
            print(f"  {exc}")
            return 1
    lines, ok = demo_engine.describe_runs(runs[1], runs[0])
    _say(lines)
    return 0 if ok and plan.check.passed else 1


# ------------------------------------------------------------------------------------- bench


def _checkout() -> Path | None:
    """The source checkout whose benchmarks/ to run: this package's, else the current folder."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "benchmarks" / "planner_bench.py").is_file():
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
    python = [sys.executable]
    steps: list[tuple[str, list[str] | str]] = [
        ("planner (CPU)", [*python, "benchmarks/planner_bench.py", "--out", str(out),
                           *(["--quick"] if args.quick else [])])]
    kernel = root / "benchmarks" / "kernel_bench.py"
    steps.append(("kernels (GPU)",
                  "benchmarks/kernel_bench.py does not exist yet" if not kernel.is_file()
                  else "needs a CUDA GPU" if not gpu
                  else [*python, str(kernel), "--out", str(out),
                        *(["--quick"] if args.quick else [])]))
    model = root / "examples" / "models" / args.model
    steps.append(("end to end, vLLM (GPU)", "needs a CUDA GPU" if not gpu else
                  [*python, "benchmarks/e2e_bench.py", "--out", str(out), "--model",
                   str(model if model.is_dir() else args.model)]))
    steps.append(("plots (PNG)", "matplotlib is not installed (pip install matplotlib)"
                  if importlib.util.find_spec("matplotlib") is None
                  else [*python, "benchmarks/plot_results.py", str(out)]))
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
        prog="vllm-cascade", description="Cascade attention for vLLM's FlashInfer backend.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("check", help="report the environment and what the plugin will do")

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
        description="Runs benchmarks/*_bench.py (GPU-only ones are skipped without a GPU), "
        "writes their JSON and renders PNG plots with matplotlib.")
    bench_parser.add_argument("--out", type=Path, default=Path("vllm-cascade-bench"),
                              help="folder for the JSON and PNG files (default: %(default)s)")
    bench_parser.add_argument("--model", default="llama3-8b", metavar="NAME|DIR",
                              help="model of the end-to-end benchmark (default: %(default)s)")
    bench_parser.add_argument("--quick", action="store_true", help="a few runs only (smoke test)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check":
        # vLLM's own log lines would interleave with the report, which names every problem. The
        # level is read when vLLM is first imported; the caller's environment is left as it was.
        saved = os.environ.get("VLLM_LOGGING_LEVEL")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        try:
            return check()
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
