"""The FA3 executor's host side on the CPU: its level conversion, buffer choreography and merges.

FlashAttention 3 and vLLM's merge kernel need a Hopper GPU, so here they are replaced by plain
torch functions with the same signatures and conventions (varlen queries, a block table per
sequence, bottom-right causal mask, natural-log LSE ``[heads, tokens]``); what is tested is
everything the executor does around them: converting each level to block-table form, gathering
and scattering rows, choosing buffers so no merge writes what it reads, and keeping a level that
``is`` the previous plan's. The result is checked against per-request attention computed with no
plan (``dense_attention``). Decode steps run their per-request level in the plugin's own Triton
kernel (``decode_level``), here under Triton's CPU interpreter (``TRITON_INTERPRET=1``), whose
bf16 ``tl.dot`` is wrong: fused steps are tested in fp32 and fp16 here, bf16 on the GPU.
tests/gpu/test_kernels.py runs the same executor on the real kernels.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_planner import batches, limits, make_batch
from test_reference import TOLERANCE, dense_attention, kv_cache
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.execution import decode_level, fa3_levels, vllm_kernels
from vllm_cascade_plugin.execution.fa3 import FlashAttnCascadeExecutor
from vllm_cascade_plugin.graphs.capture import LayerGraphs
from vllm_cascade_plugin.planning.planner import CascadePlanner

CALLS: list[dict] = []


def fake_flash_attn_varlen_func(*, q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k,
                                max_seqlen_k, softmax_scale, causal, window_size, block_table,
                                softcap, return_softmax_lse, fa_version, q_descale=None,
                                k_descale=None, v_descale=None, s_aux=None):
    """FA3's varlen call with a block table, in plain torch (fp32 math). FP8 as FA3 takes it:
    q, K and V all e4m3, descales of shape (sequences, KV heads) multiplying each sequence's
    q, K and V per KV head, output bf16. ``s_aux``: attention sinks, one more softmax column
    per head with a zero value (the LSE over the keys alone)."""
    assert fa_version == 3 and return_softmax_lse and window_size == [-1, -1]
    assert cu_seqlens_q.dtype == seqused_k.dtype == block_table.dtype == torch.int32
    assert block_table.stride(-1) == 1 and out.is_contiguous()
    assert q.dtype == k.dtype == v.dtype, "FA3 takes q, K and V in one dtype"
    fp8 = q.dtype == torch.float8_e4m3fn
    assert (fp8 and out.dtype == torch.bfloat16) or (not fp8 and out.dtype == q.dtype)
    CALLS.append({"causal": causal, "rows": int(cu_seqlens_q[-1]), "fp8": fp8})
    num_heads, kv_heads = q.shape[1], k.shape[2]
    kv_head_of = torch.arange(num_heads) // (num_heads // kv_heads)
    lse = torch.empty(num_heads, q.shape[0], dtype=torch.float32)
    cu = cu_seqlens_q.tolist()
    ones = torch.ones(len(cu) - 1, kv_heads)
    descales = [ones if d is None else d for d in (q_descale, k_descale, v_descale)]
    assert all(d.shape == (len(cu) - 1, kv_heads) for d in descales)
    assert fp8 or (q_descale is None and k_descale is None and v_descale is None)
    assert max(b - a for a, b in itertools.pairwise(cu)) <= max_seqlen_q
    for s in range(len(cu) - 1):
        n_kv = int(seqused_k[s])
        assert n_kv <= max_seqlen_k
        if cu[s + 1] == cu[s]:  # no queries: FA3 runs no tile for it, nor reads its table
            continue
        pages = block_table[s, : -(-n_kv // k.shape[1])].long()
        q_d, k_d, v_d = (d[s, kv_head_of].float()[:, None] for d in descales)  # [H, 1]
        keys = k[pages].reshape(-1, kv_heads, k.shape[-1])[:n_kv, kv_head_of].float() * k_d
        values = v[pages].reshape(-1, kv_heads, v.shape[-1])[:n_kv, kv_head_of].float() * v_d
        rows = slice(cu[s], cu[s + 1])
        n_q = cu[s + 1] - cu[s]
        scores = torch.einsum("qhd,khd->hqk", q[rows].float() * q_d, keys) * softmax_scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if causal:  # bottom-right aligned, as FlashAttention documents
            future = torch.arange(n_kv)[None, :] > (torch.arange(n_q) + n_kv - n_q)[:, None]
            scores = scores.masked_fill(future, -math.inf)
        probs = torch.softmax(scores, -1)
        if s_aux is not None:
            sink_column = s_aux.float()[:, None, None].expand(-1, n_q, 1)
            probs = torch.softmax(torch.cat([scores, sink_column], -1), -1)[..., :-1]
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
        lse[:, rows] = torch.logsumexp(scores, -1)
    return out, lse


def fake_merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                           output_lse=None):
    """vLLM's merge_attn_states semantics (LSE ``[heads, tokens]``, natural log)."""
    for a in (prefix_output, prefix_lse, suffix_output, suffix_lse):  # no in-place aliasing
        assert a.data_ptr() != output.data_ptr()
        assert output_lse is None or a.data_ptr() != output_lse.data_ptr()
    p_lse, s_lse = prefix_lse.t()[..., None], suffix_lse.t()[..., None]
    top = torch.maximum(p_lse, s_lse)
    p_w, s_w = torch.exp(p_lse - top), torch.exp(s_lse - top)
    merged = (prefix_output.float() * p_w + suffix_output.float() * s_w) / (p_w + s_w)
    output.copy_(merged.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_((top + torch.log(p_w + s_w))[..., 0].t())


@pytest.fixture(autouse=True)
def fake_fa3(monkeypatch):
    monkeypatch.setattr(vllm_kernels, "fa3_kernels",
                        lambda: (fake_flash_attn_varlen_func, fake_merge_attn_states))
    CALLS.clear()


# The fused decode kernel runs here only under Triton's CPU interpreter (tests/conftest.py).
TRITON_ON_CPU = (os.environ.get("TRITON_INTERPRET") == "1"
                 and decode_level.unsupported_reason(4, 2, 64) is None)


def planned(plan, shape, executor=None, soft_cap=None, fused=True):
    num_heads, kv_heads, head_dim, dtype = shape
    executor = executor or FlashAttnCascadeExecutor("NHD", max_levels=4,
                                                            fused_decode=fused)
    executor.plan(plan, num_qo_heads=num_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                  page_size=plan.page_size, sm_scale=head_dim**-0.5, logits_soft_cap=soft_cap,
                  q_dtype=dtype, kv_dtype=dtype, device=torch.device("cpu"))
    return executor


@settings(max_examples=160, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_requests=6), limits=limits,
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       group_size=st.sampled_from([1, 4]), soft_cap=st.sampled_from([None, 5.0]),
       decode=st.booleans(), fused=st.booleans(), with_sinks=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fa3_executor_equals_per_request_attention(batch, limits, dtype, group_size, soft_cap,
                                                   decode, fused, with_sinks, seed):
    if decode:  # a decode step: one query per request (the fused kernel's case)
        batch = dataclasses.replace(batch, query_lens=np.minimum(batch.query_lens, 1))
    # The interpreter's bf16 dot is wrong (module docstring): bf16 runs unfused here.
    fused = fused and dtype != torch.bfloat16 and TRITON_ON_CPU
    plan = batch.plan(**{**limits, "max_levels": min(limits["max_levels"], 4)})
    if plan.stats.num_tokens == 0:
        return
    CALLS.clear()  # per example (the fixture runs once per test)
    kv_heads, head_dim = 2, 64
    k_cache, v_cache = kv_cache(batch.num_blocks, batch.page_size, kv_heads, head_dim, dtype, seed)
    qkv = torch.randn(plan.stats.num_tokens, group_size * kv_heads + 2, head_dim,
                      generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    q = qkv[:, : group_size * kv_heads]  # strided, like vLLM's view of the fused QKV output
    executor = planned(plan, (group_size * kv_heads, kv_heads, head_dim, dtype),
                       soft_cap=soft_cap, fused=fused)
    out = torch.full(q.shape, math.nan, dtype=dtype)
    sinks = (3 * torch.rand(group_size * kv_heads, generator=torch.Generator().manual_seed(seed))
             if with_sinks else None)  # gpt-oss's: one logit per query head
    executor.run(q, k_cache, v_cache, out, sinks=sinks)
    want, want_lse = dense_attention(batch, q, k_cache, v_cache, head_dim**-0.5, soft_cap, sinks)
    tol = {**TOLERANCE, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    torch.testing.assert_close(executor.lse, want_lse, atol=tol, rtol=tol)  # base 2, [T, H]
    one_query_each = bool((np.diff(plan.levels[-1].qo_indptr) == 1).all())
    if executor._step.fused_decode:  # FA3 for the shared levels only, the rest in Triton
        assert fused and one_query_each and plan.num_levels >= 2
        assert len(CALLS) == plan.num_levels - 1 and not any(c["causal"] for c in CALLS)
    else:
        assert not (fused and one_query_each and plan.num_levels >= 2)
        assert len(CALLS) == plan.num_levels and CALLS[0]["causal"]


def test_block_table_form_of_a_level():
    batch = make_batch([[5, 6, 7, 9], [5, 6, 7, 8], [3]], [60, 50, 10], [1, 1, 1], page_size=16)
    shared, own = batch.plan().levels
    assert shared.block_table().tolist() == [[5, 6, 7]]
    assert shared.kv_lens(16).tolist() == [48]
    assert own.block_table().tolist() == [[9], [8], [3]]
    assert own.kv_lens(16).tolist() == [12, 2, 10]


def test_a_level_the_next_plan_keeps_is_not_uploaded_again(monkeypatch):
    planner = CascadePlanner()
    table = np.array([[1, 2, 3, 10, 0], [1, 2, 3, 11, 0]], np.int32)
    plan = planner.plan(table, np.array([50, 50], np.int32), np.ones(2, np.int32), 16)
    shape = (4, 2, 64, torch.float32)
    executor = planned(plan, shape)
    first = executor._levels
    uploads = []
    real = fa3_levels.upload
    monkeypatch.setattr(fa3_levels, "upload",
                        lambda a, d, device: uploads.append(a.size) or real(a, d, device))
    plan2 = planner.plan(table, np.array([51, 51], np.int32), np.ones(2, np.int32), 16)
    assert plan2.levels[0] is plan.levels[0]
    planned(plan2, shape, executor)
    assert executor._levels[0] is first[0]  # the shared level's device tensors are kept
    assert executor._levels[1] is not first[1]
    own = plan2.levels[1]
    sizes = (len(own.qo_indptr), own.num_groups, own.block_table().size)
    assert uploads == [sum(n + -n % 4 for n in sizes)]  # each array padded to 16 bytes


def test_run_before_plan_and_hnd_are_refused():
    with pytest.raises(RuntimeError, match="NHD"):
        FlashAttnCascadeExecutor("HND")
    executor = FlashAttnCascadeExecutor("NHD")
    with pytest.raises(RuntimeError, match="before plan"):
        executor.run(torch.zeros(1, 1, 64), torch.zeros(1, 16, 1, 64), torch.zeros(1, 16, 1, 64),
                     torch.zeros(1, 1, 64))


@pytest.mark.flashinfer  # vllm_cascade_plugin.execution.kernels imports the FlashInfer executor
def test_auto_takes_fa3_where_it_runs_and_flashinfer_elsewhere(monkeypatch):
    from vllm_cascade_plugin.execution import kernels

    assert kernels.choose_kernel("auto", "NHD")[0] == "fa3"
    assert kernels.choose_kernel("flashinfer", "NHD")[0] == "flashinfer"
    kind, line = kernels.choose_kernel("fa3", "HND")
    assert kind == "flashinfer" and "HND" in line

    def unsupported():
        raise RuntimeError("FlashAttention 3 is not supported here (needs sm90)")

    monkeypatch.setattr(vllm_kernels, "fa3_kernels", unsupported)
    kind, line = kernels.choose_kernel("auto", "NHD")
    assert kind == "flashinfer" and "needs sm90" in line
    with pytest.raises(ValueError, match="unknown cascade kernel"):
        kernels.choose_kernel("triton", "NHD")


def test_two_identity_merges_alternate_buffers_and_end_in_out():
    """A system prompt for all rows, then two documents for contiguous halves: both shared levels
    read the queries as they are, so the state moves out -> spare -> out."""
    table = [[1, 2, 3, 4, 10], [1, 2, 3, 4, 11], [1, 2, 5, 6, 12], [1, 2, 5, 6, 13]]
    batch = make_batch(table, [70, 75, 66, 79], [1, 1, 1, 1], page_size=16)
    plan = batch.plan(max_levels=3)
    assert plan.num_levels == 3 and all(level.q_is_identity for level in plan.levels)
    k_cache, v_cache = kv_cache(batch.num_blocks, 16, 2, 64, torch.float32, seed=3)
    q = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(4))
    executor = planned(plan, (4, 2, 64, torch.float32), fused=False)
    assert executor._step.spare is not None and not executor._step.start_in_spare
    out = torch.full(q.shape, math.nan)
    executor.run(q, k_cache, v_cache, out)
    want, _ = dense_attention(batch, q, k_cache, v_cache, 64**-0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def replaying_capture(fn):
    """A stand-in for a CUDA graph: a replay runs the captured closure again, with the very
    step (level views, sizes) and tensors it captured, which is what a graph re-reads from the
    addresses it baked in; its result is the captured tensor, rewritten."""
    result = fn()

    def replay():
        return result.copy_(fn())

    return replay, result


def steady_decode_steps(interleaved: bool, steps: int):
    """(table, seq_lens) of ``steps`` consecutive decode steps of 6 requests on 1 or 2 prefixes,
    each request one token longer per step; own pages preallocated, so some requests move onto
    a new page on the way (the per-request block table widens)."""
    prefixes = [[1, 2, 3], [4, 5, 6, 7]] if interleaved else [[1, 2, 3]]
    table = []
    seq_lens = []
    for r in range(6):
        prefix = prefixes[r % len(prefixes)]
        table.append([*prefix, 20 + 3 * r, 21 + 3 * r, 22 + 3 * r])
        seq_lens.append(16 * len(prefix) + 12 + r)  # rows 4 and 5 cross a page boundary
    for s in range(steps):
        yield table, [n + s for n in seq_lens]


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs Triton (its CPU interpreter)")
@pytest.mark.parametrize("covered", [6, 5], ids=["every_row", "one_row_unshared"])
def test_a_fused_step_whose_shared_level_reorders_every_row_merges_nothing(monkeypatch, covered):
    """Interleaved groups that cover every row: the shared level attends in group order and
    scatters back (no zeroed state to merge with); with a row outside every group the merge
    path runs. Both equal per-request attention."""
    heads, kv_heads, d = 4, 2, 64
    table, seq_lens = next(steady_decode_steps(True, 1))
    if covered < 6:
        table[5] = [30, 31, 32, *table[5][3:]]  # its own first pages: in no group
    batch = make_batch(table, seq_lens, [1] * 6, page_size=16)
    plan = CascadePlanner().plan(batch.block_table, batch.seq_lens, batch.query_lens, 16)
    assert plan.num_levels == 2 and not plan.levels[0].q_is_identity
    assert int(plan.levels[0].qo_indptr[-1]) == covered
    executor = planned(plan, (heads, kv_heads, d, torch.float32))
    merges = []
    monkeypatch.setattr(executor, "_merge", lambda *a, **k: merges.append(a) or
                        fake_merge_attn_states(*a, **k))
    k_cache, v_cache = kv_cache(48, 16, kv_heads, d, torch.float32, seed=3)
    q = torch.randn(6, heads, d, generator=torch.Generator().manual_seed(4))
    out = torch.full(q.shape, math.nan)
    executor.run(q, k_cache, v_cache, out)
    want, want_lse = dense_attention(batch, q, k_cache, v_cache, d**-0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(executor.lse, want_lse, atol=1e-5, rtol=1e-5)
    assert len(merges) == (0 if covered == 6 else 1)


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs Triton (its CPU interpreter)")
@pytest.mark.parametrize("interleaved", [False, True], ids=["one_prefix", "interleaved"])
def test_graphed_decode_steps_replay_with_each_steps_metadata(interleaved):
    """Steady decode through the graph path: after the cache's one eager run, each layer is
    captured the first time its layout comes and replayed after, and every step still equals
    per-request attention with that step's lengths (a replay that read a stale or
    fresh-per-step buffer would not)."""
    steps, layers, heads, kv_heads, d = 7, 2, 4, 2, 64
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=True)
    executor.graphs.capture = replaying_capture
    planner = CascadePlanner()
    gen = torch.Generator().manual_seed(5)
    caches = [kv_cache(48, 16, kv_heads, d, torch.float32, seed=10 + i) for i in range(layers)]
    # One q and one out per layer for the whole run: vLLM's static graph buffers.
    qkvs = [torch.empty(6, heads + 2, d) for _ in range(layers)]
    outs = [torch.empty(6, heads, d) for _ in range(layers)]
    for table, seq_lens in steady_decode_steps(interleaved, steps):
        batch = make_batch(table, seq_lens, [1] * 6, page_size=16)
        plan = planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, 16)
        assert plan.num_levels == 2 and plan.levels[0].q_is_identity is not interleaved
        planned(plan, (heads, kv_heads, d, torch.float32), executor)
        assert executor._step.graph_key is not None
        for qkv, out, (k_cache, v_cache) in zip(qkvs, outs, caches, strict=True):
            qkv.copy_(torch.randn(qkv.shape, generator=gen))
            q = qkv[:, :heads]
            out.fill_(math.nan)
            executor.run(q, k_cache, v_cache, out)
            want, want_lse = dense_attention(batch, q, k_cache, v_cache, d**-0.5)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(executor.lse, want_lse, atol=1e-5, rtol=1e-5)
    # One layout throughout (block tables padded to GRAPH_PAGE_BUCKET pages): one eager run,
    # one capture per layer, every other layer call a replay.
    assert executor.graphs.captures == layers
    assert executor.graphs.replays == layers * steps - layers - 1


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs Triton (its CPU interpreter)")
def test_a_failed_capture_runs_eagerly_and_warns_once(caplog):
    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=True)
    executor.graphs.capture = broken
    planner = CascadePlanner()
    k_cache, v_cache = kv_cache(48, 16, 2, 64, torch.float32, seed=1)
    q = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(2))
    out = torch.empty(6, 4, 64)
    with caplog.at_level(logging.WARNING, logger="vllm.cascade_plugin"):
        for table, seq_lens in steady_decode_steps(False, 5):
            batch = make_batch(table, seq_lens, [1] * 6, page_size=16)
            planned(planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, 16),
                    (4, 2, 64, torch.float32), executor)
            out.fill_(math.nan)
            executor.run(q, k_cache, v_cache, out)
            want, _ = dense_attention(batch, q, k_cache, v_cache, 64**-0.5)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    warnings = [r for r in caplog.records if "capturing a CUDA graph" in r.getMessage()]
    assert len(warnings) == 1 and "operation not permitted" in warnings[0].getMessage()
    assert executor.graphs.captures == 0 and not executor.graphs.usable(torch.device("cpu"))
    assert executor._step.graph_key is None  # later steps plan eagerly


