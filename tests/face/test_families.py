"""``vllm-cascade check MODEL`` reads the model's config.json and says which of its layers can
run cascade. The configs are written as the model families ship them (raw keys: Gemma 3's
``sliding_window_pattern``, NemotronH's ``hybrid_override_pattern``, Jamba's attention period);
the layer kinds expected are transformers' own reading of the same keys."""

from __future__ import annotations

import json

import pytest

from vllm_cascade_plugin.face import cli, families


def saved(tmp_path, config: dict) -> str:
    folder = tmp_path / config.get("model_type", "model")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def transformers_kinds(layer_types: list[str]) -> list[str]:
    """transformers' layer names as the three kinds (``mlp`` layers mix no tokens)."""
    kinds = {"full_attention": families.FULL, "attention": families.FULL,
             "sliding_attention": families.SLIDING}
    return [kinds.get(t, families.RECURRENT) for t in layer_types if t != "mlp"]


def test_gemma3s_sliding_window_pattern_is_read_as_transformers_reads_it(tmp_path):
    from transformers import Gemma3TextConfig

    raw = {"model_type": "gemma3", "text_config": {
        "num_hidden_layers": 12, "sliding_window": 1024, "sliding_window_pattern": 6}}
    want = Gemma3TextConfig(num_hidden_layers=12, sliding_window_pattern=6).layer_types
    assert families.layer_kinds(raw) == transformers_kinds(want)
    model = saved(tmp_path, raw)
    lines, runs = families.model_lines(model, unverified=False)
    text = " ".join(lines)
    assert "2 full-attention, 10 sliding-window and 0 recurrent" in text
    assert runs is True and "CASCADE_UNVERIFIED" not in text, text
    assert "The 2 full-attention layer(s) can run cascade" in text
    assert "the 10 sliding-window layer(s) run flat" in text


@pytest.mark.parametrize(("raw", "reference"), [
    ({"model_type": "nemotron_h", "num_hidden_layers": 7, "hybrid_override_pattern": "M-M*-M-"},
     lambda: __import__("transformers").NemotronHConfig(
         hybrid_override_pattern="M-M*-M-", num_hidden_layers=7).layer_types),
    ({"model_type": "jamba", "num_hidden_layers": 16, "attn_layer_period": 8,
      "attn_layer_offset": 4},
     lambda: __import__("transformers").JambaConfig(
         num_hidden_layers=16, attn_layer_period=8, attn_layer_offset=4).layers_block_type),
    ({"model_type": "qwen3_next", "num_hidden_layers": 8,
      "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
      + ["full_attention"]},
     lambda: __import__("transformers").Qwen3NextConfig(num_hidden_layers=8).layer_types),
], ids=["nemotron_h", "jamba", "qwen3_next"])
def test_recurrent_hybrids_attention_layers_need_unverified_paths(tmp_path, raw, reference):
    kinds = families.layer_kinds(raw)
    assert kinds == transformers_kinds(reference())
    model = saved(tmp_path, raw)
    lines, runs = families.model_lines(model, unverified=False)
    assert runs is False and "beside recurrent ones" in " ".join(lines)
    lines, runs = families.model_lines(model, unverified=True)
    text = " ".join(lines)
    assert runs is True, text
    assert f"{kinds.count(families.FULL)} full-attention layer(s) can run cascade" in text
    assert f"the {kinds.count(families.RECURRENT)} recurrent layer(s) run as vLLM runs them" \
        in text


def test_gpt_oss_needs_unverified_paths_for_its_sinks(tmp_path):
    from transformers import GptOssConfig

    layer_types = GptOssConfig(num_hidden_layers=24).layer_types
    model = saved(tmp_path, {"model_type": "gpt_oss", "num_hidden_layers": 24,
                             "sliding_window": 128, "layer_types": layer_types})
    lines, runs = families.model_lines(model, unverified=False)
    text = " ".join(lines)
    assert runs is False and "attention sinks" in text and "12 full-attention" in text
    assert "hybrid KV cache" not in text, text  # its sinks alone keep it flat
    lines, runs = families.model_lines(model, unverified=True)
    assert runs is True and "12 sliding-window layer(s) run flat" in " ".join(lines)


def test_chunked_local_attention_keeps_every_layer_flat(tmp_path):
    """Llama 4's chunked local-attention layers: vLLM gives them a KV-cache group of their own
    (ChunkedLocalAttentionSpec), beside which the plugin plans no step
    (tests/integration/test_kv_groups.py), so ``check`` says every layer runs flat."""
    from transformers import Llama4TextConfig

    layer_types = Llama4TextConfig(num_hidden_layers=8).layer_types
    assert "chunked_attention" in layer_types and "full_attention" in layer_types
    raw = {"model_type": "llama4_text", "num_hidden_layers": 8, "layer_types": layer_types}
    kinds = families.layer_kinds(raw)
    assert kinds.count(families.CHUNKED) == layer_types.count("chunked_attention")
    model = saved(tmp_path, raw)
    for unverified in (False, True):
        lines, runs = families.model_lines(model, unverified)
        assert runs is False and "chunked local-attention" in " ".join(lines), lines


@pytest.mark.parametrize(("raw", "runs"), [
    ({"model_type": "llama", "num_hidden_layers": 32}, True),
    # Qwen2 ships a sliding_window it does not use.
    ({"model_type": "qwen2", "num_hidden_layers": 28, "sliding_window": 32768,
      "use_sliding_window": False}, True),
    ({"model_type": "mistral", "num_hidden_layers": 32, "sliding_window": 4096}, False),
    ({"model_type": "mamba", "num_hidden_layers": 24, "layer_types": ["mamba"] * 24}, False),
])
def test_one_kind_of_layer(tmp_path, raw, runs):
    lines, got = families.model_lines(saved(tmp_path, raw), unverified=False)
    assert got is runs, lines


def test_a_model_not_on_this_machine_is_said_so_and_changes_no_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    lines, runs = families.model_lines("nobody/no-such-model", unverified=False)
    assert runs is None and "not in that folder nor in the Hugging Face cache" in lines[0]


def test_a_downloaded_model_is_read_from_the_hugging_face_cache(tmp_path, monkeypatch):
    """Where huggingface_hub downloads a repository: its cache folder's snapshot of main."""
    from huggingface_hub import constants, try_to_load_from_cache

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--acme--tiny-gemma"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    config = {"model_type": "gemma3", "text_config": {
        "num_hidden_layers": 6, "sliding_window": 512, "sliding_window_pattern": 6}}
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(config))
    # huggingface_hub itself finds the same file there (the reference for the layout).
    assert try_to_load_from_cache("acme/tiny-gemma", "config.json") == str(
        repo / "snapshots" / "abc123" / "config.json")
    assert families.read_config("acme/tiny-gemma") == config


@pytest.mark.flashinfer  # check reports the installed FlashInfer
def test_check_with_a_model_whose_layers_all_run_flat_exits_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CASCADE_ATTENTION", "1")
    model = saved(tmp_path, {"model_type": "jamba", "num_hidden_layers": 8,
                             "attn_layer_period": 8, "attn_layer_offset": 4})
    assert cli.main(["check", model]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "1 full-attention, 0 sliding-window and 7 recurrent" in out
    assert "CASCADE_UNVERIFIED=1 runs the 1 full-attention layer(s)" in out
    assert "no attention layer of this model runs cascade" in out
