"""The served pairs of other model families (serve/bench.py --model, scripts/serve_grid.sh's
hybrid slices) without a GPU: rows name their model, a model's relative rates come from its own
flat bursts only, the hybrid plugin config, and the system-prompt workload's commands."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.serve import bench as sb
from benchmarks.serve import configs as sc
from benchmarks.serve import pairs as sp
from benchmarks.serve import results as sr
from benchmarks.serve import workloads as sw

ROOT = Path(__file__).parents[3]
GEMMA3, BAMBA, LLAMA3 = (ROOT / "examples" / "models" / m
                         for m in ("gemma3-12b", "bamba-9b", "llama3-8b"))


def _burst(config: str, rps: float, model: str | None = None) -> dict:
    row = {"workload": "chat_6k_system", "config": config, "request_rate": "burst",
           "tensor_parallel_size": 1, "request_throughput": rps, "completed": 256}
    return row if model is None else {**row, "model": model}


def test_the_hybrid_config_is_the_plugin_with_unverified_on_vllms_default_backend(tmp_path):
    config = sc.CONFIGS["cascade_flash_attn_hybrid"]
    assert config.backend == "FLASH_ATTN" and config.plugin_on
    assert sc.baseline("cascade_flash_attn_hybrid") == "flash_attn"
    env = sc.server_env(config, tmp_path)
    assert env["CASCADE_ATTENTION"] == "1" and env["CASCADE_UNVERIFIED"] == "1"


def test_a_row_without_a_model_served_llama_and_pairs_stay_within_a_model():
    assert sb.model_name(GEMMA3) == "gemma3-12b" and sb.model_name(f"{LLAMA3}/") == "llama3-8b"
    assert sp.model_of({"workload": "x"}) == sp.DEFAULT_MODEL == "llama3-8b"
    rows = [_burst("flash_attn", 10.0), _burst("cascade_flash_attn", 12.0),
            _burst("flash_attn", 4.0, "gemma3-12b"),
            _burst("cascade_flash_attn_hybrid", 5.0, "gemma3-12b")]
    assert sr.baseline_rates(rows, "flash_attn", 1) == {"chat_6k_system": 10.0}
    assert sr.baseline_rates(rows, "flash_attn", 1, "gemma3-12b") == {"chat_6k_system": 4.0}
    assert sr.baseline_rates(rows, "flash_attn", 1, "bamba-9b") == {}
    llama = sp.serve_runs(rows, "flash_attn", "cascade_flash_attn", "chat_6k_system")
    assert llama["burst"] == [(rows[0], rows[1])]
    assert sp.serve_runs(rows, "flash_attn", "cascade_flash_attn_hybrid", "chat_6k_system") == {}
    gemma = sp.serve_runs(rows, "flash_attn", "cascade_flash_attn_hybrid", "chat_6k_system",
                          model="gemma3-12b")
    assert gemma["burst"] == [(rows[2], rows[3])]


def test_a_models_relative_rates_come_from_its_own_flat_burst(tmp_path, capsys):
    out = tmp_path / "serve.json"
    out.write_text(json.dumps([_burst("flash_attn", 10.0), _burst("flash_attn", 4.0,
                                                                  "gemma3-12b")]))

    def dry(model: Path) -> str:
        assert sb.main(["--dry-run", "--model", str(model), "--out", str(out), "--work-dir",
                        str(tmp_path / "w"), "--configs", "cascade_flash_attn_hybrid",
                        "--workloads", "chat_6k_system", "--rates", "90%"]) == 0
        return capsys.readouterr().out

    assert "--request-rate 3.6 " in dry(GEMMA3)
    assert "--request-rate 9.0 " in dry(LLAMA3)
    bamba = dry(BAMBA)  # no bamba-9b burst on record: never another model's
    assert "<90% of flash_attn burst req/s on chat_6k_system>" in bamba


def test_the_system_prompt_workload_served_to_gemma3(tmp_path, capsys):
    """One 6K-token system prompt before 256-768 tokens of each user's own, 128 generated, in
    vLLM's random dataset; the server's max_model_len holds its longest request with Gemma 3's
    vocabulary (w262207: 7 characters) under vLLM's character check."""
    w = sw.WORKLOADS["chat_6k_system"]
    assert (w.prefix_len, w.input_len, w.output_len) == (6144, 6144 + 768, 128)
    assert sw.max_model_len([w], 262208) == 8192
    assert sb.main(["--dry-run", "--model", str(GEMMA3), "--out", str(tmp_path / "s.json"),
                    "--work-dir", str(tmp_path / "w"), "--configs",
                    "flash_attn,cascade_flash_attn_hybrid", "--workloads", "chat_6k_system",
                    "--rates", "burst"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# model gemma3-12b: ") and "max_model_len 8192" in printed
    servers = [x for x in printed.splitlines() if x.startswith("# server")]
    assert "CASCADE_UNVERIFIED=1" in servers[1] and "CASCADE_UNVERIFIED" not in servers[0]
    assert all("--max-model-len 8192" in x for x in servers)
    burst = next(x for x in printed.splitlines() if "chat_6k_system burst:" in x)
    for flag in ("--random-prefix-len 6144", "--random-input-len 512",
                 "--random-output-len 128", "--num-prompts 256"):
        assert flag in burst
