"""``vllm-cascade check [VLLM_ARGS...]``: what the plugin finds here and will do at vLLM's start.

Exit status (:data:`EXIT_STATUS`, also the report's last line): 0 when vLLM will start here with
the plugin on and, with the arguments vLLM will be started with, able to run cascade; 1 when it
will not, with every reason named; 3 when nothing but the GPU is missing: the plugin is set up,
but this machine has no CUDA GPU, without which vLLM's FLASH_ATTN and FLASHINFER backends (and
so the cascade) do not run. 2 is a usage error (argparse's).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import textwrap
from collections.abc import Iterable, Sequence

from ..config import KNOBS, CascadeConfig, ConfigError, Knob, load_config
from ..integration import support
from ..integration.compat.releases import (
    GPU_VERIFIED_VLLM,
    SUPPORTED_FLASHINFER,
    SUPPORTED_VLLM,
    check_environment,
)

WILL_RUN, WILL_NOT_RUN, NO_GPU = 0, 1, 3
EXIT_STATUS = {
    WILL_RUN: "the plugin will run here.",
    WILL_NOT_RUN: "the plugin will not run (the reasons are above).",
    NO_GPU: "the plugin is set up, but this machine has no CUDA GPU, which vLLM's FLASH_ATTN and "
            "FLASHINFER backends, and so the cascade, need; on a machine with one it will run.",
}


def say(lines: Iterable[str], width: int = 100) -> None:
    """Print report lines, wrapping long ones under their own indentation."""
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()))
        print(textwrap.fill(line, width, subsequent_indent=indent + "  ", break_on_hyphens=False))


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


def gpu() -> str | None:
    """The CUDA GPU vLLM would run on, described; None when there is none."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return (f"{torch.cuda.get_device_name()} (sm_{major}{minor}), CUDA {torch.version.cuda}, "
            f"{torch.cuda.device_count()} device(s)")


def _gpu_line(found: str | None) -> str:
    if found is None:
        return "none (vLLM's FlashAttention and FlashInfer backends need a CUDA GPU)"
    return f"{found}; GPU-verified on NVIDIA H200 (sm_90)"


def _knob_value(knob: Knob, raw: str | None) -> str:
    """The value the plugin reads from ``raw``, or why it cannot (each knob on its own, so one
    bad value does not hide the others)."""
    if raw is None or raw.strip() == "":
        return str(knob.default)
    try:
        return str(knob.parse(raw))
    except ValueError:
        return f"INVALID (expected {knob.accepted})"


def _fa3_line(found: str | None) -> str:
    """Whether FlashAttention 3 runs here: the FLASH_ATTN backend's cascade needs it."""
    if found is None:
        return "unknown without a GPU (it needs Hopper, sm_90)"
    from ..execution.vllm_kernels import fa3_kernels

    try:
        fa3_kernels()
    except RuntimeError as exc:
        return f"no: {exc}; FLASH_ATTN steps run flat, FLASHINFER's cascade uses FlashInfer"
    return "yes"


def check(vllm_args: Sequence[str] = ()) -> int:
    """Print the environment report and, last, what its exit status means; the status is
    :data:`WILL_RUN` when vLLM will start here with the plugin on (and, given ``vllm_args``, can
    run cascade with them), :data:`NO_GPU` when only the CUDA GPU is missing, else
    :data:`WILL_NOT_RUN`."""
    found = gpu()
    status = _report(list(vllm_args), found)
    if status == WILL_RUN and found is None:
        status = NO_GPU
    say([f"Exit status {status}: {EXIT_STATUS[status]}"])
    return status


