"""vLLM's engine as ``vllm serve`` runs it, with requests arriving and finishing every step.

Usage: python serving_driver.py MODEL_DIR OUT_JSON [--requests N] [--seed S]
                                 [--gpu-memory-utilization F] [--kv-cache-memory-bytes B]

The engine core runs in its own process (vLLM's default multiprocessing) with async scheduling,
as under ``vllm serve``; the caller's ``CASCADE_ATTENTION`` turns the plugin on or off. Requests
share one of four 1K-token prefixes, ask for 8-48 tokens each (greedy, ``logprobs=2``) and are
added a few per engine step, so the batch changes on every step: many batch shapes, the case
the plugin's CUDA graphs must survive. Writes each request's :func:`agreement.record` and the
plugin's counters (read from the worker with ``collective_rpc``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import engine_driver
from engine_driver import VOCAB, _counters

from vllm_cascade_plugin.face import agreement

PREFIX_TOKENS = 1024


def arrivals(requests: int, seed: int) -> list[tuple[int, list[int], int]]:
    """(engine step it arrives at, prompt token ids, max_tokens) per request."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(100, VOCAB - 100, PREFIX_TOKENS).tolist() for _ in range(4)]
    step, out = 0, []
    while len(out) < requests:
        for _ in range(int(rng.poisson(2.0))):
            prompt = prefixes[int(rng.integers(4))] + rng.integers(100, VOCAB - 100, 16).tolist()
            out.append((step, prompt, int(rng.integers(8, 49))))
        step += 1
    return out[:requests]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="vLLM's: the share of GPU memory its weights, activations and KV "
                             "cache take (the plugin's graphs come out of the rest)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="vLLM's: a KV cache of this size, without profiling memory (so "
                             "the engine can share the GPU with others)")
    args = parser.parse_args()

    import cloudpickle
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # The counters are read by a function sent to the engine core's worker, a process that
    # cannot import this folder: send the function's code along.
    cloudpickle.register_pickle_by_value(engine_driver)

    llm = LLM(model=args.model, skip_tokenizer_init=True, attention_backend="FLASHINFER",
              enable_prefix_caching=True, max_model_len=2048, max_num_seqs=128,
              gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, seed=0,
              enable_flashinfer_autotune=False, async_scheduling=True)
    engine = llm.llm_engine
    before = _counters(llm)
    pending = arrivals(args.requests, args.seed)
    ids: dict[str, int] = {}
    results: dict[int, dict] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens = pending.pop(0)
            index = len(ids)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2,
                                    ignore_eos=True)
            # Outputs carry the id given here; add_request returns vLLM's internal one.
            engine.add_request(f"r{index}", TokensPrompt(prompt_token_ids=prompt), params)
            ids[f"r{index}"] = index
        for output in engine.step():
            if output.finished:
                results[ids[output.request_id]] = agreement.record(output)
        step += 1
        if step % 200 == 0:  # progress, for a run that is cut short
            print(f"[serving_driver] step {step}: {len(ids)} added, {len(results)} finished",
                  flush=True)
    after = _counters(llm)
    delta = {k: after[k] - before[k] for k in (
        "decode_steps_planned", "decode_steps_cascade", "decode_steps_graphed",
        "graph_capture_failures", "full_graph_captures", "full_graph_replays",
        "graph_captures", "graph_replays")}
    with open(args.out, "w") as f:
        json.dump({"plugin": os.environ.get("CASCADE_ATTENTION", ""), "engine_steps": step,
                   "requests": [results[i] for i in range(len(ids))], **delta,
                   "full_graphs_held": after.get("full_graphs_held", 0),
                   "gpu_memory_utilization": args.gpu_memory_utilization,
                   **{k: after.get(k, 0) for k in ("graph_pool_bytes", "full_graph_pool_bytes",
                                                   "graph_captures_skipped",
                                                   "full_graph_captures_skipped",
                                                   "device_free_bytes")},
                   "fallbacks": after["fallbacks"],
                   # Where the run's decode steps went flat, and why its graphs were captured.
                   **{k: _dict_delta(after.get(k, {}), before.get(k, {}))
                      for k in ("decode_flat_reasons", "full_graph_capture_causes")}}, f)
    return 0


def _dict_delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


if __name__ == "__main__":
    sys.exit(main())
