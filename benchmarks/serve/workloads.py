"""Workloads, tokenizer, datasets and client commands of ``serve/bench.py`` (no server here).

Each workload is one of ``vllm bench serve``'s own datasets: ``prefix_repetition`` (shared
prefixes, random suffixes), ``random`` (nothing shared, the same lengths) or ``custom`` (a JSONL
file written here: the two-level tree of a system prompt, documents and questions). Prompts are
text in the word-level vocabulary of :func:`write_model_folder` (token ``i`` is the word ``w<i>``),
so text and token ids map one to one and the datasets' lengths are exact. What a run measures and
where it is written: ``serve/results.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import shutil
import sys
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

BURST = "burst"
VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]  # no console script needed
HOST = "127.0.0.1"
MIN_POISSON_PROMPTS = 16  # a Poisson run shorter than this says little about its tail latency
MAX_PROMPTS = 4096


@dataclasses.dataclass(frozen=True)
class Workload:
    """One request mix. ``kind``: ``prefix_repetition``, ``tree``, ``random`` or ``chat``.

    ``prefix_len`` is the shared prefix (prefix_repetition), system prompt (tree, chat) in tokens;
    ``groups`` the number of prefixes (prefix_repetition) or documents (tree); ``doc_len`` the
    document length (tree); ``suffix_len`` each request's own tokens, drawn from ``suffix_len``
    times 1 +- ``range_ratio`` (chat). ``burst_prompts``: how many requests the burst run sends
    (fewer for long prompts without sharing: their prefill is long).
    """

    name: str
    kind: str
    prefix_len: int = 0
    groups: int = 1
    doc_len: int = 0
    suffix_len: int = 64
    output_len: int = 256
    burst_prompts: int = 256
    range_ratio: float = 0.0

    @property
    def input_len(self) -> int:
        """The longest prompt."""
        return self.prefix_len + self.doc_len + math.ceil(self.suffix_len * (1 + self.range_ratio))

    @property
    def total_len(self) -> int:
        return self.input_len + self.output_len


def _workloads() -> dict[str, Workload]:
    w = {}
    for length in (2048, 8192, 32768):
        for groups in (1, 4, 16):
            name = f"prefix_{length // 1024}k_x{groups}"
            w[name] = Workload(name, "prefix_repetition", prefix_len=length, groups=groups)
    w["tree_2k_4x8k"] = Workload("tree_2k_4x8k", "tree", prefix_len=2048, groups=4, doc_len=8192)
    # The prefix workloads' total lengths without any sharing.
    for length, burst in ((2048, 256), (8192, 128), (32768, 32)):
        name = f"random_{length // 1024}k"
        w[name] = Workload(name, "random", suffix_len=length + 64, burst_prompts=burst)
    # A chat service: one 1.5K-token system prompt, 256-1,024 tokens of each user's own, short
    # answers. The shared part is small: the case where the cascade must not cost anything.
    w["chat_1k5_system"] = Workload("chat_1k5_system", "chat", prefix_len=1536, suffix_len=640,
                                    range_ratio=0.6, output_len=128)
    # Prefill-heavy chat: a 1K-token system prompt, 256-768 tokens of each user's own, 96-token
    # answers. Most steps carry a prefill chunk; the decode-only steps the cascade can take are
    # few and their shared part is small.
    w["chat_1k_prefill_heavy"] = Workload("chat_1k_prefill_heavy", "chat", prefix_len=1024,
                                          suffix_len=512, range_ratio=0.5, output_len=96)
    # A long shared system prompt (6K tokens: 8 pages of 768, the page of a Mamba hybrid's
    # attention layers, and 384 of 16), 256-768 tokens of each user's own, 128-token answers: the
    # served pair of each model family (hybrids: benchmarks/serve/expected.py).
    w["chat_6k_system"] = Workload("chat_6k_system", "chat", prefix_len=6144, suffix_len=512,
                                   range_ratio=0.5, output_len=128)
    return w


WORKLOADS = _workloads()


def max_model_len(workloads: Iterable[Workload], vocab_size: int, multiple: int = 256) -> int:
    """Just above the longest request (prompt + output), rounded up to the next multiple of
    ``multiple``, and long enough that vLLM's character check lets every prompt through.

    Before tokenizing, vLLM refuses (400 Bad Request) a prompt of more characters than its
    input token limit (``max_model_len`` less the request's ``max_tokens``) times the longest
    token of the vocabulary. The word-level tokenizer's words (``w0`` ... ``w<vocab_size - 1>``)
    are joined by spaces, so a prompt takes up to one character per token more than its longest
    word: the input limit must exceed the prompt's tokens by that ratio.
    """
    word = len(f"w{vocab_size - 1}")
    need = max(max(w.total_len, w.output_len + -(-w.input_len * (word + 1) // word))
               for w in workloads)
    return (need // multiple + 1) * multiple


def round_prompts(workload: Workload, n: int) -> int:
    """``n`` rounded up to whole groups: prefix_repetition sends ``n // groups`` per prefix."""
    return -(-n // workload.groups) * workload.groups


def parse_rates(spec: str) -> list[str]:
    """``"burst,50%,90%,3.5"`` -> the same items, validated; burst first, as the derived rates
    need the flat burst measured before them. ``"90%*2"``: that rate twice, the second run
    labelled ``"90%#2"`` (the same prompts: the spread of a repeated measurement)."""
    items: list[str] = []
    for raw in (s.strip() for s in spec.split(",") if s.strip()):
        item, _, times = raw.partition("*")
        if item != BURST and not re.fullmatch(r"\d+(\.\d+)?%?", item):
            raise ValueError(f"rate {item!r}: 'burst', a fraction like '50%' or req/s like '4.5'")
        if item != BURST and float(item.rstrip("%")) <= 0:
            raise ValueError(f"rate {item!r} must be positive")
        if times and (not times.isdigit() or int(times) < 1):
            raise ValueError(f"rate {raw!r}: repeat a rate as RATE*N, N a positive integer")
        items += [item] + [f"{item}#{i}" for i in range(2, int(times or 1) + 1)]
    return sorted(dict.fromkeys(items), key=lambda s: s != BURST)


def parse_rate_plan(spec: str) -> dict[str, list[str]]:
    """``--rates``: one list for every workload (:func:`parse_rates`), or lists per workload,
    ``"prefix_8k_x4=burst,50%,90%*2;*=burst,90%"`` (``*``: the workloads not named)."""
    if "=" not in spec:
        return {"*": parse_rates(spec)}
    plan: dict[str, list[str]] = {}
    for part in (p.strip() for p in spec.split(";") if p.strip()):
        name, sep, rates = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"rates {part!r}: WORKLOAD=RATES or *=RATES, separated by ';'")
        plan[name.strip()] = parse_rates(rates)
    return plan


def base_rate(item: str) -> str:
    """A rate item without its repeat number: ``"90%#2"`` -> ``"90%"``."""
    return item.partition("#")[0]


def sustainable_rate(result: dict[str, Any]) -> float:
    """Requests per second a burst run completed: ``completed / duration`` of its result."""
    if not result.get("completed") or not result.get("duration"):
        raise ValueError("the burst run completed no request")
    return float(result["completed"]) / float(result["duration"])


def resolve_rate(item: str, sustainable: float | None) -> float | str | None:
    """The request rate of one ``--rates`` item: ``"burst"``, req/s, or None when the item is a
    fraction and the flat backend's sustainable rate is unknown."""
    item = base_rate(item)
    if item == BURST:
        return BURST
    if not item.endswith("%"):
        return float(item)
    if sustainable is None:
        return None
    return float(f"{sustainable * float(item[:-1]) / 100:.3g}")  # 3 digits: readable in the JSON


# --- The tokenizer -------------------------------------------------------------------------


def write_model_folder(config_dir: Path, out: Path) -> Path:
    """``out``: a copy of ``config_dir/config.json`` and a word-level tokenizer over its vocabulary.

    Token ``i`` is the word ``w<i>``; words are split at whitespace and decoded joined by spaces,
    so every id sequence decodes and re-encodes to itself (``prefix_repetition`` draws ids from the
    whole vocabulary, BOS and EOS included). BOS/EOS are config.json's ids; they are special
    tokens matched as whole words only (``w1`` must not match inside ``w17``). No post-processor:
    nothing is added to prompts, so ``num_special_tokens_to_add()`` is 0 and lengths are exact.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copyfile(config_dir / "config.json", out / "config.json")
    config = json.loads((out / "config.json").read_text())
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    # The unknown word never occurs in our prompts; mapping it to a token beats an error.
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    bos, eos = f"w{config['bos_token_id']}", f"w{config['eos_token_id']}"
    tokenizer.add_special_tokens(
        [AddedToken(t, single_word=True, normalized=False, special=True) for t in (bos, eos)])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": config.get("max_position_embeddings", 131072)}, indent=1))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos}, indent=1))
    return out


# --- The two-level tree (custom dataset) ------------------------------------------------------


def tree_prompts(workload: Workload, num_prompts: int, seed: int, vocab_size: int,
                 special_ids: Sequence[int] = ()) -> list[list[int]]:
    """Token ids of the tree: one system prompt, ``groups`` documents after it, the questions
    spread evenly over the documents (in random order), each ``suffix_len`` own tokens."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))

    def tokens(n: int) -> list[int]:
        return allowed[rng.integers(0, len(allowed), size=n)].tolist()

    system = tokens(workload.prefix_len)
    docs = [tokens(workload.doc_len) for _ in range(workload.groups)]
    order = rng.permutation(num_prompts) % workload.groups
    return [system + docs[d] + tokens(workload.suffix_len) for d in order]


def write_tree_dataset(path: Path, workload: Workload, num_prompts: int, seed: int,
                       vocab_size: int, special_ids: Sequence[int] = ()) -> Path:
    """The tree as ``vllm bench serve --dataset-name custom`` reads it: one JSON object a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for ids in tree_prompts(workload, num_prompts, seed, vocab_size, special_ids):
            prompt = " ".join(f"w{i}" for i in ids)  # the tokenizer's words: exact token ids
            f.write(json.dumps({"prompt": prompt, "output_tokens": workload.output_len}))
            f.write("\n")
    return path


def dataset_args(workload: Workload, dataset_path: Path | None) -> list[str]:
    """``vllm bench serve``'s dataset arguments for ``workload``."""
    if workload.kind == "prefix_repetition":
        return ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(workload.prefix_len),
                "--prefix-repetition-suffix-len", str(workload.suffix_len),
                "--prefix-repetition-num-prefixes", str(workload.groups),
                "--prefix-repetition-output-len", str(workload.output_len)]
    if workload.kind == "random":
        return ["--dataset-name", "random", "--random-input-len", str(workload.input_len),
                "--random-output-len", str(workload.output_len), "--random-prefix-len", "0",
                "--random-range-ratio", "0"]
    if workload.kind == "chat":
        return ["--dataset-name", "random", "--random-input-len", str(workload.suffix_len),
                "--random-output-len", str(workload.output_len),
                "--random-prefix-len", str(workload.prefix_len), "--random-range-ratio",
                json.dumps({"input": workload.range_ratio, "output": 0.0})]
    if workload.kind == "tree":
        # Raw text, no chat template (the tokenizer has none); the file's order as written.
        return ["--dataset-name", "custom", "--dataset-path", str(dataset_path),
                "--custom-output-len", str(workload.output_len), "--skip-chat-template",
                "--disable-shuffle", "--no-oversample"]
    raise ValueError(f"unknown workload kind {workload.kind!r}")