def test_graph_cache_captures_on_the_nth_sighting_and_evicts_the_least_recently_replayed():
    graphs = LayerGraphs(capture=replaying_capture, capture_after=2, max_graphs=2)
    counted = stats.snapshot()
    runs = []

    def layer(name):
        return lambda: runs.append(name) or torch.zeros(1)

    graphs.run(("a",), layer("a"))  # 1st sighting: eager
    assert (graphs.captures, len(graphs)) == (0, 0)
    graphs.run(("a",), layer("a"))  # 2nd: captured (the stand-in runs it once)
    graphs.run(("a",), layer("a"))  # replay
    assert (graphs.captures, graphs.replays, len(graphs)) == (1, 1, 1)
    for _ in range(2):
        graphs.run(("b",), layer("b"))
    graphs.run(("a",), layer("a"))  # a replayed after b was captured: b is the older now
    assert len(graphs) == 2 and graphs.replays == 2
    for _ in range(2):
        graphs.run(("c",), layer("c"))  # full: b (least recently replayed) goes, c captured
    assert len(graphs) == 2 and graphs.captures == 3 and graphs.evictions == 1
    now = stats.snapshot()  # the counters (and /metrics) see each capture and its time
    assert now.graph_captures - counted.graph_captures == 3
    assert now.graph_capture_s > counted.graph_capture_s
    graphs.run(("a",), layer("a"))  # a survived: replayed
    assert graphs.replays == 3
    graphs.run(("b",), layer("b"))  # b was evicted: eager again
    assert runs.count("b") == 3 and graphs.replays == 3


