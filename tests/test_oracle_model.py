"""The engine oracle's model (tests/oracle_model.py) has teeth: proven on the CPU with plain torch.

The engine tests' shape, shrunk: a shared 256-token prefix (16 pages of 16 tokens) and eight
requests with 16 tokens of their own each, 24 greedy tokens. The prefix is prefilled once, as
vLLM's prefix cache does; every request then reads its K/V. A one-page KV error is what a plan
with a shifted page id does: the prefix's page ``p`` read as page ``p + 1`` (its K/V replaced by
the neighbour's, RoPE and all). Each run is teacher-forced on the clean run's greedy tokens, so
every position is scored; the engine rule (``agreement.measure``, up to each request's first
diverging token) is applied to the same runs.

Attention runs as a bf16 GPU kernel computes it, emulated in float32: bf16 Q/K/V (vLLM's cache
dtype), FlashAttention's online softmax over key tiles with P rounded to bf16 before P @ V, the
output rounded to bf16; logits rounded to bf16 before the log-softmax (vLLM's logprobs are
computed from the model's bf16 logits). Two tilings (128 and 48 keys) are two correct kernels
that differ only in rounding; a float32 kernel without rounding is a third.
"""

from __future__ import annotations

import copy
import inspect
import math

import numpy as np
import pytest
import torch

import oracle_model
from vllm_cascade_plugin.face import agreement

PREFIX, SUFFIX, REQUESTS, GENERATED = 256, 16, 8, 24
PAGES = (0, 7, 14)  # first, middle and last-but-one page of the prefix (page 15's neighbour
# would be a request's own page)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def flash_attention(tile: int, rounded: bool = True):
    """A transformers attention function: FlashAttention's algorithm, with bf16 rounding where
    the GPU kernels round (``rounded``) or none. Causal, bottom-right aligned (the queries are
    the last positions of the keys), no padding; a layer given a ``sliding_window`` W (as
    transformers passes it) reads the last W keys of each query, its own included."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               sliding_window=None, **kwargs):
        del module, attention_mask, dropout, kwargs
        heads, n_q, n_k = query.shape[1], query.shape[2], key.shape[2]
        q = _bf16(query)
        k = _bf16(key).repeat_interleave(heads // key.shape[1], 1)
        v = _bf16(value).repeat_interleave(heads // value.shape[1], 1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        q_pos = torch.arange(n_q)[:, None] + (n_k - n_q)
        shape = (*query.shape[:3], 1)
        row_max, row_sum = torch.full(shape, -math.inf), torch.zeros(shape)
        acc = torch.zeros((*query.shape[:3], v.shape[-1]))
        for start in range(0, n_k, tile):
            logits = (q @ k[:, :, start:start + tile].transpose(-1, -2)) * scale
            k_pos = torch.arange(start, min(n_k, start + tile))[None, :]
            masked = k_pos > q_pos
            if sliding_window is not None:
                masked = masked | (k_pos <= q_pos - sliding_window)
            logits = logits.masked_fill(masked, -math.inf)
            new_max = torch.maximum(row_max, logits.amax(-1, keepdim=True))
            shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
            p = torch.exp(logits - shift)
            rescale = torch.where(torch.isfinite(row_max), torch.exp(row_max - shift),
                                  torch.zeros_like(row_max))
            row_sum = row_sum * rescale + p.sum(-1, keepdim=True)
            acc = acc * rescale + (_bf16(p) if rounded else p) @ v[:, :, start:start + tile]
            row_max = new_max
        out = acc / row_sum
        return (_bf16(out) if rounded else out).transpose(1, 2).contiguous(), None

    return attend


KERNELS = {"oracle_tile128": flash_attention(128), "oracle_tile48": flash_attention(48),
           "oracle_fp32": flash_attention(1 << 30, rounded=False)}


def _forward(model, ids: torch.Tensor, cache=None, **kwargs):
    """(logits, cache): transformers 5.24 calls the cache ``cache``, earlier 5.x
    ``past_key_values``."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"
    out = model(ids, use_cache=True, **({name: cache} if cache is not None else {}), **kwargs)
    return out.logits, getattr(out, name)


