"""The GPU cascade executors (FlashInfer and FA3) against FlashInfer's own flat attention on
random paged caches.

Tolerance: q, k and v are N(0, 1) and sm_scale = 1/sqrt(head_dim), so the logits are N(0, 1),
and every query below attends to at least 256 keys: each output is a wide average with |o| < 1
(at most 0.61 in a CPU dry run of these cases). The flat kernel rounds the exact value
to bf16 once; the cascade rounds each level's output to bf16, merges in fp32 and rounds again,
which moves the value before the last rounding by well under one ulp. The two therefore differ
by at most one bf16 ulp, 2^-8 ~ 3.9e-3 for |o| in [0.5, 1): ``TOL = 4e-3``. A wrong page moves
outputs by ~0.4 (``test_a_corrupted_plan_fails_the_comparison``). LSEs are fp32 (base 2, ~9
here) from different summation orders: ``LSE_TOL = 1e-3``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flashinfer
import numpy as np
import pytest
import torch

from vllm_cascade_plugin.execution.kernels import (
    KERNELS,
    FlashAttnCascadeExecutor,
    fa3_unsupported_reason,
    make_executor,
    unsupported_reason,
)
from vllm_cascade_plugin.execution.reference import run_plan
from vllm_cascade_plugin.planning.planner import CascadePlan, plan_cascade

PAGE = 16
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")
TOL = 4e-3
LSE_TOL = 1e-3
TEETH = 0.05
LAYERS = 2  # one plan, several layers: scratch buffers and the LSE buffer are reused


@dataclass(frozen=True)
class Shape:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


@dataclass(frozen=True)
class Batch:
    block_table: np.ndarray  # int32 [R, max_pages], 0-padded
    seq_lens: np.ndarray  # int32 [R]
    query_lens: np.ndarray  # int32 [R]
    num_blocks: int  # pages in the cache; more than the batch uses

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())

    @property
    def is_decode(self) -> bool:
        return bool((self.query_lens == 1).all())

    def flat_indptrs(self) -> tuple[torch.Tensor, ...]:
        """Flat attention's CPU int32 qo_indptr, kv_page_indptr, indices and last_page_len."""
        pages = -(-self.seq_lens // PAGE)
        indices = np.concatenate([row[:n] for row, n in zip(self.block_table, pages, strict=True)])
        arrays = (
            np.concatenate([[0], np.cumsum(self.query_lens)]),
            np.concatenate([[0], np.cumsum(pages)]),
            indices,
            self.seq_lens - (pages - 1) * PAGE,
        )
        return tuple(torch.from_numpy(a.astype(np.int32)) for a in arrays)


class Pages:
    """Builds a batch: hands out page ids, then scatters them over a larger cache as vLLM's block
    pool would, never using block 0 (vLLM's padding block)."""

    def __init__(self) -> None:
        self._next = 0
        self._rows: list[tuple[list[int], int, int]] = []

    def new(self, n: int) -> list[int]:
        self._next += n
        return list(range(self._next - n, self._next))

    def add(self, shared: list[int], seq_len: int, query_len: int = 1) -> None:
        """A request holding ``shared`` pages first, then new pages up to ``seq_len`` tokens."""
        own = -(-seq_len // PAGE) - len(shared)
        self._rows.append((shared + self.new(own), seq_len, query_len))

    def build(self, rng: np.random.Generator) -> Batch:
        num_blocks = self._next + 64
        physical = rng.permutation(np.arange(1, num_blocks - 1))[: self._next]
        table = np.zeros((len(self._rows), max(len(p) for p, _, _ in self._rows)), np.int32)
        for r, (pages, _, _) in enumerate(self._rows):
            table[r, : len(pages)] = physical[pages]
        return Batch(
            block_table=table,
            seq_lens=np.array([s for _, s, _ in self._rows], np.int32),
            query_lens=np.array([q for _, _, q in self._rows], np.int32),
            num_blocks=num_blocks,
        )


def one_shared_prefix(rng: np.random.Generator) -> Batch:
    pages = Pages()
    prefix = pages.new(32)
    for _ in range(8):
        pages.add(prefix, 32 * PAGE + int(rng.integers(1, 80)))
    return pages.build(rng)


def four_interleaved_groups(rng: np.random.Generator) -> Batch:
    pages = Pages()
    prefixes = [pages.new(n) for n in (16, 20, 18, 30)]
    for r in range(16):  # row r joins group r % 4: every group needs a gather
        prefix = prefixes[r % 4]
        pages.add(prefix, len(prefix) * PAGE + int(rng.integers(1, 50)))
    return pages.build(rng)


def two_level_tree(rng: np.random.Generator) -> Batch:
    pages = Pages()
    system = pages.new(8)
    documents = [system + pages.new(n) for n in (10, 16, 8)]
    for r in range(9):
        document = documents[r % 3]
        pages.add(document, len(document) * PAGE + int(rng.integers(1, 40)))
    return pages.build(rng)


def sampling_siblings(rng: np.random.Generator) -> Batch:
    """n=4 samples of two prompts: children share the prompt's full pages and each own a copy of
    its partial last page."""
    pages = Pages()
    for prompt_len in (260, 333):
        prompt = pages.new(prompt_len // PAGE)
        for _ in range(4):
            pages.add(prompt, prompt_len + int(rng.integers(1, 40)))
    return pages.build(rng)


def prefill_chunks_and_decodes(rng: np.random.Generator) -> Batch:
    """vLLM order (decodes first): three decodes on a system prompt, one decode sharing nothing,
    a first prefill chunk after a prefix-cache hit and a second chunk of another request."""
    pages = Pages()
    system = pages.new(16)
    for own in rng.integers(1, 60, size=3):
        pages.add(system, 16 * PAGE + int(own))
    pages.add([], 300)
    pages.add(system, 16 * PAGE + 37, query_len=37)
    pages.add(system, 16 * PAGE + 50 + 40, query_len=40)
    return pages.build(rng)


SCENARIOS: dict[str, tuple[Callable[[np.random.Generator], Batch], int]] = {
    # name: (batch builder, levels the plan must have)
    "one_shared_prefix": (one_shared_prefix, 2),
    "four_interleaved_groups": (four_interleaved_groups, 2),
    "two_level_tree": (two_level_tree, 3),
    "sampling_siblings": (sampling_siblings, 2),
    "prefill_chunks_and_decodes": (prefill_chunks_and_decodes, 2),
}
HEADS = pytest.mark.parametrize(("num_qo_heads", "num_kv_heads"), [(32, 8), (8, 2), (4, 1)],
                                ids=["32q8kv", "8q2kv", "4q1kv"])
HEAD_DIMS = pytest.mark.parametrize("head_dim", [128, 64], ids=["d128", "d64"])


@dataclass(frozen=True)
class Layer:
    q: torch.Tensor  # [tokens, Hq, D], a strided view like vLLM's split of the fused QKV output
    k: torch.Tensor  # [num_blocks, PAGE, Hkv, D] K half of a packed [.., 2 * D] cache (vLLM 0.26)
    v: torch.Tensor  # its V half

    @property
    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


def random_layer(batch: Batch, shape: Shape, seed: int) -> Layer:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    hq, hkv, d = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    qkv = torch.randn(batch.num_tokens, hq + 2 * hkv, d, generator=gen, device=DEVICE, dtype=DTYPE)
    packed = torch.randn(batch.num_blocks, PAGE, hkv, 2 * d, generator=gen, device=DEVICE,
                         dtype=DTYPE)
    k, v = packed.split(d, dim=-1)
    return Layer(q=qkv[:, :hq], k=k, v=v)


def planned_executor(workspace: torch.Tensor, plan: CascadePlan, shape: Shape,
                     kernel: str) -> Any:
    if kernel == "fa3_unfused":  # decode steps too through FA3 + merge, not decode_level
        executor: Any = FlashAttnCascadeExecutor("NHD", max_levels=4, fused_decode=False)
    else:
        executor = make_executor(kernel, workspace, "NHD", max_levels=4)
    executor.plan(plan, num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
                  head_dim=shape.head_dim, page_size=PAGE, sm_scale=shape.sm_scale,
                  logits_soft_cap=None, q_dtype=DTYPE, kv_dtype=DTYPE,
                  device=DEVICE)
    return executor


def run_executor(executor: Any, layer: Layer) -> torch.Tensor:
    # NaN-filled: a row the executor fails to write fails the comparison.
    out = torch.full(layer.q.shape, math.nan, dtype=DTYPE, device=DEVICE)
    executor.run(layer.q, layer.k, layer.v, out)
    return out


def flat_prefill(workspace: torch.Tensor, batch: Batch,
                 shape: Shape) -> flashinfer.BatchPrefillWithPagedKVCacheWrapper:
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(*batch.flat_indptrs(), shape.num_qo_heads, shape.num_kv_heads, shape.head_dim,
                 PAGE, causal=True, sm_scale=shape.sm_scale, q_data_type=DTYPE,
                 kv_data_type=DTYPE)
    return wrapper


def flat_decode(workspace: torch.Tensor, batch: Batch,
                shape: Shape) -> flashinfer.BatchDecodeWithPagedKVCacheWrapper:
    # Tensor cores, as vLLM builds its decode wrapper; FlashInfer 0.6 runs that on FA2, a kernel
    # family independent of the FA3 prefill kernels the executor uses on Hopper.
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                             use_tensor_cores=True)
    _, *paged = batch.flat_indptrs()
    wrapper.plan(*paged, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, PAGE,
                 q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=shape.sm_scale)
    return wrapper


def plan_for(batch: Batch) -> CascadePlan:
    return plan_cascade(batch.block_table, batch.seq_lens, batch.query_lens, PAGE)


@pytest.fixture(params=(*KERNELS, "fa3_unfused"))
def kernel(request: pytest.FixtureRequest) -> str:
    """Each executor the plugin can run (CASCADE_KERNEL); FA3 only where it runs (Hopper).
    ``fa3`` runs decode steps' per-request level in the Triton kernel ``decode_level``,
    ``fa3_unfused`` in FA3 like every other step."""
    if request.param.startswith("fa3") and (reason := fa3_unsupported_reason("NHD")):
        pytest.skip(reason)
    return str(request.param)


@pytest.fixture(scope="module")
def workspace() -> torch.Tensor:
    return torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=DEVICE)


@pytest.fixture(scope="module")
def results() -> Iterator[list[dict[str, Any]]]:
    """Per-comparison records, written to $CASCADE_RESULTS_DIR/kernel_correctness.json if set
    (``kernel_correctness.<worker>.json`` under pytest-xdist)."""
    records: list[dict[str, Any]] = []
    yield records
    if out_dir := os.environ.get("CASCADE_RESULTS_DIR"):
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        path = Path(out_dir) / f"kernel_correctness{'.' + worker if worker else ''}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "flashinfer": flashinfer.__version__,
            "dtype": str(DTYPE),
            "cases": records,
        }
        path.write_text(json.dumps(report, indent=2))


