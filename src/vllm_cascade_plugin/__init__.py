"""Cascade (shared-prefix) attention for vLLM's FlashAttention and FlashInfer backends, as a
vLLM plugin.

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point in every process it
starts (API server, engine core, workers), possibly more than once per process.
"""

from __future__ import annotations

import logging

from .support import BACKENDS

__all__ = ["BACKENDS", "BACKEND_PATH", "FLASH_ATTN_BACKEND_PATH", "register"]

BACKEND_PATH = BACKENDS["FLASHINFER"]
FLASH_ATTN_BACKEND_PATH = BACKENDS["FLASH_ATTN"]

# Under the "vllm" logger so our lines share vLLM's format, level and handlers.
logger = logging.getLogger("vllm.cascade_plugin")

_announced = False


def register() -> None:
    """Entry point: override vLLM's FLASH_ATTN and FLASHINFER backends with ours when
    ``CASCADE_ATTENTION`` is on.

    Raises :class:`~vllm_cascade_plugin.config.ConfigError` (a ``ValueError``) for a bad knob, which
    aborts vLLM's startup with our message. An unsupported vLLM/FlashInfer leaves the plugin off
    with one warning. Imports only the backend *registry*: the backend classes are resolved by
    path, lazily, in the workers.
    """
    global _announced
    from .config import load_config

    if not load_config().enabled:
        return
    from .compat import check_environment

    report = check_environment()
    if not report.supported:
        if not _announced:
            logger.warning(
                "vllm-cascade-plugin stays off (CASCADE_ATTENTION is set): %s. "
                "vLLM runs without cascade attention.", "; ".join(report.problems))
            _announced = True
        return
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
