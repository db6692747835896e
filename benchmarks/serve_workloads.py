"""Workloads, tokenizer, parsing, result files and plot of ``serve_bench.py`` (no server here).

Each workload is one of ``vllm bench serve``'s own datasets: ``prefix_repetition`` (shared
prefixes, random suffixes), ``random`` (nothing shared, the same lengths) or ``custom`` (a JSONL
file written here: the two-level tree of a system prompt, documents and questions). Prompts are
text in the word-level vocabulary of :func:`write_model_folder` (token ``i`` is the word ``w<i>``),
so text and token ids map one to one and the datasets' lengths are exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import platform
import re
import shutil
import socket
import subprocess
import sys
import zlib
from collections.abc import Iterable, Sequence
from importlib import metadata
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
    """One request mix. ``kind``: ``prefix_repetition``, ``tree`` or ``random``.

    ``prefix_len`` is the shared prefix (prefix_repetition) or system prompt (tree) in tokens;
    ``groups`` the number of prefixes (prefix_repetition) or documents (tree); ``doc_len`` the
    document length (tree); ``suffix_len`` each request's own tokens. ``burst_prompts``: how many
    requests the burst run sends (fewer for long prompts without sharing: their prefill is long).
    """

    name: str
    kind: str
    prefix_len: int = 0
    groups: int = 1
    doc_len: int = 0
    suffix_len: int = 64
    output_len: int = 256
    burst_prompts: int = 256

    @property
    def input_len(self) -> int:
        return self.prefix_len + self.doc_len + self.suffix_len

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
    return w


WORKLOADS = _workloads()


def max_model_len(workloads: Iterable[Workload], multiple: int = 256) -> int:
    """Just above the longest request (prompt + output): the next multiple of ``multiple``."""
    return (max(w.total_len for w in workloads) // multiple + 1) * multiple


def round_prompts(workload: Workload, n: int) -> int:
    """``n`` rounded up to whole groups: prefix_repetition sends ``n // groups`` per prefix."""
    return -(-n // workload.groups) * workload.groups


def parse_rates(spec: str) -> list[str]:
    """``"burst,50%,90%,3.5"`` -> the same items, validated; burst first, as the derived rates
    need flashinfer's burst measured before them."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    for item in items:
        if item != BURST and not re.fullmatch(r"\d+(\.\d+)?%?", item):
            raise ValueError(f"rate {item!r}: 'burst', a fraction like '50%' or req/s like '4.5'")
        if item != BURST and float(item.rstrip("%")) <= 0:
            raise ValueError(f"rate {item!r} must be positive")
    return sorted(dict.fromkeys(items), key=lambda s: s != BURST)


def sustainable_rate(result: dict[str, Any]) -> float:
    """Requests per second a burst run completed: ``completed / duration`` of its result."""
    if not result.get("completed") or not result.get("duration"):
        raise ValueError("the burst run completed no request")
    return float(result["completed"]) / float(result["duration"])


def resolve_rate(item: str, sustainable: float | None) -> float | str | None:
    """The request rate of one ``--rates`` item: ``"burst"``, req/s, or None when the item is a
    fraction and flat FlashInfer's sustainable rate is unknown."""
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
    """The same prompts for a (workload, rate) in every config and invocation; others differ."""
    return base + zlib.crc32(f"{workload}/{label}".encode()) % 1_000_000


def num_prompts(workload: Workload, rate: float | str, fixed: int | None, duration_s: float) -> int:
    """Requests of one run: ``fixed`` (whole groups), else the workload's burst count or
    ``duration_s`` of Poisson arrivals."""
    if fixed:
        return round_prompts(workload, fixed)
    if rate == BURST:
        return round_prompts(workload, workload.burst_prompts)
    n = math.ceil(float(rate) * duration_s)
    return round_prompts(workload, min(max(n, MIN_POISSON_PROMPTS), MAX_PROMPTS))


# --- Server-side measurements -----------------------------------------------------------------

COUNTERS = {  # row key -> Prometheus sample name
    "decode_steps_planned": "vllm_cascade_decode_steps_planned_total",
    "decode_steps_cascade": "vllm_cascade_decode_steps_cascade_total",
    "decode_steps_graphed": "vllm_cascade_decode_steps_graphed_total",
    "graph_capture_failures": "vllm_cascade_graph_capture_failures_total",
    "graph_captures": "vllm_cascade_graph_captures_total",
    "graph_capture_s": "vllm_cascade_graph_capture_seconds_total",
    "planning_s": "vllm_cascade_planning_seconds_total",
    "graph_pool_bytes": "vllm_cascade_graph_pool_bytes",  # a level (gauge): its value after
}
LEVELS = ("graph_pool_bytes",)
# Counted on tp_rank="0" only: every tensor-parallel rank plans (and captures) the same steps.
STEP_COUNTERS = ("decode_steps_planned", "decode_steps_cascade", "decode_steps_graphed",
                 "graph_captures", "graph_capture_s", "planning_s")


def parse_counters(text: str) -> dict[str, float | None]:
    """The plugin's counters in a ``/metrics`` text: summed over label sets, step counts on
    ``tp_rank="0"`` only (tensor-parallel ranks plan the same steps); None when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float | None] = dict.fromkeys(COUNTERS)
    wanted = {sample: key for key, sample in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is None:
                continue
            if key in STEP_COUNTERS and sample.labels.get("tp_rank", "0") != "0":
                continue
            totals[key] = (totals[key] or 0.0) + sample.value
    return totals


def counter_deltas(before: dict[str, float | None],
                   after: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if after.get(k) is None
            else after[k] if k in LEVELS else after[k] - (before.get(k) or 0.0)
            for k in COUNTERS}


def fractions(delta: dict[str, float | None], plugin_on: bool) -> tuple[float | None, ...]:
    """(cascade_step_fraction, graph_replay_fraction): Δcascade/Δplanned and Δgraphed/Δcascade
    decode steps; None with the plugin off, a counter missing or a zero denominator."""
    def ratio(num: float | None, den: float | None) -> float | None:
        return None if not plugin_on or num is None or not den else num / den

    return (ratio(delta["decode_steps_cascade"], delta["decode_steps_planned"]),
            ratio(delta["decode_steps_graphed"], delta["decode_steps_cascade"]))


def count_capture_warnings(log_text: str) -> int:
    """Server-log lines that say a CUDA-graph capture failed."""
    return sum(1 for line in log_text.splitlines()
               if ("vllm-cascade-plugin: capturing" in line and "failed" in line)
               or "INTERNAL ASSERT FAILED" in line)


ROW_KEYS = ("workload", "config", "request_rate", "tensor_parallel_size", "output_tok_per_s",
            "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "cascade_step_fraction",
            "graph_replay_fraction", "capture_warnings")


EXTRAS = {  # extra row key -> vllm bench serve result field
    "num_prompts": "num_prompts", "completed": "completed", "failed": "failed",
    "duration_s": "duration", "request_throughput": "request_throughput",
    "total_output_tokens": "total_output_tokens", "ttft_ms_mean": "mean_ttft_ms",
    "tpot_ms_mean": "mean_tpot_ms", "itl_ms_p50": "p50_itl_ms", "itl_ms_p99": "p99_itl_ms",
    "e2el_ms_p50": "p50_e2el_ms", "max_concurrent_requests": "max_concurrent_requests"}


def make_row(*, workload: str, config: str, request_rate: float | str, tensor_parallel_size: int,
             result: dict[str, Any], delta: dict[str, float | None], plugin_on: bool,
             capture_warnings: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One result row: :data:`ROW_KEYS` first, then extras (counts, means, provenance)."""
    step_fraction, replay_fraction = fractions(delta, plugin_on)
    row = {"workload": workload, "config": config, "request_rate": request_rate,
           "tensor_parallel_size": tensor_parallel_size,
           "output_tok_per_s": result.get("output_throughput"),
           "ttft_ms_p50": result.get("p50_ttft_ms"), "ttft_ms_p99": result.get("p99_ttft_ms"),
           "tpot_ms_p50": result.get("p50_tpot_ms"), "tpot_ms_p99": result.get("p99_tpot_ms"),
           "cascade_step_fraction": step_fraction, "graph_replay_fraction": replay_fraction,
           "capture_warnings": capture_warnings}
    row.update({k: result.get(field) for k, field in EXTRAS.items()})
    if row["request_throughput"] is None and result.get("duration"):
        row["request_throughput"] = result["completed"] / result["duration"]
    row.update(delta)
    row.update(extra)
    return row


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``new`` replaces the old rows of each (workload, config, tensor_parallel_size) it has."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["workload"], r["config"], r["tensor_parallel_size"]

    measured = {key(r) for r in new}
    return [r for r in old if key(r) not in measured] + new


def load_rows(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else []


def write_results(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Rows to ``out``; ``meta`` (this invocation) to ``<out>.meta.json`` beside it, the earlier
    invocations' meta kept under ``runs`` (rows name theirs by ``run_id``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    meta_path = out.with_suffix(".meta.json")
    old = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    runs = [r for r in old.get("runs", []) if r.get("run_id") != meta["run_id"]]
    meta_path.write_text(json.dumps({**meta, "runs": [*runs, meta]}, indent=1))


def baseline_rates(rows: list[dict[str, Any]], baseline: str, tp: int) -> dict[str, float]:
    """The sustainable rate per workload: req/s of ``baseline``'s burst rows."""
    return {r["workload"]: r["request_throughput"] for r in rows
            if r["config"] == baseline and r["request_rate"] == BURST
            and r["tensor_parallel_size"] == tp and r.get("request_throughput")}


def plot(out: Path, order: Sequence[str] = ()) -> Path:
    """TPOT p50 (solid) and TTFT p99 (dashed) against request rate, a line per config, a panel
    per workload; bursts at the rate they achieved. ``<out>.png``, from the JSON only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in load_rows(out) if r.get("tpot_ms_p50") is not None]
    workloads = sorted({r["workload"] for r in rows})
    cols = max(min(len(workloads), 3), 1)
    grid = max(-(-len(workloads) // cols), 1)
    fig, axes = plt.subplots(grid, cols, figsize=(6 * cols, 4.2 * grid), squeeze=False)
    for ax in axes.flat[len(workloads):]:
        ax.axis("off")
    configs = sorted({r["config"] for r in rows},
                     key=lambda c: (list(order).index(c) if c in order else len(order), c))
    for ax, workload in zip(axes.flat, workloads, strict=False):
        twin = ax.twinx()
        for i, config in enumerate(configs):
            mine = [r for r in rows if r["workload"] == workload and r["config"] == config]
            points = sorted((x, j, r) for j, r in enumerate(mine) if (x := (
                r.get("request_throughput") if r["request_rate"] == BURST
                else r["request_rate"])) is not None)
            if not points:
                continue
            xs = [x for x, _, _ in points]
            ax.plot(xs, [r["tpot_ms_p50"] for *_, r in points], "o-", color=f"C{i}", label=config)
            twin.plot(xs, [r["ttft_ms_p99"] for *_, r in points], "s--", color=f"C{i}", alpha=0.6)
            for x, _, r in points:
                if r["request_rate"] == BURST:
                    ax.annotate("burst", (x, r["tpot_ms_p50"]), fontsize=7, color=f"C{i}")
        ax.set_title(workload)
        ax.set_xlabel("request rate (req/s; burst: achieved)")
        ax.set_ylabel("TPOT p50 (ms), solid")
        twin.set_ylabel("TTFT p99 (ms), dashed")
        twin.set_yscale("log")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


# --- The machine ------------------------------------------------------------------------


def provenance() -> dict[str, str]:
    found = {"python": platform.python_version(), "gpu": "unknown"}
    for name in ("vllm", "flashinfer-python", "torch", "vllm-cascade-plugin"):
        try:
            found[name.removesuffix("-python")] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name.removesuffix("-python")] = "not installed"
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # no CUDA context here
        found["gpu"] = ", ".join(sorted(set(subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
            text=True, timeout=30, check=True).stdout.splitlines()) - {""}))
    return found


def free_port(start: int) -> int:
    for port in range(start, start + 200):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind((HOST, port))
            return port
    raise RuntimeError(f"no free port in {start}..{start + 199}")


def missing_modules(workloads: list[Workload]) -> list[str]:
    """What the chosen workloads need beside vLLM: its custom dataset reads JSONL with pandas."""
    tree = any(w.kind == "tree" for w in workloads)
    return ["pandas"] if tree and importlib.util.find_spec("pandas") is None else []