def _prefix_cache(model, prefix: list[int]):
    return _forward(model, torch.tensor([prefix]), logits_to_keep=1)[1]


def _shift_page(cache, page: int):
    """The cache as a plan with page ``page``'s id shifted by one reads it: the next page's K/V
    (already rotated to the next page's positions) in its place."""
    cache = copy.deepcopy(cache)
    rows = slice(page * oracle_model.PAGE_SIZE, (page + 1) * oracle_model.PAGE_SIZE)
    neighbour = slice((page + 1) * oracle_model.PAGE_SIZE, (page + 2) * oracle_model.PAGE_SIZE)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t[:, :, rows] = t[:, :, neighbour].clone()
    return cache


def _batched(cache, n: int):
    cache = copy.deepcopy(cache)
    cache.batch_repeat_interleave(n)
    return cache


def _greedy(model, cache, suffixes: list[list[int]], n: int,
            batched=_batched) -> list[list[int]]:
    """``n`` greedy tokens after each suffix, from ``cache`` (one request's prefix) copied per
    suffix by ``batched``."""
    cache = batched(cache, len(suffixes))
    logits, cache = _forward(model, torch.tensor(suffixes), cache, logits_to_keep=1)
    out = []
    for _ in range(n):
        token = logits[:, -1].argmax(-1)
        out.append(token)
        logits, cache = _forward(model, token[:, None], cache)
    return torch.stack(out, 1).tolist()


def scores(logits: torch.Tensor) -> dict:
    """Logits rounded to bf16 (vLLM's logprobs come from bf16 logits) and their log-softmax."""
    logits = _bf16(logits)
    return {"logits": logits, "logprobs": torch.log_softmax(logits, -1)}


def scored_last(model, ids: torch.Tensor, generated: int) -> dict:
    """Teacher-forced over whole sequences ``ids``: :func:`scores` of the positions that chose
    their last ``generated`` tokens."""
    n = ids.shape[1]
    return scores(model(ids).logits[:, n - generated - 1:n - 1].float())


def _scored(model, cache, suffixes: list[list[int]], generated: list[list[int]]) -> dict:
    """Teacher-forced: each generated position's bf16 logits and log-softmax."""
    ids = torch.tensor([s + g for s, g in zip(suffixes, generated, strict=True)])
    logits, _ = _forward(model, ids, _batched(cache, len(suffixes)))
    return scores(logits[:, SUFFIX - 1:SUFFIX - 1 + GENERATED])


def records(run: dict) -> list[dict]:
    """The run as :func:`agreement.record` would have it (greedy: the argmax is the token)."""
    top2 = run["logprobs"].topk(2, -1)
    return [{"tokens": [*top2.indices[r, :, 0].tolist(), -1],
             "logprobs": [*top2.values[r, :, 0].tolist(), 0.0],
             "margins": [*(top2.values[r, :, 0] - top2.values[r, :, 1]).tolist(), 0.0]}
            for r in range(top2.indices.shape[0])]


def teacher_forced_delta(run: dict, reference: dict) -> float:
    """Mean |Δ logprob of the reference's chosen token| where the reference's margin > 0.1."""
    top2 = reference["logprobs"].topk(2, -1)
    chosen = top2.indices[..., :1]
    delta = (reference["logprobs"].gather(-1, chosen) - run["logprobs"].gather(-1, chosen))[..., 0]
    return float(delta.abs()[top2.values[..., 0] - top2.values[..., 1] > agreement.MARGIN].mean())