def test_the_first_graph_of_a_cache_waits_for_one_eager_run():
    """capture_after=1 captures a key the first time it comes, except the cache's very first
    run, which is eager (lazy initialisation outside any capture)."""
    graphs = LayerGraphs(capture=replaying_capture, capture_after=1)
    runs = []
    for key in ("a", "b", "a"):
        graphs.run((key,), lambda key=key: runs.append(key) or torch.zeros(1))
    assert runs == ["a", "b", "a"]  # eager a, captured b (run once), captured a
    assert (graphs.captures, graphs.replays) == (2, 0)
    graphs.run(("a",), lambda: runs.append("x") or torch.zeros(1))
    assert graphs.replays == 1


def test_non_decode_steps_and_graphs_off_run_eagerly():
    table = [[1, 2, 3, 10], [1, 2, 3, 11]]
    prefill = make_batch(table, [60, 60], [5, 5], page_size=16).plan()
    decode = make_batch(table, [60, 60], [1, 1], page_size=16).plan()
    shape = (4, 2, 64, torch.float32)
    graphed = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=True)
    graphed.graphs.capture = replaying_capture
    assert planned(prefill, shape, graphed)._step.graph_key is None
    assert (planned(decode, shape, graphed)._step.graph_key is not None) is TRITON_ON_CPU
    assert planned(decode, shape, fused=True)._step.graph_key is None  # cuda_graphs=False
    # Without a stand-in, graphs need a CUDA device.
    assert not LayerGraphs().usable(torch.device("cpu"))