def client_command(workload: Workload, model_dir: Path, port: int, rate: float | str,
                   num_prompts: int | str, seed: int, dataset_path: Path | None,
                   result: tuple[Path, str] | None) -> list[str]:
    """``vllm bench serve`` for one run; ``result`` = (dir, file name) to save, None: warm-up."""
    cmd = [*VLLM, "bench", "serve", "--backend", "openai", "--host", HOST, "--port", str(port),
           "--endpoint", "/v1/completions", "--model", str(model_dir),
           "--tokenizer", str(model_dir), *dataset_args(workload, dataset_path),
           "--num-prompts", str(num_prompts),
           "--request-rate", "inf" if rate == BURST else str(rate), "--seed", str(seed),
           "--ignore-eos", "--temperature", "0", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    if result is not None:
        cmd += ["--save-result", "--result-dir", str(result[0]), "--result-filename", result[1]]
    return cmd


def run_seed(base: int, workload: str, label: str) -> int:
    """The same prompts for a (workload, rate) in every config, invocation and repeat; others
    differ."""
    return base + zlib.crc32(f"{workload}/{base_rate(label)}".encode()) % 1_000_000


def num_prompts(workload: Workload, rate: float | str, fixed: int | None, duration_s: float) -> int:
    """Requests of one run: ``fixed`` (whole groups), else the workload's burst count or
    ``duration_s`` of Poisson arrivals."""
    if fixed:
        return round_prompts(workload, fixed)
    if rate == BURST:
        return round_prompts(workload, workload.burst_prompts)
    n = math.ceil(float(rate) * duration_s)
    return round_prompts(workload, min(max(n, MIN_POISSON_PROMPTS), MAX_PROMPTS))


def missing_modules(workloads: list[Workload]) -> list[str]:
    """What the chosen workloads need beside vLLM: its custom dataset reads JSONL with pandas."""
    tree = any(w.kind == "tree" for w in workloads)
    return ["pandas"] if tree and importlib.util.find_spec("pandas") is None else []
