"""vLLM's real FlashInfer builder and impl (our subclasses) driven through build() and forward().

Everything is vLLM's own code path on a real VllmConfig except what cannot run without a GPU,
swapped at its call site: the Triton page-copy kernel and FlashInfer's wrappers of the parent's
flat path, and the cascade executor's FlashInfer kernels (replaced by the reference executor).
Outputs are compared with a plain dense softmax attention over the packed cache, written here.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

import vllm_cpu
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.execution import reference
from vllm_cascade_plugin.step import session

pytestmark = pytest.mark.flashinfer  # vLLM's FlashInfer backend, which imports FlashInfer

PAGE, HEADS, KV_HEADS, DIM, BLOCKS = 16, 8, 2, 128, 64
SCALE = DIM**-0.5
TOL = 1e-5  # fp32 end to end: summation order only


class ReferenceExecutor:
    """The GPU executor's plan()/run() interface over the pure-torch reference."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.plan_args = fail, None

    def plan(self, plan, **kwargs) -> None:
        self.plan_args = (plan, kwargs)

    @property
    def rows(self) -> int:  # query rows run() takes: the step's tokens (no padding here)
        return self.plan_args[0].stats.num_tokens

    def run(self, q, k_cache, v_cache, out) -> None:
        if self.fail:
            raise RuntimeError("injected kernel failure")
        plan, kw = self.plan_args
        o, _ = reference.run_plan(plan, q, k_cache, v_cache, sm_scale=kw["sm_scale"],
                                  logits_soft_cap=kw["logits_soft_cap"])
        out.copy_(o)


def fake_wrapper(cls):
    """A FlashInfer wrapper of the parent's flat path that plans nothing (its ctor needs CUDA)."""
    return object.__new__(type(f"Fake{cls.__name__}", (cls,), {"plan": lambda *a, **k: None}))


class CopyPageIndices:
    """CPU version of vLLM's Triton ``_copy_page_indices_kernel[(num_reqs,)](...)``."""

    def __getitem__(self, grid):
        def run(indices, block_table, stride, indptr, BLOCK_SIZE):
            for row in range(grid[0]):
                start, end = int(indptr[row]), int(indptr[row + 1])
                indices[start:end] = block_table[row, : end - start]
        return run


@pytest.fixture(autouse=True)
def restored_session():
    """Every builder made in a test registers with the process's session: forget them after."""
    saved = dict(vars(session))
    yield
    vars(session).update(saved)


def flat_path_on_cpu(monkeypatch):
    """vLLM's flat FlashInfer build() runs on a CPU (its GPU-only pieces swapped)."""
    import vllm.v1.attention.backends.flashinfer as fi

    monkeypatch.setattr(fi, "_copy_page_indices_kernel", CopyPageIndices())
    monkeypatch.setattr(fi, "fast_plan_decode", lambda wrapper, *a, **k: None)


def fake_wrappers(builder, monkeypatch):
    import vllm.v1.attention.backends.flashinfer as fi

    prefill = fake_wrapper(fi.BatchPrefillWithPagedKVCacheWrapper)
    decode = fake_wrapper(fi.BatchDecodeWithPagedKVCacheWrapper)
    monkeypatch.setattr(builder, "_get_prefill_wrapper", lambda *a, **k: prefill)
    monkeypatch.setattr(builder, "_get_decode_wrapper", lambda *a, **k: decode)


@pytest.fixture
def engine(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CASCADE_POLICY", "always")
    flat_path_on_cpu(monkeypatch)
    config = vllm_cpu.cpu_vllm_config(str(tmp_path_factory.mktemp("tiny")))
    names = vllm_cpu.make_layers(config, [SCALE, SCALE])
    stats.reset()
    saved = dict(vars(session))  # for modules that import this fixture
    builder = vllm_cpu.make_builder(config, names)
    fake_wrappers(builder, monkeypatch)
    layers = config.compilation_config.static_forward_context
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):  # as inside an engine step
        yield config, builder, [layers[n] for n in names]
    vars(session).update(saved)
    session.end_step()


