"""vLLM's real FlashAttention builder and impl (our subclasses, the FLASH_ATTN backend) on a CPU.

Everything is vLLM's own code on a real VllmConfig: vLLM's FlashAttention ``build()`` runs as it
is (without a GPU it schedules nothing ahead of time). What cannot run here is FlashAttention
itself: flat layers call a recording stand-in for vLLM's ``FlashAttentionImpl.forward``, and the
cascade runs the plugin's FA3 executor on the torch stand-ins of ``test_fa3_executor_cpu``
(varlen attention over a block table, vLLM's merge), reading the cache through the same views
vLLM's forward makes. Outputs are compared with ``test_integration_cpu.dense_attention``.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

import vllm_cpu
from test_fa3_executor_cpu import fake_flash_attn_varlen_func, fake_merge_attn_states
from test_hooks import vllm_release, written
from test_integration_cpu import (
    HEADS,
    SCALE,
    ReferenceExecutor,
    batch,
    common_metadata,
    dense_attention,
    engine,  # noqa: F401  (a fixture: the FlashInfer builder)
    packed_cache,
)
from test_step_session import plugin_log  # noqa: F401  (a fixture: the plugin's log lines)
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.execution import kernels, vllm_kernels
from vllm_cascade_plugin.integration import compat, support
from vllm_cascade_plugin.step import session

# The vLLM methods the subclasses override, as test_hooks writes signatures: a change in any of
# them must be looked at before the subclass can follow it.
OVERRIDDEN = {
    ("FlashAttentionMetadataBuilder", "__init__"):
        ["self", "kv_cache_spec", "layer_names", "vllm_config", "device"],
    ("FlashAttentionMetadataBuilder", "build"):
        ["self", "common_prefix_len", "common_attn_metadata", "fast_build"],
    ("FlashAttentionMetadataBuilder", "update_block_table"):
        ["self", "metadata", "blk_table", "slot_mapping"],
    ("FlashAttentionImpl", "forward"):
        ["self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
         "output_scale", "output_block_scale"],
}
# Read from each release's flash_attn.py: unchanged from 0.26 to 0.34.
OVERRIDDEN_BY_RELEASE = {(0, 26): OVERRIDDEN, (0, 33): OVERRIDDEN, (0, 34): OVERRIDDEN}
BF16 = 2e-2  # bf16 inputs and output (3 significant digits), fp32 math in both


@pytest.fixture(autouse=True)
def restored_session():
    saved = dict(vars(session))
    stats.reset()
    yield
    vars(session).update(saved)
    session.end_step()


@pytest.fixture(scope="module")
def fa_config(tmp_path_factory):
    return vllm_cpu.engine_config(str(tmp_path_factory.mktemp("tiny-fa")), backend="FLASH_ATTN")


def fa_builder(config, **kwargs):
    from vllm_cascade_plugin.integration.flash_attn_backend import (
        CascadeFlashAttentionBackend as Backend,
    )

    names = vllm_cpu.make_layers(config, [SCALE, SCALE], backend=Backend)
    builder = vllm_cpu.make_builder(config, names, backend=Backend, **kwargs)
    layers = config.compilation_config.static_forward_context
    return builder, [layers[n] for n in names]


@pytest.fixture
def fa_engine(fa_config, monkeypatch):
    """Our FLASH_ATTN builder and two layers; its executor the real FA3 executor on the torch
    stand-ins of FlashAttention 3 and vLLM's merge."""
    from vllm.config import set_current_vllm_config

    monkeypatch.setenv("CASCADE_POLICY", "always")
    monkeypatch.setattr(vllm_kernels, "fa3_kernels",
                        lambda: (fake_flash_attn_varlen_func, fake_merge_attn_states))
    builder, layers = fa_builder(fa_config)
    with set_current_vllm_config(fa_config):
        yield fa_config, builder, layers


