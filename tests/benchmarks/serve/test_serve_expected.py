"""benchmarks/serve/expected.py: a decode step's bytes flat and with the cascade, checked against
arithmetic done here by hand for two tiny configs, against transformers' own parameter counts of
the served model folders, and the batch at a load against Little's law solved by iteration."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.serve import expected as se
from benchmarks.serve import workloads as sw

ROOT = Path(__file__).parents[3]
MODELS = ROOT / "examples" / "models"

# Gemma 3's pattern at a tiny size: five sliding-window layers (8 tokens) to one full layer.
TINY_GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "sliding_window": 8, "sliding_window_pattern": 6, "vocab_size": 100}
# A Mamba2 hybrid at a tiny size: three Mamba2 layers and one attention layer, no experts.
TINY_HYBRID = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
               "hidden_size": 64, "num_hidden_layers": 4,
               "layer_types": ["mamba", "attention", "mamba", "mamba"],
               "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 0,
               "intermediate_size": 96, "shared_intermediate_size": 96, "mamba_n_heads": 8,
               "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_expand": 2,
               "mamba_d_conv": 4, "mamba_chunk_size": 32, "vocab_size": 50}


def _folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_sliding_window_models_step_by_hand(tmp_path):
    m = se.model_of(_folder(tmp_path, TINY_GEMMA3), "tiny")
    # q 64x128, k and v 64x64 each, o 128x64; gated MLP 3 x 64x128; six layers; LM head 100x64.
    params = 6 * (64 * 128 + 2 * 64 * 64 + 128 * 64 + 3 * 64 * 128) + 100 * 64
    assert params == 301_312 and m.weight_bytes == 2 * params
    assert (m.full_layers, m.sliding_layers, m.recurrent_layers, m.window) == (1, 5, 0, 8)
    assert m.kv_token_bytes == 2 * 2 * 32 * 2 and m.page == 16  # K and V, 2 heads of 32, bf16
    # 4 requests behind 40 shared tokens (2 whole pages: 32), 10 own, 11 generated: context 55.
    t = se.Traffic(shared=40, groups=1, own=10.0, output=11, burst=4)
    flat = se.step_bytes(m, t, 4, cascade=False)
    assert flat == {"weights": 602_624, "full_kv": 256 * 4 * 55,
                    "sliding_kv": 5 * 256 * 4 * 8, "recurrent_state": 0}
    plugin = se.step_bytes(m, t, 4, cascade=True)
    assert plugin["full_kv"] == 256 * (32 + 4 * 23)  # 2 pages once, the rest per request
    assert plugin["sliding_kv"] == flat["sliding_kv"]
    assert sum(flat.values()) == 699_904 and sum(plugin.values()) == 675_328
    assert se.ratio_at(m, t, 4) == pytest.approx(699_904 / 675_328)
    # Flat's shared pages at twice their bytes' speed (L2): 16 of the 32 tokens' worth.
    assert se.step_bytes(m, t, 4, cascade=False, l2=2.0)["full_kv"] == 256 * 4 * (16 + 23)
    assert se.step_bytes(m, t, 4, cascade=True, l2=2.0) == plugin


def test_a_mamba_hybrids_step_and_page_by_hand(tmp_path):
    m = se.model_of(_folder(tmp_path, TINY_HYBRID), "tiny")
    # Mamba2: inner 2 x 64 = 128; conv channels 128 + 2 x 8 = 144; SSM 8 heads x 16 x 8 = 1024.
    # in_proj 64 x (2 x 128 + 2 x 8 + 8), conv 144 x 4, out_proj 128 x 64; every layer's MLP
    # 3 x 64 x 96; the attention layer's q/o 64x64, k/v 64x32 (head_dim 64 / 4 = 16).
    mamba = 64 * 280 + 144 * 4 + 128 * 64
    attention = 2 * 64 * 64 + 2 * 64 * 32
    params = 3 * mamba + attention + 4 * 3 * 64 * 96 + 50 * 64
    assert params == 169_280 and m.weight_bytes == 2 * params
    assert (m.full_layers, m.sliding_layers, m.recurrent_layers) == (1, 0, 3)
    assert m.state_bytes == 2 * (3 * 144 + 1024) == 2912  # conv (d_conv - 1 rows) + SSM, bf16
    assert m.kv_token_bytes == 128
    # vLLM's page: whole Mamba chunks (32 tokens) holding one state, 2912 / 128 -> 23 tokens.
    assert m.page == 32
    # 8 requests in 2 groups behind 70 shared tokens (2 whole pages: 64), 6 own, 9 generated.
    t = se.Traffic(shared=70, groups=2, own=6.0, output=9, burst=8)
    flat = se.step_bytes(m, t, 8, cascade=False)
    assert flat["full_kv"] == 128 * 8 * 80 and flat["recurrent_state"] == 2 * 3 * 2912 * 8
    plugin = se.step_bytes(m, t, 8, cascade=True)
    assert plugin["full_kv"] == 128 * (2 * 64 + 8 * 16)
    assert sum(flat.values()) == 560_256 and sum(plugin.values()) == 511_104


def test_a_mixture_of_experts_is_refused(tmp_path):
    with pytest.raises(ValueError, match="experts"):
        se.model_of(_folder(tmp_path, {**TINY_HYBRID, "num_local_experts": 4}))


def _little(m, t, rate_times_output, cascade) -> float:
    """Requests in decode at a rate: B = rate x output x step(B), by fixed-point iteration."""
    batch = 1.0
    for _ in range(10_000):
        batch = rate_times_output * sum(se.step_bytes(m, t, batch, cascade).values())
    return batch


def test_the_batch_at_a_load_is_littles_law(tmp_path):
    m = se.model_of(_folder(tmp_path, TINY_GEMMA3), "tiny")
    t = se.Traffic(shared=40, groups=1, own=10.0, output=11, burst=4)
    # The burst's decode rate per byte of step: 4 requests / (11 steps x the burst's step).
    burst_rate = 4 / (t.output * sum(se.step_bytes(m, t, 4, False).values()))
    for cascade in (False, True):
        want = _little(m, t, 0.9 * burst_rate * t.output, cascade)
        assert se.batch_at_load(m, t, 0.9, cascade) == pytest.approx(want, rel=1e-9)
    # At a rate in req/s on a bandwidth: the same law in seconds.
    batch, tpot = se.at_rate(m, t, 2000.0, 1e9, cascade=False)
    assert batch == pytest.approx(_little(m, t, 2000 * t.output / 1e9, False), rel=1e-9)
    assert tpot == pytest.approx(sum(se.step_bytes(m, t, batch, False).values()) / 1e9)
    assert se.at_rate(m, t, 1e12, 1e9, cascade=False) == (math.inf, math.inf)  # overloaded
    # A measured pair at that rate: the model says it has no figure, in strict JSON.
    pair = {"request_rate": 1e12, "tpot_ms_p50": 10.0}
    overloaded = se.on_gpu(m, t, pair, pair, 1e9)
    assert set(overloaded) == {"saturated"}
    json.dumps(overloaded, allow_nan=False)


@pytest.mark.parametrize("folder", ["gemma3-12b", "bamba-9b", "gpt-oss-20b-dense", "llama3-8b"])
def test_the_weights_of_each_served_model_are_transformers_matrices(folder):
    """The parameters a step reads: transformers' own model of the folder, on the meta device,
    less its 1-d parameters (norms, biases, sinks, Mamba's A, D, dt) and its input embedding
    (gathered rows; a tied one is the LM head, read whole). gpt-oss's dense stand-in is
    transformers' gpt-oss with one expert, less what the stand-in does not have: the router
    (one expert: no choice) and the expert's biases kept 2-d there ([1, n])."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(MODELS / folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())  # a tied LM head once
    read = sum(p.numel() for name, p in params.items() if p.dim() > 1 and not (
        ".mlp.router." in name or name.endswith("_bias")))
    if not config.tie_word_embeddings:
        read -= model.get_input_embeddings().weight.numel()
    assert se.model_of(MODELS / folder).weight_bytes == 2 * read


def test_the_served_folders_shapes():
    gemma, bamba, llama = (se.model_of(MODELS / f) for f in ("gemma3-12b", "bamba-9b",
                                                             "llama3-8b"))
    assert (gemma.full_layers, gemma.sliding_layers, gemma.window) == (8, 40, 1024)
    assert gemma.kv_token_bytes == 2 * 8 * 256 * 2 and gemma.page == 16
    assert (bamba.full_layers, bamba.recurrent_layers) == (3, 29)
    # Bamba-9B's state: conv 3 x (8192 + 256), SSM 128 x 64 x 128, bf16; its attention page is
    # the 768 tokens vLLM 0.26 sets for it on FLASH_ATTN (test_serve_models_cpu.py).
    assert bamba.state_bytes == 2 * (3 * 8448 + 128 * 64 * 128) and bamba.page == 768
    assert (llama.full_layers, llama.kv_token_bytes, llama.page) == (32, 4096, 16)


def test_the_system_prompt_workload_and_the_ratios_written():
    t = se.Traffic.of(sw.WORKLOADS["chat_6k_system"])
    assert (t.shared, t.groups, t.own, t.output, t.burst) == (6144, 1, 512.0, 128, 256)
    assert 6144 % 768 == 0  # whole pages of the Mamba hybrid's attention layers too
    def no_infinity(name):
        raise AssertionError(f"{name} in served_expected.json: not JSON")

    written = json.loads((ROOT / "benchmarks/results/cpu/served_expected.json").read_text(),
                         parse_constant=no_infinity)
    assert written["workload"] == "chat_6k_system"
    for name, model in written["models"].items():
        m = se.model_of(MODELS / name)
        assert model["shapes"]["page"] == m.page
        equal = model["equal_batch_tpot_flat_over_plugin"]
        assert equal == {str(b): round(se.ratio_at(m, t, b), 2) for b in se.EQUAL_BATCHES}
        # Never slower by its bytes, and more so the larger the batch; less with flat's L2.
        assert 1 <= equal["16"] <= equal["64"] <= equal["128"] <= equal["256"]
        low = model["equal_batch_tpot_flat_over_plugin_flat_l2"]
        assert all(1 <= low[b] <= equal[b] for b in equal)
    assert {p["workload"] for p in written["llama_anchor"]} == set(se.ANCHOR)
    for point in written["llama_anchor"]:  # each measured ratio's GPU named
        assert len(point["gpus"]) == point["runs"] == len(point["measured_tpot_flat_over_plugin"])
