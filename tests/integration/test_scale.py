import logging
import math

import pytest

import vllm_cpu

pytestmark = pytest.mark.flashinfer  # vLLM's FlashInfer impl, built from a real VllmConfig


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return vllm_cpu.cpu_vllm_config(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.mark.parametrize("bad", [None, float("nan"), 0.0, -1.0, "x"])
def test_layer_without_usable_scale_warns_once_and_defaults(config, bad, caplog):
    names = vllm_cpu.make_layers(config, [0.125, bad])
    with caplog.at_level(logging.WARNING, logger="vllm.cascade_plugin"):
        vllm_cpu.make_builder(config, names)
        builder = vllm_cpu.make_builder(config, names)  # a second builder: no second warning
    warnings = [r.getMessage() for r in caplog.records if "no usable softmax scale" in r.message]
    assert len(warnings) == 1 and names[1] in warnings[0] and repr(bad) in warnings[0]
    layers = config.compilation_config.static_forward_context
    assert math.isclose(layers[names[1]].impl.scale, 128 ** -0.5)
    assert layers[names[0]].impl.scale == 0.125
    assert builder is not None


def test_usable_scales_are_kept_silently(config, caplog):
    names = vllm_cpu.make_layers(config, [0.1, 0.1])
    with caplog.at_level(logging.WARNING, logger="vllm.cascade_plugin"):
        builder = vllm_cpu.make_builder(config, names)
    assert not [r for r in caplog.records if "softmax scale" in r.message]
    assert builder.sm_scale == pytest.approx(0.1)
