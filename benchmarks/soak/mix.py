"""The soak's request mix and the engine it runs on (``bench.py``): the same requests for a seed,
whatever runs them. numpy only: ``bench.py --dry-run`` prints the mix without vLLM or torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

# The request mix. Token ids stay clear of the special ids at both ends of the 32,000 vocabulary.
TOKEN_RANGE = (100, 31900)
GROUPS = 8
SYSTEM_TOKENS = 512  # groups 0-3 start with this shared system prompt
PREFIX_TOKENS = (512, 4096)
SUFFIX_TOKENS = (16, 128)
UNSHARED_FRACTION = 0.1
UNSHARED_TOKENS = (64, 1024)
SAMPLING_FRACTION = 0.15
SAMPLING_N = (4, 8)
TEMPERATURE = 0.8
ABORT_FRACTION = 0.1
MAX_TOKENS = (16, 128)
SUBSET_SIZE = 64
SUBSET_SUFFIX_TOKENS = (16, 64)
SUBSET_SPAN = 0.8  # the subset is submitted evenly over the first 80% of --duration
GREEDY = {"temperature": 0.0, "max_tokens": 24, "logprobs": 2, "ignore_eos": True}

# The engine: as tests/gpu/engine_driver.py, with a smaller KV cache and max_model_len.
ENGINE = {"skip_tokenizer_init": True, "attention_backend": "FLASHINFER",
          "enable_prefix_caching": True, "max_model_len": 8192, "max_num_batched_tokens": 2048,
          "max_num_seqs": 128, "seed": 0, "enable_flashinfer_autotune": False,
          # A fixed KV cache and a small share of the GPU: the soak can run beside other work
          # (scripts/gpu_validate.sh), and vLLM skips its memory profiling, which that work
          # would disturb. --num-gpu-blocks sets the cache's size within these bytes.
          "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 1 << 30}
# Every cascade path, mixed steps split included (off by default), each plan checked.
PLUGIN_ENV = {"CASCADE_ATTENTION": "1", "CASCADE_POLICY": "always", "CASCADE_SPLIT_MIXED": "1",
              "CASCADE_DEBUG": "1"}
BASELINE_S = 60.0  # memory baseline after this much of the mix (or a quarter of --duration)


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    request_id: str
    kind: str  # "plain", "sampling", "subset" or "warmup"
    group: int  # shared-prefix group; -1: none
    prompt: list[int]
    params: dict[str, Any]  # SamplingParams keyword arguments
    abort_after: int | None = None  # abort once a completion has this many tokens


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(*TOKEN_RANGE, size=n).tolist()


def _between(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def shared_prefixes(seed: int) -> list[list[int]]:
    """The groups' prefixes; the first half share a system prompt (a three-level tree)."""
    rng = np.random.default_rng([seed, 0])
    system = _tokens(rng, SYSTEM_TOKENS)
    prefixes = []
    for group in range(GROUPS):
        length = _between(rng, PREFIX_TOKENS)
        if group < GROUPS // 2:
            prefixes.append(system + _tokens(rng, length - SYSTEM_TOKENS))
        else:
            prefixes.append(_tokens(rng, length))
    return prefixes


def request_stream(prefixes: list[list[int]], seed: int) -> Iterator[RequestSpec]:
    """The drive's requests, endless and the same for a seed."""
    rng = np.random.default_rng([seed, 1])
    for i in range(sys.maxsize):
        group = -1 if rng.random() < UNSHARED_FRACTION else int(rng.integers(len(prefixes)))
        prompt = (_tokens(rng, _between(rng, UNSHARED_TOKENS)) if group < 0
                  else prefixes[group] + _tokens(rng, _between(rng, SUFFIX_TOKENS)))
        max_tokens = _between(rng, MAX_TOKENS)
        request_seed = int(rng.integers(2**31))
        if rng.random() < SAMPLING_FRACTION:
            kind = "sampling"
            params = {"n": int(rng.choice(SAMPLING_N)), "temperature": TEMPERATURE}
        else:
            kind = "plain"
            params = {"temperature": float(rng.choice([0.0, TEMPERATURE]))}
        params.update(max_tokens=max_tokens, seed=request_seed)
        abort_after = _between(rng, (1, max_tokens - 1)) if rng.random() < ABORT_FRACTION else None
        yield RequestSpec(f"r{i}", kind, group, prompt, params, abort_after)


