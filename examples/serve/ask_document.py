"""Many questions about one document, sent concurrently to ``vllm serve`` with the OpenAI client.

    python examples/serve/ask_document.py [--base-url http://localhost:8000/v1] [--questions 64]

Every prompt is the same document followed by a different question, so all requests share the
document's KV pages: the plugin attends to them once per step for the whole batch. With the
tokenizer of make_tokenizer.py, a word is a token: the document is ``--document-words`` tokens.
"""

from __future__ import annotations

import argparse
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randrange(100, 30000)}" for _ in range(n))


def wait_for_server(base_url: str, timeout_s: float) -> None:
    health = base_url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(health, timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer from {health} after {timeout_s:.0f} s") from None
            time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://localhost:8000/v1")
    parser.add_argument("--model", default="demo", help="the server's --served-model-name")
    parser.add_argument("--document-words", type=int, default=8000)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for the server")
    args = parser.parse_args()

    wait_for_server(args.base_url, args.wait)
    client = OpenAI(base_url=args.base_url, api_key="unused")
    rng = random.Random(0)
    document = words(rng, args.document_words)
    questions = [f"{document} {words(rng, 16)}" for _ in range(args.questions)]

    def ask(prompt: str) -> int:
        reply = client.completions.create(model=args.model, prompt=prompt, temperature=0.0,
                                          max_tokens=args.max_tokens,
                                          extra_body={"ignore_eos": True})
        return reply.usage.completion_tokens if reply.usage else 0

    ask(questions[0])  # reads the document once: the other questions find it in the prefix cache
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.questions) as pool:
        tokens = sum(pool.map(ask, questions))
    seconds = time.perf_counter() - start
    print(f"{args.questions} questions about one {args.document_words}-token document: "
          f"{tokens} tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tok/s")


if __name__ == "__main__":
    main()
