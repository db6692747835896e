"""What ``vllm-cascade demo`` runs: one shared-prefix workload, and its plan on the CPU.

The workload is a small retrieval-style tree: one system prompt shared by every request, a few
documents each shared by a group of questions, a short question per request. Without a GPU the
demo builds the block table vLLM's prefix cache would build for it (identical full blocks of
identical prefixes get one physical block), plans a decode step, runs the pure-torch reference
executor on the plan and on flat attention, and reports both. With a GPU it also runs vLLM itself
on the same prompts: plugin off and on, and plugin off on a second attention kernel
(:mod:`.demo_engine`).

No printing here: :mod:`vllm_cascade_plugin.face.cli` formats what these functions return.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import CascadeConfig
from ..planning.cost import AttentionShape, CostModel, Decision, cost_model_for, decide
from ..planning.plan import CascadePlan
from ..planning.planner import plan_cascade

KERNEL_NAMES = {"fa3": "FA3 (Hopper, CASCADE_KERNEL=auto)", "flashinfer": "FlashInfer"}
PAGE_SIZE = 16  # vLLM's default block size on CUDA, and the page size the cost model is fit on

# The model configurations shipped in examples/models (a test keeps them equal), so that the
# demo works from an installed wheel too. Random weights (:mod:`.demo_engine`): no download, no
# tokenizer.
MODELS: dict[str, dict[str, Any]] = {
    "llama-tiny": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
        "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 32000,
        "max_position_embeddings": 65536, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
}


@dataclass(frozen=True)
class Workload:
    """A system prompt, ``documents`` documents, ``questions`` questions about each."""

    system_tokens: int = 1024
    documents: int = 4
    document_tokens: int = 6144
    questions: int = 32
    question_tokens: int = 16
    max_tokens: int = 128

    @property
    def requests(self) -> int:
        return self.documents * self.questions

    @property
    def prompt_tokens(self) -> int:
        return self.system_tokens + self.document_tokens + self.question_tokens

    def prompts(self, vocab_size: int, seed: int = 0) -> list[list[int]]:
        """Token ids, grouped by document: the system prompt, a document, a question."""
        rng = np.random.default_rng(seed)

        def tokens(n: int) -> list[int]:
            return rng.integers(100, vocab_size - 100, size=n).tolist()

        system = tokens(self.system_tokens)
        documents = [tokens(self.document_tokens) for _ in range(self.documents)]
        return [system + document + tokens(self.question_tokens)
                for document in documents for _ in range(self.questions)]


def model_config(model: str) -> dict[str, Any]:
    """A shipped model's config by name, or the ``config.json`` of a model folder."""
    if model in MODELS:
        return MODELS[model]
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model!r} is neither a shipped model ({', '.join(MODELS)}) nor a "
                         "folder with a config.json")
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def attention_shape(config: dict[str, Any]) -> tuple[AttentionShape, int]:
    """The model's attention shape (bf16/fp16 KV cache) and its number of layers."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    layers = int(config["num_hidden_layers"])
    shape = AttentionShape(heads, int(config.get("num_key_value_heads", heads)), head_dim, 2,
                           num_layers=layers)
    return shape, layers


# ------------------------------------------------------------------------------- CPU: the plan


def prefix_cached_step(prompts: list[list[int]], generated: int,
                       page_size: int = PAGE_SIZE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decode step after ``generated`` tokens, with vLLM's prefix-cache block sharing.

    vLLM caches *full* blocks by a hash of all tokens up to the block's end, so requests whose
    prompts agree on a full block's whole prefix hold the same physical block; the partial last
    block and generated tokens are each request's own. Block 0 is vLLM's null block: ids start
    at 1. Returns ``block_table`` int32 ``[R, pages]``, ``seq_lens`` and ``query_lens`` (all 1).
    """
    cached: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent block, tokens) -> block
    rows: list[list[int]] = []
    next_id = 1
    seq_lens = np.array([len(p) + generated for p in prompts], dtype=np.int32)
    for prompt, seq_len in zip(prompts, seq_lens.tolist(), strict=True):
        row: list[int] = []
        full = len(prompt) // page_size
        for page in range(-(-seq_len // page_size)):
            key = (row[-1] if row else 0, tuple(prompt[page * page_size:(page + 1) * page_size]))
            if page < full and key in cached:
                row.append(cached[key])
                continue
            if page < full:
                cached[key] = next_id
            row.append(next_id)
            next_id += 1
        rows.append(row)
    table = np.zeros((len(rows), max(map(len, rows))), dtype=np.int32)
    for r, row in enumerate(rows):
        table[r, : len(row)] = row
    return table, seq_lens, np.ones(len(rows), dtype=np.int32)


@dataclass(frozen=True)
class NumericalCheck:
    heads: str  # the attention shape the check ran at
    max_abs_err: float  # |cascade - flat| over every output element
    max_lse_err: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs_err <= self.tolerance and self.max_lse_err <= self.tolerance


@dataclass(frozen=True)
class PlanDemo:
    workload: Workload
    model: str
    shape: AttentionShape
    layers: int
    generated: int  # tokens generated before the planned step
    plan: CascadePlan
    decision: Decision  # what CASCADE_POLICY=auto would do with this step
    check: NumericalCheck
    kernel: str = "fa3"  # the executor whose cost model decided (CASCADE_KERNEL on a Hopper GPU)
    cost_model: CostModel | None = None  # that model (None: the executor's default calibration)

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page over all layers (K and V)."""
        s = self.shape
        return 2 * PAGE_SIZE * s.num_kv_heads * s.head_dim * s.dtype_bytes * self.layers


# float32 on both sides: only the summation order differs (one softmax over a row's pages vs.
# one per level merged by log-sum-exp), worth ~1e-6 on outputs of magnitude ~1.
CHECK_TOLERANCE = 1e-4


def plan_demo(workload: Workload, model: str, config: CascadeConfig, seed: int = 0) -> PlanDemo:
    """Plan the workload's mid-generation decode step; check it with the reference executor.

    The check runs one KV head's group of query heads (the model's ratio), float32: every head
    is computed alike, so more heads would only cost time.
    """
    import torch

    from ..execution.reference import run_plan

    model_cfg = model_config(model)
    shape, layers = attention_shape(model_cfg)
    generated = workload.max_tokens // 2
    prompts = workload.prompts(int(model_cfg["vocab_size"]), seed)
    table, seq_lens, query_lens = prefix_cached_step(prompts, generated)
    plan = plan_cascade(table, seq_lens, query_lens, PAGE_SIZE, max_levels=config.max_levels,
                        min_shared_pages=config.min_shared_pages)
    flat = plan_cascade(table, seq_lens, query_lens, PAGE_SIZE, max_levels=2,
                        min_shared_pages=int(table.shape[1]) + 1)  # nothing shared: flat
    # The executor CASCADE_KERNEL picks on a Hopper GPU such as the H200 the model is fit on.
    kernel = "flashinfer" if config.kernel == "flashinfer" else "fa3"
    # With the FA3 executor's decode-step CUDA graphs (whole-step ones by default; the demo's
    # engine is one GPU) unless the knobs turn them off.
    cost_model = cost_model_for(kernel, config.cuda_graphs and config.fused_decode,
                                config.full_graphs)
    decision = decide(plan, shape, cost_model)

    group = shape.num_qo_heads // shape.num_kv_heads
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, int(table.max()) + 1, PAGE_SIZE, 1, shape.head_dim, generator=g)
    q = torch.randn(int(query_lens.sum()), group, shape.head_dim, generator=g)
    scale = shape.head_dim ** -0.5
    out_flat, lse_flat = run_plan(flat, q, cache[0], cache[1], sm_scale=scale)
    out, lse = run_plan(plan, q, cache[0], cache[1], sm_scale=scale)
    check = NumericalCheck(
        heads=f"{group} query heads on 1 KV head, head_dim {shape.head_dim}, float32",
        max_abs_err=float((out - out_flat).abs().max()),
        max_lse_err=float((lse - lse_flat).abs().max()),
        tolerance=CHECK_TOLERANCE)
    return PlanDemo(workload, model, shape, layers, generated, plan, decision, check, kernel,
                    cost_model)


# --------------------------------------------------------------------------------- reports


def _span(values: np.ndarray) -> str:
    low, high = int(values.min()), int(values.max())
    return f"{low}" if low == high else f"{low}-{high}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def describe_plan(demo: PlanDemo, config: CascadeConfig) -> list[str]:
    w, s, plan, check = demo.workload, demo.shape, demo.plan, demo.check
    flat, cascade = plan.stats.pages_flat, plan.stats.pages_cascade
    lines = [
        f"Workload: {w.requests} requests = {_count(w.documents, 'document')} x "
        f"{_count(w.questions, 'question')}; "
        f"each prompt is a {w.system_tokens}-token system prompt, a {w.document_tokens}-token "
        f"document and a {w.question_tokens}-token question; {w.max_tokens} tokens generated.",
        f"Plan of the decode step after {demo.generated} generated tokens, blocks shared as "
        f"vLLM's prefix cache shares them (page = {PAGE_SIZE} tokens; CASCADE_MAX_LEVELS="
        f"{config.max_levels}, CASCADE_MIN_SHARED_PAGES={config.min_shared_pages}):",
    ]
    for i, level in enumerate(plan.levels, start=1):
        pages = np.diff(level.kv_page_indptr)
        if level.causal:
            lines.append(f"  level {i}, per request: {level.num_groups} requests, "
                         f"{_span(pages)} pages each (their own tokens), causal")
        else:
            rows = np.diff(level.row_indptr)
            lines.append(f"  level {i}, shared: {_count(level.num_groups, 'group')} of "
                         f"{_span(rows)} requests, {_span(pages)} pages per group, read once "
                         "per group")
    gb = demo.page_bytes / 1e9
    model = demo.cost_model or cost_model_for(demo.kernel)
    lines += [
        f"KV pages read per layer: {flat:,} flat vs {cascade:,} with cascade "
        f"({flat / max(cascade, 1):.1f}x fewer)",
        f"KV bytes per decode step, {demo.model} ({demo.layers} layers, {s.num_kv_heads} KV "
        f"heads x {s.head_dim}, 16-bit): {flat * gb:.2f} GB flat vs {cascade * gb:.2f} GB cascade",
        f"Cost model of the {KERNEL_NAMES[demo.kernel]} executor (calibrated on an H200), per "
        f"layer call: flat {demo.decision.flat_us:.0f} us, cascade "
        f"{demo.decision.cascade_us:.0f} us (with its per-step cost, "
        f"{model.step_fixed_us / 1e3:.2f} ms, spread over {demo.layers} layers)",
        "  -> CASCADE_POLICY=auto runs this step " + (
            "as cascade" if demo.decision.use_cascade else "flat") +
        f" (cascade must win by {model.margin:.0%}); CASCADE_POLICY=always: as cascade.",
        f"Numerical check, reference executor ({check.heads}):",
        f"  cascade vs flat attention: max |d out| {check.max_abs_err:.1e}, max |d lse| "
        f"{check.max_lse_err:.1e}, tolerance {check.tolerance:.0e}: "
        + ("PASS" if check.passed else "FAIL"),
    ]
    return lines


def describe_gpu_run(workload: Workload, model: str, policy: str) -> list[str]:
    return [
        "No CUDA GPU here, so vLLM does not run. On a GPU, `vllm-cascade demo` runs this workload "
        f"in vLLM ({model}, random weights, no download), each engine in its own process: "
        f"plugin off, then on with CASCADE_POLICY={policy} (FLASHINFER), then plugin off on "
        "FLASH_ATTN. It prints both FLASHINFER throughputs "
        f"({workload.requests} requests x {workload.max_tokens} tokens, prefix cache warm), the "
        "share of steps that ran cascade, and whether the plugin's logprobs stay as close to "
        "plugin-off FLASHINFER's as two correct kernels' (FLASH_ATTN and FLASHINFER) do.",
    ]