@pytest.fixture
def flat_forward(monkeypatch):
    """vLLM's FlashAttention forward (FA kernels, GPU only), recorded: (layer, metadata)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    calls = []

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *rest):
        calls.append((layer, attn_metadata))
        return output

    monkeypatch.setattr(FlashAttentionImpl, "forward", forward)
    return calls


def vllm_build(builder, cm):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    return FlashAttentionMetadataBuilder.build(builder, 0, cm)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    return a is b or a == b


def run_layers(layers, metadata, table, seq, q, seed=1):
    """Every layer's forward on a fresh cache, in the model's dtype (bf16) as in an engine;
    each output against dense attention in fp32."""
    g = torch.Generator().manual_seed(seed)
    tokens = int(q.sum())
    for layer in layers:
        memory, _ = packed_cache(g)
        memory = memory.to(torch.bfloat16)
        query = torch.randn(tokens + 3, HEADS, 128, generator=g).to(torch.bfloat16)  # +3: padding
        output = torch.full_like(query, float("nan"))
        layer.impl.forward(layer, query, None, None, memory.permute(0, 2, 1, 3), metadata, output)
        expected = dense_attention(query[:tokens].float(), memory.float(), table, seq, q)
        torch.testing.assert_close(output[:tokens].float(), expected, atol=BF16, rtol=BF16)
    assert not stats.snapshot().fallbacks


# ------------------------------------------------------------------- what vLLM's classes are


@pytest.mark.parametrize("key", sorted(OVERRIDDEN), ids="{0[0]}.{0[1]}".format)
def test_overridden_flash_attention_methods_have_the_recorded_parameters(key):
    import vllm.v1.attention.backends.flash_attn as fa

    at = [release for release in OVERRIDDEN_BY_RELEASE if release <= vllm_release()]
    assert at, f"no FlashAttention signatures recorded for vLLM {vllm_release()}"
    owner, name = key
    assert list(written(getattr(getattr(fa, owner), name))) == OVERRIDDEN_BY_RELEASE[max(at)][key]


def test_the_cascade_reads_the_kv_cache_through_the_views_vllms_forward_makes():
    """compat.flash_attn_kv_cache_views copies these lines of vLLM's FlashAttention forward:
    if vLLM views its cache otherwise, the executor would read other memory."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    text = inspect.getsource(FlashAttentionImpl.forward)
    assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in text
    assert "canonicalize_singleton_dim_strides(key_cache)" in text
    g = torch.Generator().manual_seed(0)
    memory, kv_cache = packed_cache(g)  # memory [B, N, H, 2D], the cache (B, H, N, 2D)
    k, v = compat.flash_attn_kv_cache_views(kv_cache, 128)
    assert torch.equal(k, memory[..., :128]) and torch.equal(v, memory[..., 128:])
    assert k.data_ptr() == memory.data_ptr()  # views, no copy


def test_flat_steps_keep_vllms_cudagraph_support_and_backend_identity(fa_config):
    from vllm.v1.attention.backends import flash_attn as fa
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_cascade_plugin.integration.builder import CascadeBuilder
    from vllm_cascade_plugin.integration.flash_attn_backend import (
        CascadeFlashAttentionBackend as Backend,
    )

    builder_cls = Backend.get_builder_cls()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    for name in ("_cudagraph_support", "get_cudagraph_support", "supports_update_block_table",
                 "get_varlen_cudagraph_max_query_len", "reorder_batch_threshold"):
        assert name not in vars(builder_cls) and name not in vars(CascadeBuilder), name
    assert (builder_cls.get_cudagraph_support(fa_config, spec)
            == fa.FlashAttentionMetadataBuilder.get_cudagraph_support(fa_config, spec))
    assert builder_cls._cudagraph_support is fa.FlashAttentionMetadataBuilder._cudagraph_support
    assert Backend.get_name() == "FLASH_ATTN" and issubclass(Backend, fa.FlashAttentionBackend)
    own = {k for k in vars(Backend) if not k.startswith("_")}
    assert own == {"get_impl_cls", "get_builder_cls"}  # every capability check is vLLM's
    assert issubclass(Backend.get_impl_cls(), fa.FlashAttentionImpl)
    assert issubclass(builder_cls, fa.FlashAttentionMetadataBuilder)


