"""Cascade (shared-prefix) attention for vLLM's FlashInfer backend, as a vLLM plugin.

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point in every process it
starts (API server, engine core, workers), possibly more than once per process.
"""

from __future__ import annotations

import logging

__all__ = ["BACKEND_PATH", "register"]

BACKEND_PATH = "vllm_cascade_plugin.backend.CascadeFlashInferBackend"

# Under the "vllm" logger so our lines share vLLM's format, level and handlers.
logger = logging.getLogger("vllm.cascade_plugin")

_announced = False


def register() -> None:
    """Entry point: override vLLM's FLASHINFER backend with ours when ``CASCADE_ATTENTION`` is on.

    Raises :class:`~vllm_cascade_plugin.config.ConfigError` (a ``ValueError``) for a bad knob, which
    aborts vLLM's startup with our message. An unsupported vLLM/FlashInfer leaves the plugin off
    with one warning. Imports only the backend *registry*: the backend class is resolved by path,
    lazily, in the workers.
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

    register_backend(AttentionBackendEnum.FLASHINFER, BACKEND_PATH)
    if not _announced:
        logger.info(
            "vllm-cascade-plugin: cascade attention on for the FLASHINFER backend "
            "(vLLM %s, FlashInfer %s); select it with --attention-backend FLASHINFER.",
            report.vllm, report.flashinfer)
        _announced = True
