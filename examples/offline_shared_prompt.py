"""Offline ``LLM`` with a long shared system prompt: every request attends to it once per step.

    python examples/offline_shared_prompt.py [--model examples/models/llama3-8b] [--requests 64]

Dummy weights (no download) and token-id prompts (no tokenizer): the numbers are about speed and
what the plugin did, not about text. Needs a CUDA GPU, vLLM and this plugin installed.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

# Before vLLM starts: it loads plugins at startup, in every process.
os.environ.setdefault("CASCADE_ATTENTION", "1")
# Engine core and worker in this process, so that this script can read the plugin's counters
# (stats.snapshot()); with vLLM's default (a separate engine process) the periodic log line and
# the Prometheus metrics report them instead.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from vllm_cascade_plugin import stats

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(HERE / "models" / "llama3-8b"))
    parser.add_argument("--system-tokens", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    system = rng.integers(100, 30000, size=args.system_tokens).tolist()
    prompts = [TokensPrompt(prompt_token_ids=system + rng.integers(100, 30000, size=32).tolist())
               for _ in range(args.requests)]

    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True,
              attention_backend="FLASHINFER",  # the backend the plugin extends
              enable_prefix_caching=True,  # how requests come to share the prompt's KV pages
              max_model_len=args.system_tokens + 32 + args.max_tokens,
              gpu_memory_utilization=0.85, enable_flashinfer_autotune=False)
    # The first request computes the system prompt once; the others find it in the prefix cache.
    llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    counters = stats.snapshot()
    print(f"{args.requests} requests sharing a {args.system_tokens}-token system prompt: "
          f"{tokens} tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tok/s")
    print(f"cascade attention on {counters.steps_cascade} of {counters.steps_planned} steps "
          f"({counters.pages_flat:,} KV pages flat -> {counters.pages_cascade:,} read); "
          f"fallbacks: {dict(counters.fallbacks) or 'none'}")
    if counters.steps_cascade == 0 and os.environ.get("CASCADE_POLICY", "auto") == "auto":
        print("CASCADE_POLICY=auto kept every step flat: the cost model predicts no gain here "
              "(CASCADE_POLICY=always runs cascade anyway).")


if __name__ == "__main__":
    main()