# ------------------------------------------------------------------------ builder and impl


def test_a_shared_prefix_batch_gets_vllms_metadata_plus_the_planned_executor(fa_engine):
    from vllm_cascade_plugin.integration.flash_attn_backend import CascadeFlashAttentionMetadata

    _config, builder, layers = fa_engine
    table, seq, q = batch()
    step = session.plan_step(table, seq, q)  # what the runner hook does before CUDA graphs
    assert step is not None and step.decision.use_cascade
    cm = common_metadata(table, seq, q)
    metadata = builder.build(0, cm)
    assert type(metadata) is CascadeFlashAttentionMetadata
    assert isinstance(metadata.cascade, kernels.FlashAttnCascadeExecutor)
    reference = vllm_build(builder, cm)
    for f in dataclasses.fields(reference):
        assert same(getattr(metadata, f.name), getattr(reference, f.name)), f.name
    run_layers(layers, metadata, table, seq, q)
    counters = stats.snapshot()
    assert counters.steps_cascade == 1 and not counters.fallbacks


def test_the_builders_time_counts_staging_uploads_and_cpu_time_apart(fa_engine, monkeypatch):
    """Of a cascade step's builder time, what the executor spent staging uploads (timed by
    ``common.STAGING``; the CPU executor uploads nothing, so a stand-in staging of a known
    2 ms) and what its thread ran on a CPU are counted apart: the periodic line and /metrics
    tell CUDA calls from Python, and waiting from running."""
    import time

    from vllm_cascade_plugin.execution.common import STAGING

    _config, builder, _layers = fa_engine
    original = kernels.FlashAttnCascadeExecutor.plan

    def plan_with_staging(self, *args, **kwargs):
        original(self, *args, **kwargs)
        with STAGING.timed():
            time.sleep(0.002)
            with STAGING.launching():
                time.sleep(0.001)

    monkeypatch.setattr(kernels.FlashAttnCascadeExecutor, "plan", plan_with_staging)
    table, seq, q = batch()
    assert session.plan_step(table, seq, q) is not None
    builder.build(0, common_metadata(table, seq, q))
    counters = stats.snapshot()
    assert counters.steps_cascade == 1
    assert 0.003 <= counters.builder_staging_s <= counters.builder_s
    assert 0.001 <= counters.builder_launch_s <= counters.builder_staging_s - 0.002
    # A sleep is off the CPU: the builder's CPU time leaves it out.
    assert counters.builder_cpu_s <= counters.builder_s - 0.0025


def test_a_batch_without_sharing_gets_exactly_vllms_metadata_and_forward(fa_engine,
                                                                         flat_forward):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    _config, builder, layers = fa_engine
    table, seq, q = batch()
    for k, row in enumerate([0, 2, 4, 5]):  # nobody shares the prefix pages any more
        table[row, :5] += 100 * (k + 1)
    step = session.plan_step(table, seq, q)
    assert step is not None and not step.decision.use_cascade
    metadata = builder.build(0, common_metadata(table, seq, q))
    assert type(metadata) is FlashAttentionMetadata
    session.end_step()
    unplanned = builder.build(0, common_metadata(table, seq, q))  # no plan at all
    assert type(unplanned) is FlashAttentionMetadata
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        _, kv_cache = packed_cache(g)
        query = torch.randn(int(q.sum()), HEADS, 128, generator=g)
        layer.impl.forward(layer, query, None, None, kv_cache, metadata, torch.empty_like(query))
    assert [m for _, m in flat_forward] == [metadata, metadata]
    assert flat_forward[0][1] is metadata and stats.snapshot().steps_cascade == 0


