"""An FP8 (e4m3) KV cache through vLLM's real FlashAttention builder and impl, on a CPU.

``--kv-cache-dtype fp8`` on a real VllmConfig: vLLM stores the cache as bytes (uint8) and keeps
one scale per layer for q, K and V on the Attention layer. With ``CASCADE_FP8_KV=1`` the
builder serves it and the impl runs the FA3 executor (on the torch stand-ins of
``test_fa3_executor_cpu``, which take FP8 as FA3 does) on the cache read as e4m3 with the
layer's scales; the output is held to per-request attention in fp32 on the dequantised cache
(``test_integration_cpu.dense_attention``). Without the knob, and for layouts the cascade does
not read, the builder keeps the layers flat and says why.
"""

from __future__ import annotations

import pytest
import torch

import vllm_cpu
from test_fa3_executor_cpu import fake_flash_attn_varlen_func, fake_merge_attn_states
from test_flash_attn_cpu import fp8_capable, restored_session  # noqa: F401  (fixtures)
from test_integration_cpu import HEADS, SCALE, batch, common_metadata, dense_attention, packed_cache
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.execution import kernels, vllm_kernels
from vllm_cascade_plugin.integration import support
from vllm_cascade_plugin.step import session

FP8 = torch.float8_e4m3fn
BF16 = 2e-2  # bf16 output (FA3's for FP8 input), fp32 math on both sides


def quantise(x, scale):
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


@pytest.fixture
def fp8_engine(tmp_path, monkeypatch, fp8_capable):  # noqa: F811
    """A FLASH_ATTN engine with ``--kv-cache-dtype fp8``: its config and layer names, FA3 (the
    stand-ins) available."""
    monkeypatch.setenv("CASCADE_POLICY", "always")
    monkeypatch.setattr(vllm_kernels, "fa3_kernels",
                        lambda: (fake_flash_attn_varlen_func, fake_merge_attn_states))
    monkeypatch.setattr(kernels, "fa3_unsupported_reason", lambda layout: None)
    config = vllm_cpu.engine_config(str(tmp_path), backend="FLASH_ATTN", kv_cache_dtype="fp8")
    return config


def fa_layers(config):
    from vllm_cascade_plugin.integration.flash_attn_backend import (
        CascadeFlashAttentionBackend as Backend,
    )

    names = vllm_cpu.make_layers(config, [SCALE, SCALE], backend=Backend)
    layers = config.compilation_config.static_forward_context
    return names, [layers[n] for n in names], Backend


def set_scales(layer, q, k, v):
    """Scales as vLLM leaves them after loading a checkpoint's: device tensor and host float."""
    for name, value in (("q", q), ("k", k), ("v", v)):
        getattr(layer, f"_{name}_scale").fill_(value)
        setattr(layer, f"_{name}_scale_float", value)


def test_with_the_knob_off_an_fp8_cache_runs_flat_and_the_reason_says_how_to_turn_it_on(
        fp8_engine, monkeypatch):
    monkeypatch.setenv("CASCADE_FP8_KV", "0")
    names, _, backend = fa_layers(fp8_engine)
    builder = vllm_cpu.make_builder(fp8_engine, names, backend=backend, dtype=torch.uint8)
    reason = builder._settings.unsupported
    assert reason == support.kv_cache_dtype_reason("fp8") and "CASCADE_FP8_KV=0" in reason
    assert "unset it (or CASCADE_FP8_KV=1)" in reason and not session.active


@pytest.mark.parametrize("knob", [None, "1"], ids=["default", "on"])
def test_by_default_the_cascade_reads_the_fp8_cache_with_each_layers_scales(
        fp8_engine, monkeypatch, knob):
    from vllm.config import set_current_vllm_config

    from vllm_cascade_plugin.integration.flash_attn_backend import CascadeFlashAttentionMetadata

    if knob is None:
        monkeypatch.delenv("CASCADE_FP8_KV", raising=False)
    else:
        monkeypatch.setenv("CASCADE_FP8_KV", knob)
    names, layers, backend = fa_layers(fp8_engine)
    builder = vllm_cpu.make_builder(fp8_engine, names, backend=backend, dtype=torch.uint8)
    assert builder._settings.unsupported is None and builder._cascade_kernel == "fa3"
    assert builder._kernel_args.kv_dtype == FP8
    table, seq, q = batch()
    g = torch.Generator().manual_seed(3)
    tokens = int(q.sum())
    with set_current_vllm_config(fp8_engine):
        assert session.plan_step(table, seq, q) is not None
        metadata = builder.build(0, common_metadata(table, seq, q))
        assert type(metadata) is CascadeFlashAttentionMetadata and metadata.cascade is not None
        for layer, scales in zip(layers, [(0.02, 0.004, 0.003), (0.03, 0.006, 0.002)],
                                 strict=True):
            set_scales(layer, *scales)
            memory, _ = packed_cache(g)  # [B, N, H, 2D], values ~N(0, 1)
            dim = memory.shape[-1] // 2
            stored = torch.cat([quantise(memory[..., :dim], scales[1]),
                                quantise(memory[..., dim:], scales[2])], dim=-1)
            dequantised = torch.cat([stored[..., :dim].float() * scales[1],
                                     stored[..., dim:].float() * scales[2]], dim=-1)
            # The FA layer quantises the query itself (its query_quant): the impl gets FP8.
            query = quantise(torch.randn(tokens + 3, HEADS, 128, generator=g), scales[0])
            output = torch.full((tokens + 3, HEADS, 128), float("nan"), dtype=torch.bfloat16)
            cache = stored.view(torch.uint8).permute(0, 2, 1, 3)  # as vLLM allocates it
            layer.impl.forward(layer, query, None, None, cache, metadata, output)
            expected = dense_attention(query[:tokens].float() * scales[0], dequantised, table,
                                       seq, q)
            torch.testing.assert_close(output[:tokens].float(), expected, atol=BF16, rtol=BF16)
    counters = stats.snapshot()
    assert counters.steps_cascade == 1 and not counters.fallbacks


@pytest.mark.parametrize("layout", ["per-head", "dynamic"])
def test_scales_the_cascade_cannot_read_run_flat_and_say_which(fp8_engine, monkeypatch, layout):
    monkeypatch.setenv("CASCADE_FP8_KV", "1")
    names, layers, backend = fa_layers(fp8_engine)
    if layout == "per-head":
        layers[1]._k_scale = torch.ones(2)  # one per KV head (a checkpoint's attn_head scheme)
        expected = "per-layer (scalar) scales only"
    else:
        monkeypatch.setattr(fp8_engine.cache_config, "calculate_kv_scales", True, raising=False)
        expected = "--calculate-kv-scales"
    builder = vllm_cpu.make_builder(fp8_engine, names, backend=backend, dtype=torch.uint8)
    assert expected in builder._settings.unsupported and not session.active


@pytest.mark.parametrize("dtype", ["fp8_e5m2", "fp8_per_token_head", "nvfp4", "int8"])
def test_other_quantised_layouts_name_themselves_as_not_supported(dtype):
    for knob in (False, True):
        reason = support.kv_cache_dtype_reason(dtype, fp8_kv=knob)
        assert f"kv_cache_dtype={dtype}" in reason and "not supported" in reason
    assert support.kv_cache_dtype_reason("fp8", fp8_kv=True) is None
    assert support.kv_cache_dtype_reason("fp8_e4m3", fp8_kv=True) is None
