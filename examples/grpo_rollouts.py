"""GRPO-style rollouts: ``n=16`` samples of every prompt share the prompt's KV pages.

    python examples/grpo_rollouts.py [--model examples/models/llama3-8b] [--prompts 8] [--n 16]

Each prompt's 16 samples are one cascade group: the prompt is read once per step for all of them.
Dummy weights, token-id prompts. Needs a CUDA GPU, vLLM and this plugin installed.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("CASCADE_ATTENTION", "1")  # before vLLM starts
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the counters here

import numpy as np
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from vllm_cascade_plugin import stats

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(HERE / "models" / "llama3-8b"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=512)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    prompts = [TokensPrompt(prompt_token_ids=rng.integers(100, 30000, args.prompt_tokens).tolist())
               for _ in range(args.prompts)]
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True,
              attention_backend="FLASHINFER", enable_prefix_caching=True,
              max_model_len=args.prompt_tokens + args.max_tokens,
              gpu_memory_utilization=0.85, enable_flashinfer_autotune=False)
    # Rollouts sample (temperature 1); a seed makes a rerun reproducible.
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens,
                            ignore_eos=True, seed=0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    counters = stats.snapshot()
    print(f"{args.prompts} prompts x n={args.n} rollouts of {args.max_tokens} tokens: "
          f"{tokens} tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tok/s")
    print(f"cascade attention on {counters.steps_cascade} of {counters.steps_planned} steps "
          f"(decode: {counters.decode_steps_cascade} of {counters.decode_steps_planned}); "
          f"{counters.pages_flat:,} KV pages flat -> {counters.pages_cascade:,} read; "
          f"fallbacks: {dict(counters.fallbacks) or 'none'}")
    if counters.steps_cascade == 0 and os.environ.get("CASCADE_POLICY", "auto") == "auto":
        print("CASCADE_POLICY=auto kept every step flat: the cost model predicts no gain here "
              "(CASCADE_POLICY=always runs cascade anyway).")


if __name__ == "__main__":
    main()
