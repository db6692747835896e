"""Cascade (shared-prefix) attention for vLLM's FlashAttention and FlashInfer backends, as a
vLLM plugin.

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point in every process it
starts (API server, engine core, workers), possibly more than once per process. The package's
parts, bottom to top (``docs/where-changes-go.md``): ``config`` and ``stats``; ``planning``
(numpy only); the step session ``step``; ``graphs`` and ``execution`` (GPU); ``integration``
(the only code that touches vLLM's internals); ``face`` (the ``vllm-cascade`` command).
"""

from __future__ import annotations

from .integration.support import BACKENDS

__all__ = ["BACKENDS", "BACKEND_PATH", "FLASH_ATTN_BACKEND_PATH", "register"]

BACKEND_PATH = BACKENDS["FLASHINFER"]
FLASH_ATTN_BACKEND_PATH = BACKENDS["FLASH_ATTN"]


def register() -> None:
    """Entry point: override vLLM's FLASH_ATTN and FLASHINFER backends with ours when
    ``CASCADE_ATTENTION`` is on (idempotent; imports only vLLM's backend registry).

    Raises :class:`~vllm_cascade_plugin.config.ConfigError` (a ``ValueError``) for a bad knob, which
    aborts vLLM's startup with our message. An unsupported vLLM/FlashInfer leaves the plugin off
    with one warning.
    """
    from .integration.registration import register_backends

    register_backends()
