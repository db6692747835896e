"""Engine settings under which the cascade cannot help or is not verified, and why.

Plain values in, one sentence out (None: no objection). The metadata builders ask at startup in
every vLLM worker (:func:`.builder.unsupported_reason`, which logs the answer once and keeps
those layers flat) and ``vllm-cascade check`` asks before vLLM starts, so both say the same
thing. Imports nothing heavy.
"""

from __future__ import annotations

import json
from typing import Any

# The two vLLM backends the plugin extends, and where each one's subclasses live.
BACKENDS = {
    "FLASH_ATTN": "vllm_cascade_plugin.integration.flash_attn_backend.CascadeFlashAttentionBackend",
    "FLASHINFER": "vllm_cascade_plugin.integration.flashinfer_backend.CascadeFlashInferBackend",
}

PREFIX_CACHING_OFF = (
    "prefix caching is off, so no two requests share KV pages and the plugin has nothing to do "
    "(vLLM's default turns it on; so does --enable-prefix-caching)")

UNQUANTISED_KV = ("auto", "bfloat16", "float16")

# Speculative methods whose verification steps run cascade: they draft on the host, without a
# model of their own. A drafter with attention layers (EAGLE, MTP, draft models) runs them
# through the same backend, on batches and under CUDA graphs of its own that no plan was made
# for; that is not verified.
SPECULATIVE_METHODS = ("ngram", "suffix")
# Of those, the ones run on a GPU with this release; the others need CASCADE_UNVERIFIED.
GPU_VERIFIED_SPECULATIVE = ("ngram",)

UNVERIFIED = "CASCADE_UNVERIFIED=1 runs the cascade on it"

ASYNC_SPECULATIVE = (
    "speculative decoding with asynchronous scheduling: the host then knows only upper bounds of "
    "each request's sequence length (how many draft tokens were accepted is known on the GPU), "
    "and a plan made from them would read rejected tokens (start vLLM with "
    "--no-async-scheduling)")


# The FP8 layouts the cascade can read (e4m3 with per-layer scales), with CASCADE_FP8_KV.
FP8_KV = ("fp8", "fp8_e4m3")


def kv_cache_dtype_reason(kv_cache_dtype: str | None, fp8_kv: bool = False) -> str | None:
    """Why a KV cache of ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``) runs flat, or None;
    ``fp8_kv``: ``CASCADE_FP8_KV`` is on."""
    if kv_cache_dtype is None or str(kv_cache_dtype) in UNQUANTISED_KV:
        return None
    if str(kv_cache_dtype) in FP8_KV:
        if fp8_kv:
            return None
        return (f"FP8 KV cache (kv_cache_dtype={kv_cache_dtype}) with CASCADE_FP8_KV=0: runs "
                "flat; unset it (or CASCADE_FP8_KV=1) to run the cascade on it (e4m3 with "
                "per-layer scales)")
    return (f"quantised KV cache (kv_cache_dtype={kv_cache_dtype}): the cascade reads "
            f"{' or '.join(FP8_KV)} (e4m3) with per-layer scales only (CASCADE_FP8_KV); "
            "this layout is not supported")


def speculative_reason(method: str | None, async_scheduling: bool | None,
                       unverified: bool = False) -> str | None:
    """Why speculative decoding with ``method`` keeps every step flat, or None (verification
    steps, 1 + k query tokens per request, run cascade like any other step). ``unverified``:
    ``CASCADE_UNVERIFIED`` is on."""
    if async_scheduling:
        return ASYNC_SPECULATIVE
    if method not in SPECULATIVE_METHODS:
        return (f"speculative decoding with method {method or '(from the draft model)'}: "
                f"cascade serves {' and '.join(SPECULATIVE_METHODS)} only, whose drafting runs "
                "no attention (a drafter's own attention steps are not planned)")
    if method not in GPU_VERIFIED_SPECULATIVE and not unverified:
        return (f"speculative decoding with method {method}: not verified on a GPU with this "
                f"release; {UNVERIFIED}")
    return None