def test_inside_another_capture_the_layer_runs_its_kernels(monkeypatch):
    """While the stream is being captured by someone else (a whole-step graph), a layer neither
    replays nor captures a graph of its own: its kernels go into that capture."""
    graphs = LayerGraphs(capture_after=1)
    runs = []
    replays = []
    graphs._graphs[("k",)] = lambda: replays.append(1) or torch.zeros(1)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    graphs.run(("k",), lambda: runs.append("k") or torch.zeros(1))
    graphs.run(("new",), lambda: runs.append("new") or torch.zeros(1))
    assert runs == ["k", "new"] and not replays
    assert (graphs.captures, graphs.replays, len(graphs)) == (0, 0, 1)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    graphs.run(("k",), lambda: runs.append("k") or torch.zeros(1))
    assert replays == [1] and graphs.replays == 1


def churning_decode_steps(steps: int):
    """(table, seq_lens) of decode steps on two interleaved prefixes while requests come and go:
    5 to 7 rows, a row without any shared page in some steps, rows reordered."""
    rng = np.random.default_rng(7)
    prefixes = [[1, 2, 3], [4, 5, 6, 7]]
    for s in range(steps):
        rows = int(rng.integers(5, 8))
        table, seq_lens = [], []
        for r in range(rows):
            if r == rows - 1 and s % 2:
                table.append([40 + s, 41 + s, 42 + s, 43 + s])  # its own prompt: no sharing
                seq_lens.append(60 + s)
                continue
            prefix = prefixes[int(rng.integers(0, 2))]
            own = int(rng.integers(2, 20))
            table.append([*prefix, 20 + 3 * r, 21 + 3 * r])
            seq_lens.append(16 * len(prefix) + own)
        yield table, seq_lens


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs Triton (its CPU interpreter)")
def test_graphed_steps_of_a_changing_batch_replay_one_layout_per_padded_size():
    """Requests arrive, finish and change places every step: each step runs padded to 8 rows
    (vLLM's capture size), its real rows equal per-request attention, and steps whose bucketed
    layout is the same replay the same graphs: the number of captures is the number of
    layouts, not of steps."""
    from vllm_cascade_plugin.planning import graph_layout

    heads, kv_heads, d, padded, layers, steps = 4, 2, 64, 8, 2, 12
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=True)
    executor.graphs.capture = replaying_capture
    planner = CascadePlanner()
    gen = torch.Generator().manual_seed(5)
    caches = [kv_cache(64, 16, kv_heads, d, torch.float32, seed=10 + i) for i in range(layers)]
    qkvs = [torch.empty(padded, heads + 2, d) for _ in range(layers)]
    outs = [torch.empty(padded, heads, d) for _ in range(layers)]
    layouts = set()
    for table, seq_lens in churning_decode_steps(steps):
        rows = len(table)
        batch = make_batch(table, seq_lens, [1] * rows, page_size=16)
        plan = planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, 16)
        assert plan.num_levels == 2
        layouts.add(graph_layout.graph_shape(plan, padded))
        executor.plan(plan, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                      page_size=16, sm_scale=d**-0.5, logits_soft_cap=None,
                      q_dtype=torch.float32, kv_dtype=torch.float32,
                      device=torch.device("cpu"), padded_rows=padded)
        assert executor.rows == padded and executor._step.graph_key is not None
        for qkv, out, (k_cache, v_cache) in zip(qkvs, outs, caches, strict=True):
            qkv.copy_(torch.randn(qkv.shape, generator=gen))
            q = qkv[:, :heads]
            out.fill_(math.nan)
            executor.run(q, k_cache, v_cache, out)
            want, want_lse = dense_attention(batch, q[:rows], k_cache, v_cache, d**-0.5)
            torch.testing.assert_close(out[:rows], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(executor.lse[:rows], want_lse, atol=1e-5, rtol=1e-5)
            assert torch.isfinite(out).all()  # the padded rows too: nothing NaN leaks out
    assert len(layouts) < steps  # the batches differ every step, their layouts do not
    # Every layer call was the cache's one eager run, a layout's first (captured) or a replay.
    assert executor.graphs.captures <= layers * len(layouts)
    assert 1 + executor.graphs.captures + executor.graphs.replays == layers * steps


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs Triton (its CPU interpreter)")
def test_a_step_with_shorter_rows_replays_the_graph_of_a_wider_one_and_reads_only_its_pages():
    """A step whose rows need a narrower per-request table than an earlier step of the same
    layout is laid out as wide (``graph_layout.BOOK``) and replays that step's graphs; its rows
    still equal per-request attention (the extra columns, never read, hold zeros, and block 0's
    KV here is NaN: a row that read one would show it)."""
    heads, kv_heads, d, padded, layers = 4, 2, 64, 8, 2
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=True)
    executor.graphs.capture = replaying_capture
    gen = torch.Generator().manual_seed(3)
    caches = [kv_cache(96, 16, kv_heads, d, torch.float32, seed=20 + i) for i in range(layers)]
    for k_cache, v_cache in caches:
        k_cache[0], v_cache[0] = math.nan, math.nan
    qkvs = [torch.empty(padded, heads + 2, d) for _ in range(layers)]
    outs = [torch.empty(padded, heads, d) for _ in range(layers)]
    prefixes = [[1, 2, 3], [4, 5, 6]]
    keys = []
    for own_pages in ([40, 2, 3, 2], [2, 3, 1, 4], [2, 3, 1, 4], [40, 2, 3, 2]):
        table, seq_lens, page = [], [], 10
        for r, own in enumerate(own_pages):
            table.append([*prefixes[r % 2], *range(page, page + own)])
            page += own
            seq_lens.append(16 * (3 + own - 1) + 5)
        batch = make_batch(table, seq_lens, [1] * 4, page_size=16)
        plan = CascadePlanner().plan(batch.block_table, batch.seq_lens, batch.query_lens, 16)
        executor.plan(plan, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                      page_size=16, sm_scale=d**-0.5, logits_soft_cap=None,
                      q_dtype=torch.float32, kv_dtype=torch.float32,
                      device=torch.device("cpu"), padded_rows=padded)
        keys.append(executor._step.graph_key)
        for qkv, out, (k_cache, v_cache) in zip(qkvs, outs, caches, strict=True):
            qkv.copy_(torch.randn(qkv.shape, generator=gen))
            q = qkv[:, :heads]
            executor.run(q, k_cache, v_cache, out)
            want, want_lse = dense_attention(batch, q[:4], k_cache, v_cache, d**-0.5)
            torch.testing.assert_close(out[:4], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(executor.lse[:4], want_lse, atol=1e-5, rtol=1e-5)
    assert len(set(keys)) == 1  # one layout for all four steps
    # The cache's one eager run, one capture per layer, every other layer call a replay.
    assert executor.graphs.captures == layers
    assert executor.graphs.replays == 4 * layers - layers - 1


def shrinking_decode_steps(sizes):
    """(table, seq_lens) of decode steps whose batch has ``sizes[i]`` rows at step ``i``: GRPO
    groups on two prefixes, the rows that finish dropping off the end, every row one token
    longer per step."""
    prefixes = [[1, 2, 3], [4, 5, 6, 7]]
    for step, rows in enumerate(sizes):
        table = [[*prefixes[r % 2], 20 + 3 * r, 21 + 3 * r] for r in range(rows)]
        yield table, [16 * len(prefixes[r % 2]) + 2 + r + step for r in range(rows)]


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs Triton (its CPU interpreter)")
def test_steps_above_vllms_largest_capture_size_run_without_graphs_and_smaller_ones_replay():
    """Above the largest capture size (here 8) vLLM neither pads a step nor runs its graphs:
    graphs keyed by the exact row count would be captured anew nearly every step of a batch
    that shrinks a row at a time. Such steps run eagerly (no graph key: no whole-step graph
    either), as the step session says (``graphable``), and still equal per-request attention;
    below it, steps padded to 8 capture once per layout and replay."""
    from vllm_cascade_plugin.config import CascadeConfig
    from vllm_cascade_plugin.planning.cost import AttentionShape
    from vllm_cascade_plugin.step import StepSession

    heads, kv_heads, d, layers = 4, 2, 64, 2
    session = StepSession()
    session.configure(CascadeConfig(enabled=True), AttentionShape(heads, kv_heads, d, 4), 16,
                      None, capture_sizes=(1, 2, 4, 8))
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=True)
    executor.graphs.capture = replaying_capture
    planner = CascadePlanner()
    gen = torch.Generator().manual_seed(9)
    caches = [kv_cache(64, 16, kv_heads, d, torch.float32, seed=20 + i) for i in range(layers)]
    # vLLM's static buffers, one per layer, sliced to the step's (padded) tokens.
    qs = [torch.empty(16, heads, d) for _ in range(layers)]
    outs = [torch.empty(16, heads, d) for _ in range(layers)]
    counts = {}
    for phase, sizes in (("above", [14, 13, 12, 11, 10, 9]), ("below", [8, 8, 7, 7, 6, 6])):
        for table, seq_lens in shrinking_decode_steps(sizes):
            rows = len(table)
            batch = make_batch(table, seq_lens, [1] * rows, page_size=16)
            plan = planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, 16)
            padded = session.padded(rows)  # vLLM's tensors: padded below 8, exact above
            executor.plan(plan, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                          page_size=16, sm_scale=d**-0.5, logits_soft_cap=None,
                          q_dtype=torch.float32, kv_dtype=torch.float32,
                          device=torch.device("cpu"), padded_rows=padded,
                          graphs=session.graphable(rows))
            assert (executor._step.graph_key is None) is (phase == "above")
            assert executor.rows == padded
            for (k_cache, v_cache), q_buffer, out_buffer in zip(caches, qs, outs, strict=True):
                q, out = q_buffer[:padded], out_buffer[:padded]
                q.copy_(torch.randn(padded, heads, d, generator=gen))
                out.fill_(math.nan)
                executor.run(q, k_cache, v_cache, out)
                want, _ = dense_attention(batch, q[:rows], k_cache, v_cache, d**-0.5)
                torch.testing.assert_close(out[:rows], want, atol=1e-5, rtol=1e-5)
        counts[phase] = (executor.graphs.captures, executor.graphs.replays)
    assert counts["above"] == (0, 0)
    captures, replays = (b - a for a, b in zip(counts["above"], counts["below"], strict=True))
    assert 0 < captures < replays  # per layout, not per step


