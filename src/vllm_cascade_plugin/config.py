"""Every knob of the plugin: read from the environment once, validated, frozen.

A bad value fails fast with a message naming the variable, the value and what is accepted, so a
typo never silently turns the plugin off (or on). Our variables deliberately avoid the ``VLLM_``
prefix: vLLM warns about unknown ``VLLM_*`` variables and can be told to reject them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "on")
_FALSE = ("0", "false", "off")


class ConfigError(ValueError):
    """A plugin environment variable holds a value the plugin does not accept."""


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw.strip())
        if value < minimum:
            raise ValueError
        return value

    return parse


def _float_at_least(minimum: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = float(raw.strip())
        if not value >= minimum:  # also rejects nan
            raise ValueError
        return value

    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError
        return value

    return parse


@dataclass(frozen=True)
class Knob:
    env: str
    field: str
    default: Any
    parse: Callable[[str], Any]
    accepted: str
    help: str


KNOBS: tuple[Knob, ...] = (
    Knob("CASCADE_ATTENTION", "enabled", False, _bool, "1/true/on or 0/false/off (unset = off)",
         "Turns the plugin on. Off: vLLM behaves exactly as without the plugin."),
    Knob("CASCADE_POLICY", "policy", "auto", _choice("auto", "always"), "auto or always",
         "auto: the cost model picks cascade or flat attention per step; always: cascade whenever "
         "the planner finds a shared level (for tests and benchmarks)."),
    Knob("CASCADE_KERNEL", "kernel", "auto", _choice("auto", "fa3", "flashinfer"),
         "auto, fa3 or flashinfer",
         "Kernels of cascade steps. auto: vLLM's FlashAttention 3 where it runs (Hopper GPUs, NHD "
         "KV cache), else FlashInfer; fa3 where it cannot run falls back to FlashInfer with a "
         "warning."),
    Knob("CASCADE_FUSED_DECODE", "fused_decode", True, _bool, "1/true/on or 0/false/off",
         "Decode steps on FlashAttention 3: each request's own pages and the final merge in the "
         "plugin's Triton kernel (on), or in FlashAttention 3 and vLLM's merge (off)."),
    Knob("CASCADE_CUDA_GRAPHS", "cuda_graphs", True, _bool, "1/true/on or 0/false/off",
         "Decode steps on FlashAttention 3: capture each layer's cascade attention in a CUDA "
         "graph once a step shape repeats and replay it (on), or launch its kernels from Python "
         "in every layer (off). Off as well when vLLM runs without CUDA graphs (enforce_eager)."),
    Knob("CASCADE_FULL_GRAPHS", "full_graphs", True, _bool, "1/true/on or 0/false/off",
         "Decode steps on FlashAttention 3: capture a whole cascade decode step (every layer) "
         "in a CUDA graph of the plugin's once its shape repeats and replay it (on), or run "
         "vLLM's piecewise path with per-layer graphs (off). Needs CASCADE_CUDA_GRAPHS; not used "
         "with tensor/pipeline/data parallel size above 1, LoRA or weight offloading."),
    Knob("CASCADE_PLAN_FROM_CHANGES", "plan_from_changes", True, _bool,
         "1/true/on or 0/false/off",
         "Plan each step from the rows vLLM changed (requests new, resumed or moved), as the "
         "runner learns them from the scheduler, and a step of the same requests one token "
         "longer from the last step's plan (on), or by comparing every row's block ids with "
         "the last step's (off)."),
    Knob("CASCADE_SPLIT_MIXED", "split_mixed", False, _bool, "1/true/on or 0/false/off",
         "Mixed prefill+decode steps on FlashAttention 3: their decode rows as cascade, split "
         "from the other rows (which run flat), where the cost model says it wins and a step of "
         "the same layout came before (on), or the whole step planned as one, its prefill "
         "rows' query tokens in the plan, and run as cascade where the eager cost model says "
         "it wins, else flat (off). Served, the split cost more host time and CUDA-graph "
         "captures than it saved; whole steps gave bursts the lowest TPOT (docs/performance.md)."),
    Knob("CASCADE_MAX_LEVELS", "max_levels", 3, _int_at_least(2), "an integer >= 2",
         "Most attention levels per step, the per-request level included (2 = one shared level)."),
    Knob("CASCADE_MIN_SHARED_PAGES", "min_shared_pages", 1, _int_at_least(1), "an integer >= 1",
         "Fewest KV pages (blocks) a group must share to get a level of its own."),
    Knob("CASCADE_LOG_INTERVAL", "log_interval_s", 60.0, _float_at_least(0.0),
         "seconds, a number >= 0 (0 = off)",
         "How often each worker logs its cascade statistics."),
    Knob("CASCADE_DEBUG", "debug", False, _bool, "1/true/on or 0/false/off",
         "Check every plan's invariants before a kernel reads memory (slower)."),
    Knob("CASCADE_FP8_KV", "fp8_kv", True, _bool, "1/true/on or 0/false/off",
         "Cascade with an FP8 KV cache (--kv-cache-dtype fp8 / fp8_e4m3, per-layer scales). "
         "Correct on a GPU (kernels against fp32 attention on the dequantised cache, engines "
         "against two FP8 kernels) and served faster than flat FP8 (docs/performance.md). "
         "Off: such a cache runs flat."),
    Knob("CASCADE_UNVERIFIED", "unverified", False, _bool, "1/true/on or 0/false/off",
         "Cascade where this release is not verified on a GPU or served slower than flat: "
         "tensor parallelism above 1, suffix speculative decoding, the attention layers of a "
         "model whose recurrent layers vLLM's hybrid KV-cache manager keeps in KV-cache "
         "groups of their own (Mamba and linear-attention hybrids), and layers with attention "
         "sinks (gpt-oss). Off: those run flat, saying why. Also the V1 runner's steps known to "
         "share nothing without their rows being read (host time only; off: every step read)."),
    Knob("CASCADE_ALLOW_UNTESTED_VLLM", "allow_untested_vllm", False, _bool,
         "1/true/on or 0/false/off",
         "Run on a vLLM release newer than the newest one the plugin is tested with, where every "
         "vLLM method the plugin patches reads as in that release (checked at startup, which "
         "refuses naming the first changed method). Off: such a vLLM runs without the plugin, "
         "with one warning."),
)


@dataclass(frozen=True)
class CascadeConfig:
    enabled: bool = False
    policy: str = "auto"
    kernel: str = "auto"
    fused_decode: bool = True
    cuda_graphs: bool = True
    full_graphs: bool = True
    plan_from_changes: bool = True
    split_mixed: bool = False
    max_levels: int = 3
    min_shared_pages: int = 1
    log_interval_s: float = 60.0
    debug: bool = False
    fp8_kv: bool = True
    unverified: bool = False
    allow_untested_vllm: bool = False



def load_config(environ: Mapping[str, str] | None = None) -> CascadeConfig:
    """Parse every knob from ``environ`` (default ``os.environ``); raise :class:`ConfigError`."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for knob in KNOBS:
        raw = env.get(knob.env, "")
        if raw.strip() == "":
            values[knob.field] = knob.default
            continue
        try:
            values[knob.field] = knob.parse(raw)
        except ValueError:
            raise ConfigError(
                f"{knob.env}={raw!r} is not valid: expected {knob.accepted}. "
                f"Fix or unset {knob.env} and start vLLM again."
            ) from None
    return CascadeConfig(**values)