def test_a_failing_kernel_runs_vllms_forward_with_the_same_metadata(fa_engine, flat_forward):
    _config, builder, layers = fa_engine
    table, seq, q = batch()
    builder._cascade_executor = ReferenceExecutor(fail=True)
    session.plan_step(table, seq, q)
    metadata = builder.build(0, common_metadata(table, seq, q))
    assert metadata.cascade is builder._cascade_executor
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        _, kv_cache = packed_cache(g)
        query = torch.randn(int(q.sum()), HEADS, 128, generator=g)
        layer.impl.forward(layer, query, None, None, kv_cache, metadata, torch.empty_like(query))
    assert [m for _, m in flat_forward] == [metadata, metadata]
    assert stats.snapshot().fallbacks["kernel error"] == len(layers)


@pytest.mark.parametrize(("capture_sizes", "graphs"),
                         [((8, 16, 32), True), ((1, 2, 4, 8), False), ((), True)],
                         ids=["within", "above the largest", "no graphs in vLLM"])
def test_the_builder_plans_a_step_above_vllms_largest_capture_size_without_graphs(
        fa_engine, monkeypatch, capture_sizes, graphs):
    """The batch has 29 tokens: vLLM pads it to 32, or runs it as it is above a largest
    capture size of 8, without graphs; the executor is told which (and the host time of its
    planning is counted)."""
    _config, builder, _ = fa_engine
    executor = builder._cascade_executor = ReferenceExecutor()
    monkeypatch.setattr(session, "_capture_sizes", capture_sizes)
    table, seq, q = batch()
    assert int(q.sum()) == 29
    session.plan_step(table, seq, q)
    assert builder.build(0, common_metadata(table, seq, q)).cascade is executor
    assert executor.plan_args[1]["graphs"] is graphs
    assert stats.snapshot().builder_s > 0


def test_another_kv_cache_groups_copy_of_the_metadata_runs_flat(fa_engine):
    """vLLM's update_block_table copies one group's metadata with another group's block
    table; the plan is for the first group's block ids, so the copy keeps none."""
    _config, builder, _ = fa_engine
    table, seq, q = batch()
    session.plan_step(table, seq, q)
    metadata = builder.build(0, common_metadata(table, seq, q))
    other = builder.update_block_table(metadata, torch.zeros_like(metadata.block_table),
                                       metadata.slot_mapping)
    assert other.cascade is None and metadata.cascade is not None
    assert other.block_table is not metadata.block_table


def test_a_non_causal_batch_runs_flat(fa_engine):
    _config, builder, _ = fa_engine
    table, seq, q = batch()
    session.plan_step(table, seq, q)
    cm = dataclasses.replace(common_metadata(table, seq, q), causal=False)
    metadata = builder.build(0, cm)
    assert getattr(metadata, "cascade", None) is None
    assert stats.snapshot().fallbacks["batch not causal throughout"] == 1


# ---------------------------------------------- build() with and without common_prefix_len


def test_build_arguments_are_read_with_and_without_common_prefix_len():
    cm = object()
    for args, kwargs in [((0, cm), {}), ((3, cm, True), {}), ((), {"common_prefix_len": 0,
                         "common_attn_metadata": cm}), ((cm,), {}), ((cm, True), {}),
                         ((), {"common_attn_metadata": cm, "fast_build": True}),
                         ((0,), {"common_attn_metadata": cm})]:
        prefix, metadata, fast = compat.build_arguments(args, kwargs)
        assert metadata is cm and prefix == (3 if args[:1] == (3,) else 0)
        assert fast is (True in args or kwargs.get("fast_build", False))
    for args, kwargs in [((), {}), ((0,), {}), ((cm, True, 1), {}), ((cm,), {"extra": 1})]:
        with pytest.raises(TypeError):
            compat.build_arguments(args, kwargs)


def without_prefix_len(monkeypatch, parent):
    """``parent.build`` as a vLLM without the deprecated parameter would have it."""
    original, calls = parent.build, []

    def build(self, common_attn_metadata, fast_build=False):
        calls.append(fast_build)
        return original(self, 0, common_attn_metadata, fast_build)

    monkeypatch.setattr(parent, "build", build)
    return calls