def test_a_graphed_step_refuses_query_rows_it_was_not_planned_for():
    table = [[1, 2, 3, 10], [1, 2, 3, 11]]
    plan = make_batch(table, [60, 60], [1, 1], page_size=16).plan()
    executor = planned(plan, (4, 2, 64, torch.float32))
    with pytest.raises(ValueError, match="planned for 2 query rows"):
        executor.run(torch.zeros(3, 4, 64), torch.zeros(16, 16, 2, 64),
                     torch.zeros(16, 16, 2, 64), torch.zeros(3, 4, 64))


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs Triton (its CPU interpreter)")
@pytest.mark.parametrize("graph_rows", [0, 32])
def test_a_batch_growing_to_the_largest_capture_size_keeps_the_graph_keys_of_smaller_ones(
        graph_rows):
    """A graphed step's buffers are allocated for vLLM's largest capture size at once: after a
    step padded to 32 rows, a step padded to 8 with the same layout has the key it had before
    (its graphs replay). Not told the largest size, the buffers grow and the key changes."""
    heads, kv_heads, d = 4, 2, 64
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=True)
    executor.graph_rows = graph_rows
    executor.graphs.capture = replaying_capture
    planner = CascadePlanner()

    def key(rows: int, padded: int):
        table = [[1, 2, 3, 10 + 2 * r, 11 + 2 * r] for r in range(rows)]
        batch = make_batch(table, [16 * 4 + 1] * rows, [1] * rows, page_size=16)
        plan = planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, 16)
        executor.plan(plan, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                      page_size=16, sm_scale=d**-0.5, logits_soft_cap=None,
                      q_dtype=torch.float32, kv_dtype=torch.float32,
                      device=torch.device("cpu"), padded_rows=padded)
        assert executor._step.graph_key is not None
        return executor._step.graph_key

    small = key(6, 8)
    key(30, 32)
    assert (key(6, 8) == small) is (graph_rows == 32)