def greedy_ids(model, prefix: int, suffix: int, requests: int, generated: int) -> torch.Tensor:
    """``requests`` prompts of a shared random ``prefix`` and ``suffix`` tokens of their own
    (seeded), each with ``generated`` greedy tokens by ``model``'s attention as set."""
    rng = np.random.default_rng(0)
    shared = rng.integers(100, 31900, prefix).tolist()
    ids = torch.tensor([shared + rng.integers(100, 31900, suffix).tolist()
                        for _ in range(requests)])
    ids = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=generated, min_new_tokens=generated, pad_token_id=0)
    assert ids.shape[1] == prefix + suffix + generated
    return ids


def assert_far_beyond_kernels(broken: dict, reference: dict, kernel: dict) -> None:
    """``broken`` moves ``reference``'s chosen-token logprobs by ten tolerances and by twenty
    times what ``kernel`` (a second correct kernel) does, and the engine rule fails it."""
    kernels = agreement.measure(records(kernel), records(reference))
    moved = teacher_forced_delta(broken, reference)
    assert moved >= 10 * agreement.MEAN_TOL, moved
    assert moved >= 20 * teacher_forced_delta(kernel, reference)
    assert not agreement.agrees_with_reference(
        agreement.measure(records(broken), records(reference)), kernels)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from transformers import AttentionInterface, LlamaForCausalLM

    for name, attend in KERNELS.items():
        AttentionInterface.register(name, attend)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    # The saved model, as the GPU tests load it (bf16 weights, computed here in float32).
    model = LlamaForCausalLM.from_pretrained(
        oracle_model.save(tmp_path_factory.mktemp("oracle-model"))).float().eval()
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size")
    assert {k: getattr(model.config, k) for k in shape} == \
        {k: oracle_model.CONFIG[k] for k in shape}
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 31900, PREFIX).tolist()
    suffixes = [rng.integers(100, 31900, SUFFIX).tolist() for _ in range(REQUESTS)]
    out: dict = {}
    with torch.no_grad():
        for name in KERNELS:
            model.set_attn_implementation(name)
            cache = _prefix_cache(model, prefix)
            if name == "oracle_tile128":
                generated = _greedy(model, cache, suffixes, GENERATED)
                for page in PAGES:
                    out[page] = _scored(model, _shift_page(cache, page), suffixes, generated)
            out[name] = _scored(model, cache, suffixes, generated)
    return out


def test_the_comparison_covers_most_positions(runs):
    """The top-2 margin exceeds 0.1 at most positions, and two correct kernels compared by the
    engine rule cover more than half of them (the std-0.02 model: a few percent)."""
    reference = runs["oracle_tile128"]
    top2 = reference["logprobs"].topk(2, -1).values
    assert float((top2[..., 0] - top2[..., 1] > agreement.MARGIN).float().mean()) >= 0.75
    dev = agreement.measure(records(runs["oracle_tile48"]), records(reference))
    assert dev.fraction >= 0.6, dev


def test_two_correct_kernels_agree_well_within_the_tolerance(runs):
    reference = records(runs["oracle_tile128"])
    for other in ("oracle_tile48", "oracle_fp32"):
        dev = agreement.measure(records(runs[other]), reference)
        assert dev.mean <= agreement.MEAN_TOL / 2, (other, dev)
        assert dev.worst <= agreement.MAX_TOL / 2, (other, dev)
        assert agreement.agrees_with_reference(dev, dev), (other, dev)


def test_the_top_logit_stays_small_so_one_bf16_rounding_flip_is_small(runs):
    top = runs["oracle_tile128"]["logits"].amax(-1)
    assert float(top.abs().max()) < 8.0  # one bf16 step of a logit below 8: at most 1/32


@pytest.mark.parametrize("page", PAGES)
def test_a_one_page_kv_error_moves_the_logprobs_ten_tolerances(runs, page):
    # The engine rule rejects it too (it diverges at once, or the compared tokens are far off).
    assert_far_beyond_kernels(runs[page], runs["oracle_tile128"], runs["oracle_tile48"])