def test_flash_attn_builder_takes_build_calls_without_common_prefix_len(fa_engine, monkeypatch):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    calls = without_prefix_len(monkeypatch, FlashAttentionMetadataBuilder)
    _config, builder, layers = fa_engine
    table, seq, q = batch()
    cm = common_metadata(table, seq, q)
    session.plan_step(table, seq, q)
    for metadata in (builder.build(cm), builder.build(common_attn_metadata=cm),
                     builder.build(0, cm)):
        assert metadata.cascade is not None
    run_layers(layers, metadata, table, seq, q)
    assert getattr(builder.build(cm, True), "cascade", None) is None  # fast_build: flat
    assert calls == [False, False, False, True]


@pytest.mark.flashinfer
def test_flashinfer_builder_takes_build_calls_without_common_prefix_len(
        engine, monkeypatch):  # noqa: F811
    from vllm.v1.attention.backends.flashinfer import FlashInferMetadataBuilder

    calls = without_prefix_len(monkeypatch, FlashInferMetadataBuilder)
    _config, builder, _ = engine
    table, seq, q = batch()
    builder._cascade_executor = ReferenceExecutor()
    cm = common_metadata(table, seq, q)
    session.plan_step(table, seq, q)
    metadata = builder.build(common_attn_metadata=cm)
    assert metadata.cascade is builder._cascade_executor and calls == []  # deferred
    assert metadata.flat_metadata().decode is not None and calls == [False]
    session.end_step()
    flat = builder.build(cm)
    assert getattr(flat, "cascade", None) is None and flat.decode is not None
    assert calls == [False, False]


# --------------------------------------------------------------------------- which builder


def test_flash_attn_runs_cascade_on_fa3_only_and_says_which_backend_carries_it(
        fa_config, monkeypatch, plugin_log):  # noqa: F811
    monkeypatch.setenv("CASCADE_ATTENTION", "1")
    builder, _ = fa_builder(fa_config)  # no FlashAttention 3 on a CPU
    reason = builder._settings.unsupported
    assert reason.startswith("the FLASH_ATTN backend's cascade needs FlashAttention 3")
    assert any(reason in line and "vLLM's flat FLASH_ATTN attention" in line
               for line in plugin_log)
    monkeypatch.setenv("CASCADE_KERNEL", "flashinfer")
    assert fa_builder(fa_config)[0]._settings.unsupported.startswith("CASCADE_KERNEL=flashinfer")
    monkeypatch.delenv("CASCADE_KERNEL")
    monkeypatch.setattr(kernels, "fa3_unsupported_reason", lambda layout: None)  # Hopper
    monkeypatch.setattr(vllm_kernels, "fa3_kernels", lambda: (None, None))
    plugin_log.clear()
    builder, _ = fa_builder(fa_config)
    assert builder._settings.unsupported is None and builder._cascade_kernel == "fa3"
    assert session.active and session.cost_model.flat_prefill_tile == 1
    # Flat attention here is FA3's decode (its own calibration), the cascade side the executor's.
    from vllm_cascade_plugin.planning.cost import COST_MODELS, FLASH_ATTN_FLAT

    assert session.steady_cost_model is not None
    for model in (session.cost_model, session.steady_cost_model):
        assert model.flat_prefill_tile == 1
        assert (model.flat_fixed_us, model.flat_bandwidth) == (
            FLASH_ATTN_FLAT["flat_fixed_us"], FLASH_ATTN_FLAT["flat_bandwidth"])
        assert model.own_bandwidth == COST_MODELS["fa3"].flat_bandwidth
        assert model.flat_bandwidth < COST_MODELS["fa3"].flat_bandwidth
    assert any("the FLASH_ATTN backend carries cascade attention; cascade kernels: "
               "FlashAttention 3" in line for line in plugin_log)
    assert isinstance(builder._executor(), kernels.FlashAttnCascadeExecutor)


@pytest.mark.flashinfer
def test_flashinfer_builder_says_which_backend_carries_it(
        tmp_path, monkeypatch, plugin_log):  # noqa: F811
    monkeypatch.setenv("CASCADE_ATTENTION", "1")
    config = vllm_cpu.cpu_vllm_config(str(tmp_path))
    names = vllm_cpu.make_layers(config, [SCALE])
    vllm_cpu.make_builder(config, names)
    assert any(line.startswith("vllm-cascade-plugin: the FLASHINFER backend carries cascade "
                               "attention; cascade kernels: FlashInfer") for line in plugin_log)