def max_abs_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float().to(got.device)).abs().max().item()


def check_close(results: list[dict[str, Any]], name: str, got: torch.Tensor, want: torch.Tensor,
                tol: float) -> None:
    err = max_abs_err(got, want)
    ok = err <= tol  # False for NaN
    results.append({"name": name, "max_abs_err": err, "tol": tol,
                    "outcome": "pass" if ok else "fail"})
    assert ok, f"{name}: max abs error {err:.3g} > {tol}"


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each ``|x|`` (8 significant bits): ``2^(floor(log2 |x|) - 7)``."""
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(2.0 ** -126))) - 7)


def check_close_ulp(results: list[dict[str, Any]], name: str, got: torch.Tensor,
                    want: torch.Tensor, tol: float) -> None:
    """:func:`check_close` for outputs that may reach ``|o| >= 1`` (queries over fewer than a
    hundred keys): each element within ``tol`` or one bf16 ulp at the reference's value,
    whichever is larger, since two kernels that each round the same exact value once differ by
    at most one ulp at its magnitude (2^-7 for ``|o|`` in [1, 2)). A wrong page still moves
    outputs by ~0.4."""
    diff = (got.float() - want.float().to(got.device)).abs()
    allowed = torch.clamp(bf16_ulp(want.to(got.device)), min=tol)
    worst = (diff / allowed).flatten()
    i = int(torch.nan_to_num(worst, nan=math.inf).argmax())
    err, limit = float(diff.flatten()[i]), float(allowed.flatten()[i])
    ok = bool((diff <= allowed).all())  # False for NaN
    results.append({"name": name, "max_abs_err": float(diff.max()), "tol": limit,
                    "worst_element": {"error": err, "allowed": limit,
                                      "reference": float(want.flatten()[i])},
                    "outcome": "pass" if ok else "fail"})
    assert ok, (f"{name}: error {err:.3g} > {limit:.3g} allowed at a reference value "
                f"{float(want.flatten()[i]):.3g}")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@HEADS
@HEAD_DIMS
def test_cascade_matches_flat_flashinfer_attention(
    scenario: str, num_qo_heads: int, num_kv_heads: int, head_dim: int, kernel: str,
    workspace: torch.Tensor, results: list[dict[str, Any]], request: pytest.FixtureRequest,
) -> None:
    build, levels = SCENARIOS[scenario]
    shape = Shape(num_qo_heads, num_kv_heads, head_dim)
    batch = build(np.random.default_rng(0))
    plan = plan_for(batch)
    assert plan.num_levels == levels, "the planner did not find the sharing this case tests"

    executor = planned_executor(workspace, plan, shape, kernel)
    if kernel == "fa3":  # decode steps take the fused kernel, others FA3 throughout
        assert executor._step.fused_decode == batch.is_decode
    prefill = flat_prefill(workspace, batch, shape)
    decode = flat_decode(workspace, batch, shape) if batch.is_decode else None
    for seed in range(LAYERS):
        layer = random_layer(batch, shape, seed)
        got = run_executor(executor, layer)
        name = f"{request.node.name}/layer{seed}"
        want, want_lse = prefill.run(layer.q, layer.kv, return_lse=True)
        check_close(results, f"{name}/flat-prefill", got, want, TOL)
        check_close(results, f"{name}/flat-prefill-lse", executor.lse, want_lse, LSE_TOL)
        if decode is not None:
            check_close(results, f"{name}/flat-decode", got, decode.run(layer.q, layer.kv), TOL)


def test_cascade_matches_the_fp32_reference(
    kernel: str, workspace: torch.Tensor, results: list[dict[str, Any]],
    request: pytest.FixtureRequest,
) -> None:
    shape = Shape(8, 2, 64)
    batch = two_level_tree(np.random.default_rng(1))
    plan = plan_for(batch)
    assert plan.num_levels == 3  # the deepest plan: two gathered shared levels
    layer = random_layer(batch, shape, seed=7)
    executor = planned_executor(workspace, plan, shape, kernel)
    got = run_executor(executor, layer)
    # fp32 on the CPU from the very bf16 values the kernels read: its own error is ~1e-6.
    want, want_lse = run_plan(plan, layer.q.float().cpu(), layer.k.float().cpu(),
                              layer.v.float().cpu(), sm_scale=shape.sm_scale)
    check_close(results, f"{request.node.name}/out", got, want, TOL)
    check_close(results, f"{request.node.name}/lse", executor.lse, want_lse, LSE_TOL)


@pytest.mark.parametrize("level", [0, 1], ids=["shared", "own"])
def test_a_corrupted_plan_fails_the_comparison(
    level: int, kernel: str, workspace: torch.Tensor, results: list[dict[str, Any]],
    request: pytest.FixtureRequest,
) -> None:
    shape = Shape(32, 8, 128)
    batch = one_shared_prefix(np.random.default_rng(2))
    plan = plan_for(batch)
    assert plan.num_levels == 2
    bad = plan.levels[level]
    # Every page id of one level + 1: still inside the cache (Pages leaves spare blocks), wrong
    # pages; level 1 is the per-request level (decode_level's, for the fused FA3 executor).
    wrong = dataclasses.replace(bad, kv_page_indices=bad.kv_page_indices + 1)
    levels = list(plan.levels)
    levels[level] = wrong
    corrupted = dataclasses.replace(plan, levels=tuple(levels))
    layer = random_layer(batch, shape, seed=0)
    got = run_executor(planned_executor(workspace, corrupted, shape, kernel), layer)
    want = flat_prefill(workspace, batch, shape).run(layer.q, layer.kv)
    err = max_abs_err(got, want)
    ok = err > TEETH
    results.append({"name": request.node.name, "max_abs_err": err, "tol": TEETH,
                    "outcome": "pass" if ok else "fail"})
    assert ok, f"shifted shared pages moved the output by only {err:.3g}"


@HEADS
@HEAD_DIMS
def test_tested_shapes_are_supported(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> None:
    assert unsupported_reason(num_qo_heads, num_kv_heads, head_dim, DTYPE, DTYPE) is None


@pytest.mark.parametrize(("num_qo_heads", "num_kv_heads", "head_dim", "kv_dtype", "window_left"), [
    (32, 8, 96, DTYPE, -1),  # head_dim outside {64, 128, 256}
    (12, 8, 128, DTYPE, -1),  # not GQA
    (128, 8, 128, DTYPE, -1),  # merge block of 2048 threads
    (64, 8, 256, DTYPE, -1),  # merge block of 2048 threads
    (32, 8, 128, torch.float8_e4m3fn, -1),  # KV scales are not applied
    (32, 8, 128, DTYPE, 4096),  # sliding window is level-local
])
def test_unsupported_configurations_have_a_reason(
    num_qo_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, window_left: int,
) -> None:
    assert unsupported_reason(num_qo_heads, num_kv_heads, head_dim, DTYPE, kv_dtype,
                              window_left=window_left)


GRAPHED_STEPS = 6
GRAPHED_SCENARIOS = {  # name: prefix sizes in pages (a list per level path), requests
    "one_prefix": ([[32]], 8),
    "four_interleaved_groups": ([[16], [20], [18], [30]], 16),
    "two_level_tree": ([[8, 10], [8, 16], [8, 8]], 9),
    "two_groups_and_a_loner": ([[16], [20], []], 9),  # every third request shares nothing
}
GRAPH_PADDING = 5  # query rows beyond the batch's, as vLLM pads a step to a capture size


def growing_batch(scenario: str, rng: np.random.Generator) -> Batch:
    """Requests on shared prefixes (row r on path r % paths), each with more than
    GRAPHED_STEPS own tokens at the end, so every step of the run below keeps the same plan
    shape; the tree's paths share their first part (the system prompt)."""
    paths, requests = GRAPHED_SCENARIOS[scenario]
    pages = Pages()
    trunk: dict[int, list[int]] = {}
    built = []
    for path in paths:
        ids: list[int] = []
        for depth, n in enumerate(path):
            if depth == 0 and len(path) > 1:
                ids += trunk.setdefault(n, pages.new(n))
            else:
                ids += pages.new(n)
        built.append(ids)
    for r in range(requests):
        prefix = built[r % len(built)]
        pages.add(prefix, len(prefix) * PAGE + int(rng.integers(GRAPHED_STEPS + 1, 80)))
    return pages.build(rng)