def batch():
    """Decode rows first (vLLM's order): 4 rows share pages 11-15, two share nothing."""
    rng = np.random.default_rng(0)
    shared = np.arange(11, 16)
    rows, seq, q = [], [], []
    for i, (query, own, share) in enumerate([(1, 2, True), (1, 3, False), (1, 1, True),
                                             (1, 2, False), (5, 2, True), (20, 3, True)]):
        own_pages = 20 + 4 * i + np.arange(own)
        pages = np.concatenate([shared, own_pages]) if share else own_pages
        rows.append(pages)
        seq.append((len(pages) - 1) * PAGE + int(rng.integers(1, PAGE + 1)))
        q.append(query)
    table = np.zeros((len(rows), 16), dtype=np.int32)
    for r, pages in enumerate(rows):
        table[r, : len(pages)] = pages
    return table, np.array(seq, dtype=np.int32), np.array(q, dtype=np.int32)


def common_metadata(table, seq, q):
    """vLLM's CommonAttentionMetadata for a batch, with the CPU fields the installed release has:
    ``_seq_lens_cpu`` up to 0.29, ``req_idx`` (rows are requests 0..n-1 here) from 0.30."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(q)]).astype(np.int32))
    seq_t = torch.from_numpy(seq)
    cpu_fields = {"_seq_lens_cpu": seq_t, "req_idx": np.arange(len(q), dtype=np.int32)}
    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_t, num_reqs=len(q),
        num_actual_tokens=int(qsl[-1]), max_query_len=int(q.max()), max_seq_len=int(seq.max()),
        block_table_tensor=torch.from_numpy(table),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_t, **{k: v for k, v in cpu_fields.items() if k in names})


def packed_cache(generator):
    """A layer's KV cache as vLLM allocates it (0.26+): logical (B, H, N, 2D) over NHD memory,
    vLLM's default layout on Hopper."""
    memory = torch.randn(BLOCKS, PAGE, KV_HEADS, 2 * DIM, generator=generator)  # [B, N, H, 2D]
    return memory, memory.permute(0, 2, 1, 3)