# ------------------------------------------------------- configurations that run flat, why


@pytest.fixture
def fp8_capable(monkeypatch):
    """vLLM 0.33's FlashAttention impl refuses an FP8 cache where FA3 cannot read it (here: no
    GPU); on a Hopper GPU it can."""
    import vllm.v1.attention.backends.flash_attn as fa

    if hasattr(fa, "flash_attn_supports_kv_cache_dtype"):
        monkeypatch.setattr(fa, "flash_attn_supports_kv_cache_dtype", lambda *a, **k: True)


@pytest.mark.flashinfer  # FlashInfer's builder too
@pytest.mark.parametrize(("engine_args", "reason"), [
    ({"enable_prefix_caching": False}, support.PREFIX_CACHING_OFF),
    ({"kv_cache_dtype": "fp8"}, support.kv_cache_dtype_reason("fp8")),
    ({"kv_cache_dtype": "fp8_e4m3"}, support.kv_cache_dtype_reason("fp8_e4m3")),
], ids=["prefix-caching-off", "fp8-knob-off", "fp8_e4m3-knob-off"])
def test_an_engine_the_cascade_cannot_help_runs_flat_and_says_why_once(
        tmp_path, plugin_log, fp8_capable, engine_args, reason, monkeypatch):  # noqa: F811
    from vllm.config import set_current_vllm_config

    from vllm_cascade_plugin.integration.flash_attn_backend import CascadeFlashAttentionBackend

    monkeypatch.setenv("CASCADE_FP8_KV", "0")  # an FP8 cache runs cascade by default

    config = vllm_cpu.engine_config(str(tmp_path), backend="FLASH_ATTN", **engine_args)
    for name, cls in (("FLASH_ATTN", CascadeFlashAttentionBackend), ("FLASHINFER", None)):
        stats.reset()
        plugin_log.clear()
        names = vllm_cpu.make_layers(config, [SCALE, SCALE], backend=cls)
        for _ in range(2):  # vLLM makes its builders again after profiling: one line
            builder = vllm_cpu.make_builder(config, names, backend=cls)
        assert builder._settings.unsupported == reason and not session.active
        lines = [line for line in plugin_log if reason in line]
        assert len(lines) == 1 and f"vLLM's flat {name} attention" in lines[0], name
        table, seq, q = batch()
        assert session.plan_step(table, seq, q) is None  # nothing planned, nothing counted
        with set_current_vllm_config(config):
            assert builder._cascade_step(common_metadata(table, seq, q), False) is None
        assert stats.snapshot().steps_planned == 0


def test_an_fp8_layer_or_cache_spec_is_refused_whatever_the_engine_says(fa_engine, fp8_capable):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_cascade_plugin.integration.flash_attn_backend import flash_attn_reason

    config, _, layers = fa_engine
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    impls = [layer.impl for layer in layers]
    assert flash_attn_reason(config, spec, impls) is None
    fp8 = FlashAttentionImpl(HEADS, 128, SCALE, 2, None, None, "fp8_e5m2")
    assert flash_attn_reason(config, spec, [*impls, fp8]) == support.kv_cache_dtype_reason(
        "fp8_e5m2")
    fp8_spec = dataclasses.replace(spec, dtype=torch.float8_e4m3fn)
    assert flash_attn_reason(config, fp8_spec, impls).startswith("quantised KV cache")


def test_the_builders_fa3_executor_sizes_graphed_buffers_for_vllms_largest_capture_size(
        fa_engine, monkeypatch):
    _config, builder, _ = fa_engine
    monkeypatch.setattr(session, "_capture_sizes", (8, 16, 32))
    builder._cascade_executor = None
    monkeypatch.setattr(builder, "_new_cascade_executor",
                        lambda config: SimpleNamespace(graph_rows=0))
    assert builder._executor().graph_rows == 32