@pytest.mark.parametrize("scenario", list(GRAPHED_SCENARIOS))
def test_graphed_decode_steps_match_flat_attention(
    scenario: str, workspace: torch.Tensor, results: list[dict[str, Any]],
    request: pytest.FixtureRequest,
) -> None:
    """Consecutive decode steps (each request one token longer) through the FA3 executor's CUDA
    graphs, padded by GRAPH_PADDING rows as vLLM pads a step: after the cache's one eager run,
    each layer is captured once and replayed after; every step's real rows equal flat attention
    with that step's lengths, and the padded rows (which read no page of their own) are finite.
    q and out are the same tensors every step, as vLLM's graph buffers are; their contents
    change. The loner scenario has rows in no group: the first level's KV-less group must give
    them FA3's empty state (output 0, LSE -inf)."""
    if reason := fa3_unsupported_reason("NHD"):
        pytest.skip(reason)
    shape = Shape(32, 8, 128)
    final = growing_batch(scenario, np.random.default_rng(3))
    rows = final.num_tokens
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=True)
    layers = [random_layer(final, shape, seed) for seed in range(LAYERS)]
    qs = [torch.empty(rows + GRAPH_PADDING, *layer.q.shape[1:], dtype=DTYPE, device=DEVICE)
          for layer in layers]
    outs = [torch.empty(q.shape, dtype=DTYPE, device=DEVICE) for q in qs]
    gen = torch.Generator(DEVICE).manual_seed(11)
    for s in range(GRAPHED_STEPS):
        batch = dataclasses.replace(final, seq_lens=final.seq_lens - (GRAPHED_STEPS - 1 - s))
        plan = plan_for(batch)
        executor.plan(plan, num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
                      head_dim=shape.head_dim, page_size=PAGE, sm_scale=shape.sm_scale,
                      logits_soft_cap=None, q_dtype=DTYPE, kv_dtype=DTYPE, device=DEVICE,
                      padded_rows=rows + GRAPH_PADDING)
        assert executor._step.graph_key is not None and executor.rows == rows + GRAPH_PADDING
        prefill = flat_prefill(workspace, batch, shape)
        for i, (layer, q, out) in enumerate(zip(layers, qs, outs, strict=True)):
            q.copy_(torch.randn(q.shape, generator=gen, device=DEVICE, dtype=DTYPE))
            out.fill_(math.nan)
            executor.run(q, layer.k, layer.v, out)
            want, want_lse = prefill.run(q[:rows], layer.kv, return_lse=True)
            name = f"{request.node.name}/step{s}/layer{i}"
            check_close(results, name, out[:rows], want, TOL)
            check_close(results, f"{name}-lse", executor.lse[:rows], want_lse, LSE_TOL)
            assert torch.isfinite(out).all(), name
    assert executor.graphs is not None
    assert executor.graphs.captures == LAYERS
    assert executor.graphs.replays == LAYERS * GRAPHED_STEPS - LAYERS - 1