def dense_attention(q, memory, table, seq, qlen):
    """Per-request causal softmax attention straight from the packed cache memory."""
    out, start = torch.empty_like(q), 0
    for r in range(len(seq)):
        pages = table[r, : -(-seq[r] // PAGE)]
        kv = memory[torch.from_numpy(pages.astype(np.int64))].reshape(-1, KV_HEADS, 2 * DIM)
        k, v = kv[: seq[r], :, :DIM], kv[: seq[r], :, DIM:]
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        qr = q[start: start + qlen[r]]
        logits = torch.einsum("qhd,khd->hqk", qr, k) * SCALE
        pos_q = torch.arange(seq[r] - qlen[r], seq[r])[:, None]
        logits = logits.masked_fill(torch.arange(seq[r])[None, :] > pos_q, float("-inf"))
        out[start: start + qlen[r]] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v)
        start += qlen[r]
    return out


def test_real_builder_and_impl_run_a_cascade_step_exactly(engine):
    _config, builder, layers = engine
    table, seq, q = batch()
    builder._cascade_executor = ReferenceExecutor()
    step = session.plan_step(table, seq, q)  # what the runner hook does before CUDA graphs
    assert step is not None and step.decision.use_cascade and step.plan.num_levels == 2
    metadata = builder.build(0, common_metadata(table, seq, q))
    assert metadata.cascade is builder._cascade_executor
    _plan, kwargs = metadata.cascade.plan_args
    assert kwargs["sm_scale"] == pytest.approx(SCALE) and kwargs["page_size"] == PAGE
    g = torch.Generator().manual_seed(1)
    tokens = int(q.sum())
    for layer in layers:
        memory, kv_cache = packed_cache(g)
        query = torch.randn(tokens + 3, HEADS, DIM, generator=g)  # +3: padded token rows
        output = torch.full_like(query, float("nan"))
        layer.impl.forward(layer, query, None, None, kv_cache, metadata, output)
        expected = dense_attention(query[:tokens], memory, table, seq, q)
        torch.testing.assert_close(output[:tokens], expected, atol=TOL, rtol=TOL)
    counters = stats.snapshot()
    assert counters.steps_cascade == 1 and counters.pages_cascade < counters.pages_flat


def test_a_layer_reuses_its_cache_views_until_its_cache_changes(engine):
    """The impl keeps each layer's K/V views across steps (host time); new contents of the same
    cache are read through them, and a new cache tensor gets new views."""
    _config, builder, layers = engine
    table, seq, q = batch()
    builder._cascade_executor = ReferenceExecutor()
    session.plan_step(table, seq, q)
    metadata = builder.build(0, common_metadata(table, seq, q))
    layer, g, tokens = layers[0], torch.Generator().manual_seed(2), int(q.sum())
    memory, kv_cache = packed_cache(g)
    views = []
    for new_cache in (False, False, True):
        if new_cache:
            memory, kv_cache = packed_cache(g)
        else:
            memory.copy_(torch.randn(memory.shape, generator=g))
        query = torch.randn(tokens, HEADS, DIM, generator=g)
        output = torch.full_like(query, float("nan"))
        layer.impl.forward(layer, query, None, None, kv_cache, metadata, output)
        expected = dense_attention(query, memory, table, seq, q)
        torch.testing.assert_close(output, expected, atol=TOL, rtol=TOL)
        views.append(layer.impl._cascade_kv_views[1])
    assert views[0] is views[1] and views[2] is not views[1]


def test_plan_for_another_batch_is_not_used(engine):
    _config, builder, _ = engine
    table, seq, q = batch()
    builder._cascade_executor = ReferenceExecutor()
    session.plan_step(table, seq, q)
    q2 = q.copy()
    q2[-1] -= 1
    metadata = builder.build(0, common_metadata(table, seq - (q - q2), q2))
    assert getattr(metadata, "cascade", None) is None
    assert stats.snapshot().fallbacks["plan does not match the batch"] == 1


def test_a_plan_for_other_sequence_lengths_runs_flat_and_is_counted(engine):
    """Same rows and tokens, one row a token longer than planned (an off-by-one between the
    hooks' view of the batch and vLLM's): the plan's pages would miss that token."""
    _config, builder, _ = engine
    table, seq, q = batch()
    builder._cascade_executor = ReferenceExecutor()
    session.plan_step(table, seq, q)
    longer = seq.copy()
    longer[2] += 1
    metadata = builder.build(0, common_metadata(table, longer, q))
    assert getattr(metadata, "cascade", None) is None
    assert builder._cascade_executor.plan_args is None
    assert stats.snapshot().fallbacks["plan does not match the batch"] == 1
    assert stats.snapshot().steps_cascade == 0


def test_the_builder_reads_sequence_lengths_from_host_memory_only(engine):
    """As on Model Runner V2: device sequence lengths (here on the meta device, which nothing
    can read) and no host copy but the CPU upper bound; the step still runs cascade."""
    _config, builder, _ = engine
    table, seq, q = batch()
    builder._cascade_executor = ReferenceExecutor()
    session.plan_step(table, seq, q)
    cm = common_metadata(table, seq, q)
    host_copy = {"_seq_lens_cpu": None} if hasattr(cm, "_seq_lens_cpu") else {}
    cm = dataclasses.replace(cm, seq_lens=torch.empty(len(seq), dtype=torch.int32,
                                                      device="meta"), **host_copy)
    metadata = builder.build(0, cm)
    assert metadata.cascade is builder._cascade_executor


def test_without_host_sequence_lengths_a_step_runs_flat_and_is_counted(engine):
    _config, builder, _ = engine
    table, seq, q = batch()
    builder._cascade_executor = ReferenceExecutor()
    session.plan_step(table, seq, q)
    cm = common_metadata(table, seq, q)
    host_copy = {"_seq_lens_cpu": None} if hasattr(cm, "_seq_lens_cpu") else {}
    metadata = builder.build(0, dataclasses.replace(cm, seq_lens_cpu_upper_bound=None,
                                                    **host_copy))
    assert getattr(metadata, "cascade", None) is None
    assert stats.snapshot().fallbacks["batch sequence lengths unknown"] == 1


@pytest.mark.parametrize("window_first", [False, True], ids=["full-first", "window-first"])
def test_sliding_window_layers_run_flat_and_full_attention_layers_cascade_in_one_kv_group(
        tmp_path, monkeypatch, window_first):
    """vLLM builds layers of one KV-cache group that differ in their window as attention groups
    of their own, each with a builder. Whichever builder comes first, steps are planned for the
    full-attention layers, their builder runs the plan, and the sliding-window builder (which
    cascade cannot serve) builds vLLM's flat metadata, with its window."""
    from vllm.config import set_current_vllm_config

    monkeypatch.setenv("CASCADE_ATTENTION", "1")
    monkeypatch.setenv("CASCADE_POLICY", "always")
    flat_path_on_cpu(monkeypatch)
    config = vllm_cpu.cpu_vllm_config(str(tmp_path))
    full_names = vllm_cpu.make_layers(config, [SCALE, SCALE])
    window_names = vllm_cpu.make_layers(config, [SCALE, SCALE], sliding_window=64)
    stats.reset()
    made = {}
    for kind in (["window", "full"] if window_first else ["full", "window"]):
        made[kind] = (vllm_cpu.make_builder(config, window_names, sliding_window=64)
                      if kind == "window" else vllm_cpu.make_builder(config, full_names))
    full, window = made["full"], made["window"]
    for builder in (full, window):
        fake_wrappers(builder, monkeypatch)
        builder._cascade_executor = ReferenceExecutor()
    assert window.window_left == 63 and full.window_left == -1
    table, seq, q = batch()
    with set_current_vllm_config(config):
        step = session.plan_step(table, seq, q)
        assert step is not None and step.decision.use_cascade
        cm = common_metadata(table, seq, q)
        window_metadata = window.build(0, cm)
        full_metadata = full.build(0, cm)
    assert getattr(window_metadata, "cascade", None) is None
    assert window_metadata.decode is not None and window_metadata.prefill is not None
    assert window._cascade_executor.plan_args is None
    assert full_metadata.cascade is full._cascade_executor
    counters = stats.snapshot()
    assert counters.steps_cascade == 1 and not counters.fallbacks


def test_kernel_failure_runs_the_layer_flat_and_logs_once(engine, monkeypatch, caplog):
    from vllm.v1.attention.backends.flashinfer import FlashInferImpl

    _config, builder, layers = engine
    table, seq, q = batch()
    builder._cascade_executor = ReferenceExecutor(fail=True)
    session.plan_step(table, seq, q)
    metadata = builder.build(0, common_metadata(table, seq, q))
    flat_calls = []
    monkeypatch.setattr(FlashInferImpl, "forward",
                        lambda self, *args, **kw: flat_calls.append(args) or args[-1])
    g = torch.Generator().manual_seed(2)
    with caplog.at_level(logging.WARNING, logger="vllm.cascade_plugin"):
        for layer in layers:
            _, kv_cache = packed_cache(g)
            query = torch.randn(int(q.sum()), HEADS, DIM, generator=g)
            output = torch.empty_like(query)
            layer.impl.forward(layer, query, None, None, kv_cache, metadata, output)
    assert len(flat_calls) == len(layers)
    assert stats.snapshot().fallbacks["kernel error"] == len(layers)
    assert sum("kernel error" in r.getMessage() for r in caplog.records) == 1


def _count_flat_builds(monkeypatch):
    """vLLM's own FlashInfer build() (our builder's parent), counted."""
    from vllm.v1.attention.backends.flashinfer import FlashInferMetadataBuilder

    calls, original = [], FlashInferMetadataBuilder.build
    monkeypatch.setattr(FlashInferMetadataBuilder, "build",
                        lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    return calls, original


# What vLLM's build() sets outside its flat plans; the deferred metadata must agree on them.
PLAIN_FIELDS = ("num_actual_tokens", "slot_mapping", "q_data_type_prefill", "q_data_type_decode",
                "num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens",
                "causal", "kv_cache_layout")


def test_a_cascade_step_builds_vllms_flat_metadata_only_for_a_layer_that_falls_back(
        engine, monkeypatch):
    """vLLM's flat build (its FlashInfer plans; on 0.26's Model Runner V2 a device-to-host copy
    of seq_lens that waits for the GPU's previous step) is skipped on a cascade step and run at
    most once, on first use, when layers fall back to flat attention."""
    from vllm.v1.attention.backends.flashinfer import FlashInferImpl, FlashInferMetadata

    from vllm_cascade_plugin.integration.flashinfer_backend import CascadeFlashInferMetadata

    _config, builder, layers = engine
    table, seq, q = batch()
    flat_builds, vllm_build = _count_flat_builds(monkeypatch)
    executor = builder._cascade_executor = ReferenceExecutor()
    session.plan_step(table, seq, q)
    cm = common_metadata(table, seq, q)
    metadata = builder.build(0, cm)
    g, tokens = torch.Generator().manual_seed(3), int(q.sum())
    for layer in layers:
        memory, kv_cache = packed_cache(g)
        query = torch.randn(tokens, HEADS, DIM, generator=g)
        output = torch.full_like(query, float("nan"))
        layer.impl.forward(layer, query, None, None, kv_cache, metadata, output)
        torch.testing.assert_close(output, dense_attention(query, memory, table, seq, q),
                                   atol=TOL, rtol=TOL)
    assert flat_builds == [] and metadata.prefill is None and metadata.decode is None
    reference = vllm_build(builder, 0, cm)  # vLLM's own metadata of the same batch
    for name in PLAIN_FIELDS:
        if hasattr(reference, name):
            assert getattr(metadata, name) is getattr(reference, name) or (
                getattr(metadata, name) == getattr(reference, name)), name
    assert (metadata.num_decodes, metadata.num_prefills) == (4, 2)  # batch(): 4 one-token rows

    # Next step, every layer's kernel fails: one flat build, shared by the layers.
    executor.fail = True
    session.plan_step(table, seq, q)
    metadata = builder.build(0, cm)
    assert isinstance(metadata, CascadeFlashInferMetadata) and flat_builds == []
    seen = []
    monkeypatch.setattr(FlashInferImpl, "forward",
                        lambda self, *args, **kw: seen.append(args[5]) or args[-1])
    for layer in layers:
        _, kv_cache = packed_cache(g)
        query = torch.randn(tokens, HEADS, DIM, generator=g)
        layer.impl.forward(layer, query, None, None, kv_cache, metadata, torch.empty_like(query))
    assert len(flat_builds) == 1 and len(seen) == len(layers) and seen[0] is seen[1]
    flat = seen[0]
    assert type(flat) is FlashInferMetadata and flat.decode is not None
    assert flat.prefill is not None  # vLLM planned both of its flat paths for the fallback


def test_without_a_known_metadata_layout_a_cascade_step_builds_vllms_metadata_at_once(
        engine, monkeypatch):
    """A vLLM release whose FlashInfer metadata has a required field we cannot fill: the flat
    build runs in build() as before, and the fallback uses that metadata itself."""
    from vllm_cascade_plugin.integration import compat

    _config, builder, _ = engine
    table, seq, q = batch()
    flat_builds, _ = _count_flat_builds(monkeypatch)
    monkeypatch.setattr(compat, "dataclass_values", lambda *a, **k: None)
    builder._cascade_executor = ReferenceExecutor()
    session.plan_step(table, seq, q)
    metadata = builder.build(0, common_metadata(table, seq, q))
    assert metadata.cascade is builder._cascade_executor and len(flat_builds) == 1
    assert metadata.flat_metadata() is metadata and metadata.decode is not None


def test_failing_to_fill_in_the_metadata_builds_vllms_at_once_and_warns_once(
        engine, monkeypatch, caplog):
    import vllm_cascade_plugin.integration.flashinfer_backend as backend

    _config, builder, _ = engine
    table, seq, q = batch()
    flat_builds, _ = _count_flat_builds(monkeypatch)

    def broken(*args, **kwargs):
        raise TypeError("an argument this release does not take")

    monkeypatch.setattr(backend, "split_decodes_and_prefills", broken)
    builder._cascade_executor = ReferenceExecutor()
    with caplog.at_level(logging.WARNING, logger="vllm.cascade_plugin"):
        for _ in range(2):
            session.plan_step(table, seq, q)
            metadata = builder.build(0, common_metadata(table, seq, q))
            assert metadata.cascade is builder._cascade_executor
    assert len(flat_builds) == 2 and stats.snapshot().steps_cascade == 2
    assert sum("filling in vLLM's FlashInfer metadata failed" in r.getMessage()
               for r in caplog.records) == 1


def test_dataclass_values_fill_known_and_lazy_fields_or_give_up():
    from vllm_cascade_plugin.integration.compat import dataclass_values

    @dataclasses.dataclass
    class Meta:
        a: int
        layout: str
        b: int = 2
        c: list = dataclasses.field(default_factory=list)
        d: int = dataclasses.field(default=0, init=False)

    assert dataclass_values(Meta, {"a": 1, "d": 5}, {"layout": lambda: "NHD"}) == {
        "a": 1, "layout": "NHD"}  # defaults stay the class's; init=False fields are skipped
    assert dataclass_values(Meta, {"a": 1, "b": 3, "layout": "HND"}) == {
        "a": 1, "b": 3, "layout": "HND"}
    assert dataclass_values(Meta, {"a": 1}) is None  # a required field nobody knows
    assert dataclass_values(Meta, {"a": 1}, {"layout": lambda: 1 / 0}) is None


def test_step_without_sharing_builds_plain_vllm_metadata(engine):
    _config, builder, _ = engine
    table, seq, q = batch()
    for k, row in enumerate([0, 2, 4, 5]):  # nobody shares the prefix pages any more
        table[row, :5] += 100 * (k + 1)
    builder._cascade_executor = ReferenceExecutor()
    step = session.plan_step(table, seq, q)
    assert step is not None and not step.decision.use_cascade
    metadata = builder.build(0, common_metadata(table, seq, q))
    assert getattr(metadata, "cascade", None) is None
    assert stats.snapshot().steps_cascade == 0


def test_builder_logs_which_kernels_run_and_falls_back_from_fa3_without_a_gpu(
        tmp_path, monkeypatch, caplog):
    from vllm_cascade_plugin.planning.cost import COST_MODELS

    monkeypatch.setenv("CASCADE_ATTENTION", "1")
    monkeypatch.setenv("CASCADE_KERNEL", "fa3")
    config = vllm_cpu.cpu_vllm_config(str(tmp_path))
    names = vllm_cpu.make_layers(config, [SCALE])
    with caplog.at_level(logging.INFO, logger="vllm.cascade_plugin"):
        builder = vllm_cpu.make_builder(config, names)
    assert builder._cascade_kernel == "flashinfer"  # no Hopper GPU here
    assert session.cost_model == COST_MODELS["flashinfer"]
    warned = [r for r in caplog.records if "cascade kernels: FlashInfer, because FlashAttention 3"
              " cannot run" in r.getMessage()]
    assert warned and warned[0].levelno == logging.WARNING


def test_a_failing_kernel_choice_does_not_stop_the_engine(tmp_path, monkeypatch, caplog):
    from vllm_cascade_plugin.execution import kernels

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setenv("CASCADE_ATTENTION", "1")
    monkeypatch.setattr(kernels, "choose_kernel", broken)
    config = vllm_cpu.cpu_vllm_config(str(tmp_path))
    names = vllm_cpu.make_layers(config, [SCALE])
    with caplog.at_level(logging.INFO, logger="vllm.cascade_plugin"):
        builder = vllm_cpu.make_builder(config, names)
    assert builder._cascade_kernel == "flashinfer"
    assert any("choosing them failed (RuntimeError: boom" in r.getMessage()
               for r in caplog.records)


def test_the_fused_decode_kernel_compiles_at_startup_on_a_gpu_only(tmp_path, monkeypatch,
                                                                    caplog):
    """With the FA3 executor chosen, the builder compiles decode_level once at startup on a GPU
    (not on a CPU device), and a failure there is a warning, not a stopped engine."""
    from vllm_cascade_plugin.execution import decode_level, kernels

    calls = []
    monkeypatch.setenv("CASCADE_ATTENTION", "1")
    monkeypatch.setattr(kernels, "choose_kernel", lambda requested, layout: ("fa3", "fa3"))
    monkeypatch.setattr(decode_level, "warm_up", lambda *args, **kwargs: calls.append(args))
    config = vllm_cpu.cpu_vllm_config(str(tmp_path))
    names = vllm_cpu.make_layers(config, [SCALE])
    builder = vllm_cpu.make_builder(config, names)
    assert builder._cascade_kernel == "fa3" and calls == []  # a CPU device: nothing to compile
    builder.device = torch.device("cuda")  # as on a GPU worker (no CUDA call is made here)
    builder._warm_up_decode_level(torch.bfloat16)
    assert calls == [(builder.num_qo_heads, builder.num_kv_heads, builder.head_dim,
                      builder.page_size, torch.bfloat16, torch.device("cuda"))]

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(decode_level, "warm_up", broken)
    with caplog.at_level(logging.WARNING, logger="vllm.cascade_plugin"):
        builder._warm_up_decode_level(torch.bfloat16)
    assert any("compiling the fused decode kernel at startup failed (RuntimeError: no compiler"
               in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fused", ["1", "0"])
def test_fused_decode_knob_reaches_the_fa3_executor(tmp_path, monkeypatch, fused):
    """CASCADE_FUSED_DECODE decides whether the FA3 executor fuses decode steps and whether the
    builder compiles the fused kernel at startup."""
    from vllm_cascade_plugin.execution import kernels, vllm_kernels
    from vllm_cascade_plugin.integration import flashinfer_backend as backend

    warmed = []
    monkeypatch.setenv("CASCADE_ATTENTION", "1")
    monkeypatch.setenv("CASCADE_FUSED_DECODE", fused)
    monkeypatch.setattr(kernels, "choose_kernel", lambda requested, layout: ("fa3", "fa3"))
    monkeypatch.setattr(vllm_kernels, "fa3_kernels", lambda: (None, None))  # never called here
    monkeypatch.setattr(backend.CascadeFlashInferMetadataBuilder, "_warm_up_decode_level",
                        lambda self, dtype: warmed.append(dtype))
    config = vllm_cpu.cpu_vllm_config(str(tmp_path))
    names = vllm_cpu.make_layers(config, [SCALE])
    builder = vllm_cpu.make_builder(config, names)
    executor = builder._executor()
    assert isinstance(executor, kernels.FlashAttnCascadeExecutor)
    assert executor._fused_decode is (fused == "1")
    assert len(warmed) == (1 if fused == "1" else 0)


@pytest.mark.parametrize(("knob", "eager", "graphs"),
                         [("1", False, True), ("0", False, False), ("1", True, False)])
def test_cuda_graphs_knob_and_vllm_eager_mode_reach_the_fa3_executor(tmp_path, monkeypatch,
                                                                      knob, eager, graphs):
    """CASCADE_CUDA_GRAPHS=1 gives the FA3 executor CUDA graphs unless vLLM itself runs
    without them (enforce_eager / cudagraph_mode NONE, read through compat)."""
    from vllm.config import CUDAGraphMode

    from vllm_cascade_plugin.execution import kernels, vllm_kernels
    from vllm_cascade_plugin.integration import compat
    from vllm_cascade_plugin.integration import flashinfer_backend as backend

    monkeypatch.setenv("CASCADE_ATTENTION", "1")
    monkeypatch.setenv("CASCADE_CUDA_GRAPHS", knob)
    monkeypatch.setattr(kernels, "choose_kernel", lambda requested, layout: ("fa3", "fa3"))
    monkeypatch.setattr(vllm_kernels, "fa3_kernels", lambda: (None, None))
    monkeypatch.setattr(backend.CascadeFlashInferMetadataBuilder, "_warm_up_decode_level",
                        lambda self, dtype: None)
    config = vllm_cpu.cpu_vllm_config(str(tmp_path))
    assert not compat.vllm_uses_cuda_graphs(config)  # enforce_eager=True, as built
    # The CPU test config is eager; make it look like a GPU engine's default (piecewise graphs).
    # monkeypatch.setattr raises if vLLM renamed either attribute: this test then fails loudly.
    monkeypatch.setattr(config.model_config, "enforce_eager", eager)
    monkeypatch.setattr(config.compilation_config, "cudagraph_mode",
                        CUDAGraphMode.NONE if eager else CUDAGraphMode.FULL_AND_PIECEWISE)
    assert compat.vllm_uses_cuda_graphs(config) is not eager
    names = vllm_cpu.make_layers(config, [SCALE])
    executor = vllm_cpu.make_builder(config, names)._executor()
    assert isinstance(executor, kernels.FlashAttnCascadeExecutor)
    assert (executor.graphs is not None) is graphs
    # The cost model charges a decode step of a steady shape what it costs with or without the
    # graphs, and any other step the eager cost.
    from vllm_cascade_plugin.planning.cost import COST_MODELS, FA3_EAGER_STEP_FIXED_US

    assert session.steady_cost_model is not None
    assert session.steady_cost_model.step_fixed_us == (
        COST_MODELS["fa3"].step_fixed_us if graphs else FA3_EAGER_STEP_FIXED_US)
    assert session.cost_model.step_fixed_us == FA3_EAGER_STEP_FIXED_US
    assert COST_MODELS["fa3"].step_fixed_us < FA3_EAGER_STEP_FIXED_US