def test_an_eager_step_of_many_tokens_between_graphed_ones_keeps_their_graph_key():
    """A prefill step runs eagerly with buffers for all its tokens, beyond the graphed steps'
    reserve; the graphed steps' buffers are their own, so the next decode step of the same
    layout has the key it had before (its graphs replay)."""
    heads, kv_heads, d = 4, 2, 64
    executor = FlashAttnCascadeExecutor("NHD", max_levels=4, cuda_graphs=True)
    executor.graph_rows = 8
    executor.graphs.capture = replaying_capture
    planner = CascadePlanner()
    table = [[1, 2, 3, 10 + 2 * r, 11 + 2 * r, 40 + 2 * r, 41 + 2 * r] for r in range(6)]

    def step(seq: int, query: int):
        batch = make_batch(table, [seq] * 6, [query] * 6, page_size=16)
        plan = planner.plan(batch.block_table, batch.seq_lens, batch.query_lens, 16)
        executor.plan(plan, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                      page_size=16, sm_scale=d**-0.5, logits_soft_cap=None,
                      q_dtype=torch.float32, kv_dtype=torch.float32,
                      device=torch.device("cpu"), padded_rows=8)
        return executor._step.graph_key

    decode = step(16 * 4 + 1, 1)
    assert decode is not None
    assert step(16 * 4 + 40, 40) is None  # 240 query tokens: eager, beyond the reserve of 8
    assert step(16 * 4 + 1, 1) == decode