def subset_requests(prefixes: list[list[int]], seed: int) -> list[RequestSpec]:
    """The greedy requests replayed without the plugin: every group, never aborted."""
    rng = np.random.default_rng([seed, 2])
    return [RequestSpec(f"s{i}", "subset", i % len(prefixes),
                        prefixes[i % len(prefixes)] + _tokens(rng, _between(rng,
                                                                              SUBSET_SUFFIX_TOKENS)),
                        dict(GREEDY))
            for i in range(SUBSET_SIZE)]


def warmup_requests(prefixes: list[list[int]], seed: int) -> list[RequestSpec]:
    """A small batch of every kind, run before the clock starts (kernels JIT-compile here)."""
    rng = np.random.default_rng([seed, 3])
    short = {"max_tokens": 8, "seed": seed}
    specs = [RequestSpec(f"w{i}", "warmup", 0, prefixes[0] + _tokens(rng, 16),
                         {**GREEDY, "max_tokens": 8}) for i in range(8)]
    specs.append(RequestSpec("w8", "warmup", 1, prefixes[1] + _tokens(rng, 16),
                             {**short, "n": 4, "temperature": TEMPERATURE}))
    specs.append(RequestSpec("w9", "warmup", -1, _tokens(rng, 256),
                             {**short, "temperature": TEMPERATURE}))
    return specs


def subset_due_s(index: int, duration_s: float) -> float:
    """When the drive submits subset request ``index``: evenly over its first SUBSET_SPAN."""
    return SUBSET_SPAN * duration_s * index / SUBSET_SIZE


def baseline_s(duration_s: float) -> float:
    return min(BASELINE_S, duration_s / 4)


def drive_cap_s(duration_s: float) -> float:
    """Submitting stops here even when --min-requests was not reached (the run then fails)."""
    return max(2 * duration_s, duration_s + 600)


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """What the drive would submit first (--min-requests of it), from the seed alone."""
    prefixes = shared_prefixes(args.seed)
    stream = request_stream(prefixes, args.seed)
    specs = [next(stream) for _ in range(args.min_requests)]
    subset = subset_requests(prefixes, args.seed)
    prompts = np.array([len(s.prompt) for s in specs])
    # Pages the groups' prefixes hold when all are cached (the system prompt once).
    prefix_tokens = SYSTEM_TOKENS + sum(len(p) - SYSTEM_TOKENS * (g < GROUPS // 2)
                                        for g, p in enumerate(prefixes))
    return {
        "requests": len(specs),
        "kinds": dict(Counter(s.kind for s in specs)),
        "sampling_n": {str(n): c for n, c in sorted(Counter(
            s.params.get("n", 1) for s in specs).items())},
        "planned_aborts": sum(s.abort_after is not None for s in specs),
        "unshared": sum(s.group < 0 for s in specs),
        "groups": [{"prefix_tokens": len(p), "requests": sum(s.group == g for s in specs)}
                   for g, p in enumerate(prefixes)],
        "prompt_tokens": {"min": int(prompts.min()), "mean": float(prompts.mean()),
                          "max": int(prompts.max())},
        "longest_request_tokens": max(len(s.prompt) + s.params["max_tokens"]
                                      for s in [*specs, *subset]),
        "max_model_len": ENGINE["max_model_len"],
        "prefix_kv_blocks": -(-prefix_tokens // 16),
        "num_gpu_blocks": args.num_gpu_blocks,
        "subset": {"requests": len(subset), "groups": len({s.group for s in subset}),
                   "first_due_s": subset_due_s(0, args.duration),
                   "last_due_s": subset_due_s(len(subset) - 1, args.duration)},
    }
