"""What the entry point does in each vLLM process: registers the plugin's backend classes with
vLLM's attention-backend registry, by path, when ``CASCADE_ATTENTION`` is on and the environment
is supported; and ``vllm-cascade check``'s run of the same, which also resolves both classes.

Imports only vLLM's backend *registry*: the backend classes are resolved by path, lazily, in the
workers.
"""

from __future__ import annotations

import logging

from .support import BACKENDS

# Under the "vllm" logger so our lines share vLLM's format, level and handlers.
logger = logging.getLogger("vllm.cascade_plugin")

_announced = False


def register_backends() -> None:
    """Override vLLM's FLASH_ATTN and FLASHINFER backends with ours when ``CASCADE_ATTENTION``
    is on (what :func:`vllm_cascade_plugin.register` does).

    Raises :class:`~vllm_cascade_plugin.config.ConfigError` (a ``ValueError``) for a bad knob,
    which aborts vLLM's startup with our message. An unsupported vLLM/FlashInfer leaves the
    plugin off with one warning.
    """
    global _announced
    from ..config import load_config

    config = load_config()
    if not config.enabled:
        return
    from .compat.releases import check_environment

    report = check_environment()
    problems = list(report.problems)
    if report.untested is not None and not config.allow_untested_vllm:
        problems.insert(0, report.untested)
    if problems:
        if not _announced:
            logger.warning(
                "vllm-cascade-plugin stays off (CASCADE_ATTENTION is set): %s. "
                "vLLM runs without cascade attention.", "; ".join(problems))
            _announced = True
        return
    if report.untested is not None:  # allowed: only where no patched method changed
        refuse_changed_methods(report.vllm or "")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, path in BACKENDS.items():
        register_backend(AttentionBackendEnum[name], path)
    if not _announced:
        logger.info(
            "vllm-cascade-plugin: cascade attention on for the FLASH_ATTN and FLASHINFER "
            "backends (vLLM %s, FlashInfer %s): it runs in whichever of them vLLM uses "
            "(FLASH_ATTN, vLLM's default on Hopper, needs FlashAttention 3; FLASHINFER with "
            "--attention-backend FLASHINFER); each worker logs which one carries it.",
            report.vllm, report.flashinfer)
        _announced = True


def refuse_changed_methods(vllm_version: str) -> None:
    """With ``CASCADE_ALLOW_UNTESTED_VLLM`` on a vLLM newer than the tested range: raise
    :class:`~vllm_cascade_plugin.config.ConfigError`, naming the first method, where a vLLM
    method the plugin patches does not read as in the newest tested release; else warn once that
    the plugin runs untested."""
    from ..config import ConfigError
    from .compat.releases import NEWEST_TESTED_VLLM, UNTESTED_VLLM_KNOB, patched_method_changes

    changes = patched_method_changes(NEWEST_TESTED_VLLM)
    if changes:
        more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
        raise ConfigError(
            f"vllm-cascade-plugin: {UNTESTED_VLLM_KNOB} is on, but vLLM {vllm_version} changed a "
            f"method the plugin patches: {changes[0]}{more}. Unset {UNTESTED_VLLM_KNOB} (vLLM then "
            f"runs without the plugin) or install vLLM {NEWEST_TESTED_VLLM}.")
    if not _announced:
        logger.warning(
            "vllm-cascade-plugin runs on vLLM %s, newer than the newest release it is tested "
            "with (%s), because %s is on; every vLLM method it patches reads as in %s.",
            vllm_version, NEWEST_TESTED_VLLM, UNTESTED_VLLM_KNOB, NEWEST_TESTED_VLLM)


def registration_problems() -> list[str]:
    """Run the entry point as vLLM would; check that both backends resolve to our classes."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    register_backends()
    problems = []
    for name, expected in BACKENDS.items():
        backend = AttentionBackendEnum[name]
        path = backend.get_path()
        if path != expected:
            problems.append(f"{name} resolves to {path}, not {expected}")
            continue
        try:
            backend.get_class()
        except Exception as exc:  # report any import failure of the backend module
            problems.append(f"{expected} does not import: {type(exc).__name__}: {exc}")
    return problems
