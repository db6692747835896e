"""The ``vllm-cascade`` command: ``check`` reports what the plugin finds and what it will do."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from collections.abc import Sequence

from . import BACKEND_PATH
from .compat import GPU_VERIFIED_VLLM, SUPPORTED_FLASHINFER, SUPPORTED_VLLM, check_environment
from .config import KNOBS, ConfigError, load_config


def _entry_point_found() -> bool:
    return any(ep.value == "vllm_cascade_plugin:register"
               for ep in importlib.metadata.entry_points(group="vllm.general_plugins"))


def _plugin_filtered_out() -> bool:
    # vLLM loads only the entry points named in VLLM_PLUGINS when it is set ("" loads none).
    allowed = os.environ.get("VLLM_PLUGINS")
    return allowed is not None and "cascade" not in allowed.split(",")


def _gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__}, no CUDA GPU"
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}"


def check() -> int:
    """Print the environment report; 0 when vLLM will run with cascade attention, else 1."""
    reasons: list[str] = []
    print(f"Python      {platform.python_version()} ({sys.executable})")
    print(f"GPU         {_gpu()}")
    report = check_environment()
    print(f"vLLM        {report.vllm or 'not installed'} (supported {SUPPORTED_VLLM}; "
          f"GPU-verified {GPU_VERIFIED_VLLM})")
    print(f"FlashInfer  {report.flashinfer or 'not installed'} (supported {SUPPORTED_FLASHINFER})")
    for problem in report.problems:
        print(f"  problem: {problem}")
        reasons.append(problem)

    print("Settings:")
    try:
        config = load_config()
    except ConfigError as exc:
        print(f"  {exc}")
        reasons.append(str(exc))
        config = None
    for knob in KNOBS:
        raw = os.environ.get(knob.env)
        shown = repr(raw) if raw is not None else "unset"
        value = getattr(config, knob.field) if config else "?"
        print(f"  {knob.env:<26} {shown:<10} -> {value}")

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
        print("At startup: the plugin stays OFF; vLLM runs unchanged. Why:")
        for reason in reasons:
            print(f"  - {reason}")
        return 1
    print(f"At startup: FLASHINFER resolves to {BACKEND_PATH}; start vLLM with "
          "--attention-backend FLASHINFER to use it.")
    import torch

    if not torch.cuda.is_available():
        print("No GPU here: registration and class resolution were checked for real; on a GPU "
              "the engine would plan every step and run shared prefixes as cascade attention.")
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-cascade", description="Cascade attention for vLLM's FlashInfer backend.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("check", help="report the environment and what the plugin will do")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check()
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