def parallel_reason(tensor_parallel_size: int | None, unverified: bool = False) -> str | None:
    """Why tensor parallelism keeps every step flat, or None. ``unverified``:
    ``CASCADE_UNVERIFIED`` is on."""
    if (tensor_parallel_size or 1) > 1 and not unverified:
        return (f"tensor parallelism (tensor_parallel_size={tensor_parallel_size}): not "
                f"verified on a GPU with this release; {UNVERIFIED}")
    return None


def sinks_reason(has_sinks: bool, unverified: bool = False) -> str | None:
    """Why layers with attention sinks (gpt-oss) run flat, or None. Their cascade applies the
    sink once to the merged output (``execution.common.apply_sinks``), checked per kernel
    against softmax attention with sinks; no engine has served them on a GPU yet."""
    if has_sinks and not unverified:
        return ("attention sinks: not verified in an engine on a GPU with this release; "
                f"{UNVERIFIED}")
    return None


# ------------------------------------------------------------ `vllm-cascade check VLLM_ARGS`

# The EngineArgs fields ``check`` reads from vLLM's command line (the same names, flags and
# meaning in 0.26-0.33; tests/face/test_check.py holds them against vLLM's EngineArgs).
ENGINE_FIELDS = ("attention_backend", "kv_cache_dtype", "enable_prefix_caching",
                 "speculative_config", "async_scheduling", "tensor_parallel_size")


def read_engine_arguments(argv: list[str]) -> dict[str, Any]:
    """The settings of :data:`ENGINE_FIELDS` in ``vllm serve``-style arguments (a model first,
    flags in either ``--a-b`` or ``--a_b`` spelling, ``--flag=value`` or ``--flag value``);
    a flag not given is None. Other arguments are ignored; one of these without its value, or a
    ``--speculative-config`` that is not JSON, raises ValueError."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--attention-backend")
    parser.add_argument("--kv-cache-dtype")
    parser.add_argument("--speculative-config")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int)
    for flag in ("enable-prefix-caching", "async-scheduling"):
        parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction)
    try:
        values = vars(parser.parse_known_args([_dashed(arg) for arg in argv])[0])
    except argparse.ArgumentError as exc:
        raise ValueError(str(exc)) from None
    if values["speculative_config"] is not None:
        try:
            values["speculative_config"] = json.loads(values["speculative_config"])
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    return values


def _dashed(arg: str) -> str:
    """``--a_b=value`` as ``--a-b=value`` (vLLM's parser takes both spellings of a flag)."""
    if not arg.startswith("--"):
        return arg
    flag, equals, value = arg.partition("=")
    return flag.replace("_", "-") + equals + value


def engine_argument_reasons(values: dict[str, Any], fp8_kv: bool = False,
                            unverified: bool = False) -> list[str]:
    """Why an engine started with these settings (:func:`read_engine_arguments`) runs every
    step flat; empty: the cascade can run. ``fp8_kv``, ``unverified``: ``CASCADE_FP8_KV``,
    ``CASCADE_UNVERIFIED`` are on."""
    reasons = []
    backend = values.get("attention_backend")
    if backend is not None and str(backend).upper() not in BACKENDS:
        reasons.append(f"--attention-backend {backend}: the plugin extends FLASH_ATTN and "
                       "FLASHINFER only; other backends run as without it")
    if values.get("enable_prefix_caching") is False:
        reasons.append(PREFIX_CACHING_OFF)
    if (reason := kv_cache_dtype_reason(values.get("kv_cache_dtype"), fp8_kv)) is not None:
        reasons.append(reason)
    speculative = values.get("speculative_config")
    if speculative is not None:
        method = speculative.get("method") if isinstance(speculative, dict) else None
        if (reason := speculative_reason(method, values.get("async_scheduling"),
                                         unverified)) is not None:
            reasons.append(reason)
    if (reason := parallel_reason(values.get("tensor_parallel_size"), unverified)) is not None:
        reasons.append(reason)
    return reasons