def _report(vllm_args: list[str], found_gpu: str | None) -> int:
    """The report but its last line; :data:`WILL_RUN` or :data:`WILL_NOT_RUN`."""
    reasons: list[str] = []
    report = check_environment()
    python = importlib.metadata.metadata("vllm-cascade-plugin")["Requires-Python"]
    say([f"Python      {platform.python_version()} (supported: {python}; {sys.executable})",
         f"torch       {_torch_line()}",
         f"GPU         {_gpu_line(found_gpu)}",
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
        if report.untested is not None and config.allow_untested_vllm:
            from ..integration.registration import refuse_changed_methods

            refuse_changed_methods(report.vllm or "")
    except ConfigError as exc:
        refused = str(exc)
    if report.untested is not None and not (config is not None and config.allow_untested_vllm):
        reasons.insert(0, report.untested)
    for knob in KNOBS:
        raw = os.environ.get(knob.env)
        say([f"  {knob.env:<26} {repr(raw) if raw is not None else 'unset':<10} -> "
             f"{_knob_value(knob, raw)}"])
    if refused is not None:  # register() raises the same error in every vLLM process
        say(["At startup: vLLM refuses to start (the plugin's entry point raises this error "
             "before any model loads):", f"  - {refused}"])
        return WILL_NOT_RUN

    entry_point = _entry_point_found()
    print(f"Entry point vllm.general_plugins:cascade {'found' if entry_point else 'NOT found'}")
    if not entry_point:
        reasons.append("the entry point is not installed: pip install vllm-cascade-plugin")
    if _plugin_filtered_out():
        reasons.append("VLLM_PLUGINS does not list 'cascade', so vLLM will not load the plugin")
    if config is not None and not config.enabled:
        reasons.append("CASCADE_ATTENTION is off: set CASCADE_ATTENTION=1")
    if not reasons:
        from ..integration.registration import registration_problems

        reasons += registration_problems()
    if reasons:
        print("At startup: the plugin stays OFF and vLLM runs unchanged, because:")
        say(f"  - {reason}" for reason in reasons)
        return WILL_NOT_RUN
    assert config is not None
    _startup_lines(config, found_gpu)
    return _engine_arguments(vllm_args, config)


def _startup_lines(config: CascadeConfig, found_gpu: str | None) -> None:
    interval = (f"every {config.log_interval_s:g} s" if config.log_interval_s > 0
                else "never (CASCADE_LOG_INTERVAL=0)")
    metrics = ("PROMETHEUS_MULTIPROC_DIR is set" if "PROMETHEUS_MULTIPROC_DIR" in os.environ
               else "only with PROMETHEUS_MULTIPROC_DIR set, see the README")
    fa, fi = support.BACKENDS["FLASH_ATTN"], support.BACKENDS["FLASHINFER"]
    say([
        f"At startup: every vLLM process registers {fa} for the FLASH_ATTN backend and {fi} "
        "for the FLASHINFER backend (checked here by running the entry point and importing "
        "both classes).",
        "  The cascade runs in whichever of the two vLLM uses: FLASH_ATTN, vLLM's default on "
        "Hopper (its cascade needs FlashAttention 3), or FLASHINFER with --attention-backend "
        "FLASHINFER (FlashAttention 3 kernels on Hopper, FlashInfer's elsewhere). Each worker "
        "logs which backend carries it. Other backends run as without the plugin.",
        f"  FlashAttention 3 here: {_fa3_line(found_gpu)}.",
        f"  CASCADE_POLICY={config.policy}: " + (
            "each step with a shared prefix runs as cascade where the cost model predicts a win, "
            "else flat." if config.policy == "auto"
            else "every step with a shared prefix runs as cascade."),
        f"  Each worker logs its cascade statistics {interval}; Prometheus metrics reach "
        f"/metrics {metrics}.",
        "  Runs flat, with one line at startup saying why: prefix caching off (nothing is "
        "shared: the plugin has nothing to do), a quantised KV cache other than FP8 e4m3 with "
        "per-layer scales, speculative decoding "
        f"other than {' or '.join(support.SPECULATIVE_METHODS)} or with asynchronous "
        "scheduling, and the models listed in docs/compatibility.md. Check the arguments vLLM "
        "will start with: vllm-cascade check MODEL --kv-cache-dtype ... (as for vllm serve).",
        "  An FP8 KV cache (e4m3, per-layer scales) runs cascade while CASCADE_FP8_KV is on "
        f"(the default): CASCADE_FP8_KV={'on' if config.fp8_kv else 'off'}.",
        "  Off unless asked for (not verified on a GPU with this release, or served slower "
        "than flat): tensor parallelism above 1, suffix speculative decoding, the "
        "attention layers beside recurrent ones (Mamba hybrids) under the hybrid KV-cache "
        "manager, and attention sinks (gpt-oss); and, host time only, the V1 runner's steps "
        "known to share nothing without their rows being read (Model Runner V2's are on): "
        f"CASCADE_UNVERIFIED={'on' if config.unverified else 'off'}.",
    ])


def _engine_arguments(argv: list[str], config: CascadeConfig | None = None) -> int:
    """What the plugin does with the vLLM arguments ``argv`` under ``config``; :data:`WILL_RUN`
    unless they keep it flat."""
    config = config or CascadeConfig()
    if not argv:
        return WILL_RUN
    try:
        values = support.read_engine_arguments(argv)
    except ValueError as exc:
        say([f"With the vLLM arguments given: cannot read them ({exc})."])
        return WILL_NOT_RUN
    if values["async_scheduling"] is None and values["speculative_config"] is not None:
        from ..integration.compat.releases import async_scheduling_by_default

        values["async_scheduling"] = async_scheduling_by_default()
    reasons = support.engine_argument_reasons(values, config.fp8_kv, config.unverified)
    if not argv[0].startswith("-"):  # the model, as vllm serve takes it
        from .families import model_lines

        lines, runs = model_lines(argv[0], config.unverified)
        say(lines)
        if runs is False:
            reasons.append("no attention layer of this model runs cascade (above)")
    backend = values["attention_backend"]
    where = (f"--attention-backend {backend}" if backend is not None
             else "no --attention-backend, so vLLM picks it: FLASH_ATTN on Hopper")
    if reasons:
        say([f"With the vLLM arguments given ({where}), every step runs vLLM's flat attention "
             "and the plugin has nothing to do, because:", *(f"  - {r}" for r in reasons)])
        return WILL_NOT_RUN
    say([f"With the vLLM arguments given ({where}): nothing keeps the cascade off; steps "
         "whose requests share KV pages can run as cascade."])
    return WILL_RUN
