"""The kernels vLLM ships that the FA3 executor runs: its FlashAttention 3 build and its
attention-state merge.

The one module outside :mod:`vllm_cascade_plugin.integration` that imports vLLM, and only these
two kernel modules (``tests/execution/test_execution_layer.py`` holds it to that), lazily: where
they live is a vLLM-release difference kept here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def fa3_kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """vLLM's bundled FlashAttention-3 and its attention-state merge, for the FA3 executor.

    Returns ``(flash_attn_varlen_func, merge_attn_states)``: ``vllm.vllm_flash_attn`` and
    ``vllm.v1.attention.ops.merge_attn_states`` in 0.26-0.33 (LSE ``[heads, tokens]``, natural
    log). Raises RuntimeError with the reason when this vLLM build or GPU cannot run FA3 (only
    Hopper can; vLLM wheels for other platforms may lack the extension).
    """
    try:
        from vllm.v1.attention.ops.merge_attn_states import merge_attn_states
        from vllm.vllm_flash_attn import (
            fa_version_unsupported_reason,
            flash_attn_varlen_func,
            is_fa_version_supported,
        )
    except ImportError as exc:
        raise RuntimeError(f"vLLM's FlashAttention cannot be imported ({exc})") from None
    try:
        supported = is_fa_version_supported(3)
        reason = None if supported else fa_version_unsupported_reason(3)
    except Exception as exc:  # e.g. no CUDA device: the check queries it
        supported, reason = False, f"{type(exc).__name__}: {exc}"
    if not supported:
        raise RuntimeError(f"FlashAttention 3 is not supported here ({reason})")
    return flash_attn_varlen_func, merge_attn_states


def fa3_unsupported_reason(kv_layout: str) -> str | None:
    """Why the FA3 executor cannot run here, or None."""
    if kv_layout != "NHD":
        return f"the KV cache layout is {kv_layout}; FlashAttention reads NHD"
    try:
        fa3_kernels()
    except RuntimeError as exc:
        return str(exc)
    return None
