"""The ``vllm-cascade`` command on a CPU: check, demo, bench, and usage errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fresh_python import vllm_process
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.face import check, cli, demo, demo_engine

ROOT = Path(__file__).parents[2]
CLI = "vllm_cascade_plugin.face.cli"  # what the vllm-cascade command runs
SMALL = ["--system-tokens", "64", "--documents", "2", "--document-tokens", "256",
         "--questions", "3", "--max-tokens", "20"]


def run_cli(*args: str, forked: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m vllm_cascade_plugin.face.cli ARGS``; ``forked``: in a child of the fork server
    (tests/fresh_python.py), which has imported vLLM already, as the command does first."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("CASCADE_") and k != "VLLM_PLUGINS"}
    environ.update(env)
    if forked:
        return vllm_process(environ).run_module(CLI, list(args), environ)
    return subprocess.run([sys.executable, "-m", CLI, *args], env=environ, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CASCADE_") or name == "VLLM_PLUGINS":
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.flashinfer
def test_check_with_the_plugin_on_registers_for_real_and_exits_0_here_only_with_a_gpu():
    """Status 0: it will run here; without a CUDA GPU (this CPU suite) everything else being
    in place is status 3, and the report's last line says so."""
    import torch

    proc = run_cli("check", forked=True, CASCADE_ATTENTION="1")
    status = 0 if torch.cuda.is_available() else 3
    assert proc.returncode == status, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert out.endswith(f"Exit status {status}: {' '.join(check.EXIT_STATUS[status].split())}")
    for expected in ("Python", "torch", "GPU", "vLLM", "FlashInfer", "CASCADE_LOG_INTERVAL",
                     "Entry point vllm.general_plugins:cascade found",
                     "registers vllm_cascade_plugin.integration.flash_attn_backend."
                     "CascadeFlashAttentionBackend for the FLASH_ATTN backend",
                     "vllm_cascade_plugin.integration.flashinfer_backend.CascadeFlashInferBackend "
                     "for the FLASHINFER backend", "FLASH_ATTN, vLLM's default on Hopper",
                     "--attention-backend FLASHINFER", "prefix caching off (nothing is shared: "
                     "the plugin has nothing to do)",
                     "An FP8 KV cache (e4m3, per-layer scales) runs cascade while "
                     "CASCADE_FP8_KV is on (the default): CASCADE_FP8_KV=on",
                     "Off unless asked for (not verified on a GPU with this release, or "
                     "served slower than flat): tensor parallelism above 1, suffix speculative "
                     "decoding, the attention layers beside recurrent ones (Mamba hybrids) "
                     "under the hybrid KV-cache manager, and attention sinks (gpt-oss); and, "
                     "host time only, the V1 runner's steps known to share nothing without "
                     "their rows being read (Model Runner V2's are on): "
                     "CASCADE_UNVERIFIED=off"):
        assert expected in out
    assert "Traceback" not in proc.stderr


@pytest.mark.flashinfer
def test_check_with_the_plugin_off_says_why_and_exits_1(clean_env, capsys):
    assert cli.main(["check"]) == 1
    out = capsys.readouterr().out
    assert "the plugin stays OFF" in out and "CASCADE_ATTENTION is off" in out
    assert out.splitlines()[-1] == "Exit status 1: the plugin will not run (the reasons are above)."


@pytest.mark.flashinfer
def test_check_names_the_plugins_filter(clean_env, capsys):
    clean_env.setenv("CASCADE_ATTENTION", "1")
    clean_env.setenv("VLLM_PLUGINS", "other")
    assert cli.main(["check"]) == 1
    out = capsys.readouterr().out
    assert "VLLM_PLUGINS does not list 'cascade'" in out and "the plugin stays OFF" in out


@pytest.mark.flashinfer
def test_check_with_a_bad_knob_says_vllm_refuses_to_start_and_shows_the_other_knobs(clean_env,
                                                                                    capsys):
    """A bad knob makes register() raise in every vLLM process, so vLLM does not start (it does
    not run without the plugin); the other knobs still show the values they would have."""
    from vllm_cascade_plugin import register
    from vllm_cascade_plugin.config import ConfigError

    clean_env.setenv("CASCADE_ATTENTION", "1")
    clean_env.setenv("CASCADE_MAX_LEVELS", "1")
    clean_env.setenv("CASCADE_POLICY", "always")
    assert cli.main(["check"]) == 1
    out = capsys.readouterr().out
    assert "vLLM refuses to start" in out and "the plugin stays OFF" not in out
    assert "CASCADE_MAX_LEVELS='1' is not valid" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  CASCADE_")}
    assert lines["CASCADE_MAX_LEVELS"].endswith("-> INVALID (expected an integer >= 2)")
    assert lines["CASCADE_POLICY"].endswith("-> always")
    assert lines["CASCADE_MIN_SHARED_PAGES"].endswith("-> 1")  # unset: the default
    assert all(len(line) <= 100 for line in out.splitlines())
    with pytest.raises(ConfigError, match="CASCADE_MAX_LEVELS"):  # what vLLM's startup meets
        register()


def test_demo_on_a_cpu_prints_the_plan_the_check_and_the_gpu_run(clean_env, capsys):
    assert cli.main(["demo", "--cpu", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "6 requests = 2 documents x 3 questions" in out
    assert "level 1, shared: 1 group of 6 requests, 4 pages per group" in out
    assert "level 2, shared: 2 groups of 3 requests, 16 pages per group" in out
    assert "level 3, per request: 6 requests" in out
    assert "KV pages read per layer" in out and "Cost model" in out
    assert "tolerance 1e-04: PASS" in out
    assert "On a GPU, `vllm-cascade demo` runs this workload in vLLM" in out


@pytest.mark.parametrize(("graphs", "full", "step_ms"), [("1", "1", "0.45"), ("1", "0", "1.50"),
                                                         ("0", "1", "7.57")])
def test_demo_charges_the_step_cost_of_the_decode_graphs_setting(clean_env, capsys, graphs, full,
                                                                step_ms):
    """The demo's cost-model line uses the builder's model: the FA3 per-step cost with
    whole-step graphs (the default), with per-layer graphs only (CASCADE_FULL_GRAPHS=0), and the
    eager one (FA3_EAGER_STEP_FIXED_US) with CASCADE_CUDA_GRAPHS off."""
    from vllm_cascade_plugin.planning.cost import (
        COST_MODELS,
        FA3_EAGER_STEP_FIXED_US,
        FA3_LAYER_GRAPHS_STEP_FIXED_US,
    )

    clean_env.setenv("CASCADE_CUDA_GRAPHS", graphs)
    clean_env.setenv("CASCADE_FULL_GRAPHS", full)
    assert cli.main(["demo", "--cpu", *SMALL]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"with its per-step cost, {step_ms} ms" in out
    step_us = (FA3_EAGER_STEP_FIXED_US if graphs == "0" else COST_MODELS["fa3"].step_fixed_us
               if full == "1" else FA3_LAYER_GRAPHS_STEP_FIXED_US)
    assert f"{step_us / 1e3:.2f}" == step_ms  # the parameters follow the shipped calibration


def test_demo_with_a_bad_knob_exits_1_with_the_message(clean_env, capsys):
    clean_env.setenv("CASCADE_MIN_SHARED_PAGES", "0")
    assert cli.main(["demo", "--cpu", *SMALL]) == 1
    assert "CASCADE_MIN_SHARED_PAGES='0' is not valid" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    [], ["frobnicate"], ["demo", "--documents", "0"], ["demo", "--questions", "many"],
    ["demo", "--model", "/no/such/model"], ["demo", "--policy", "sometimes"],
    ["bench", "--nope"],  # check takes any arguments: vLLM's (tests/face/test_check.py)
])
def test_bad_arguments_are_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "usage: vllm-cascade" in capsys.readouterr().err


def test_bad_arguments_show_no_traceback():
    proc = run_cli("demo", "--max-tokens", "-3")
    assert proc.returncode == 2
    assert "usage: vllm-cascade demo" in proc.stderr and "must be >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def record(tokens: list[int], logprobs: list[float], margins: list[float] | None = None) -> dict:
    """An :func:`agreement.record` of one completion (boundary token -1 at its end)."""
    return {"tokens": [*tokens, -1], "logprobs": [*logprobs, 0.0],
            "margins": [*(margins or [1.0] * len(tokens)), 0.0]}


def fake_engines(monkeypatch, on: dict, off: dict, seen: list | None = None,
                 second: dict | None = None) -> None:
    """The GPU branch with the engines replaced by canned runs (no GPU needed): every request's
    record is ``on`` with the plugin, ``off`` without, ``second`` (default ``off``) without it on
    the second kernel."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")

    def fake_engine(model, workload, *, plugin, policy, log, backend):
        if seen is not None:
            seen.append((model, plugin, policy, backend))
        records = on if plugin else off if backend == demo_engine.BACKENDS[0] else second or off
        return demo_engine.EngineRun(plugin, 90.0 if plugin else 100.0, 1.0,
                                     3 * workload.requests, [records] * workload.requests,
                                     steps_planned=20, steps_cascade=18 * plugin, fallbacks={},
                                     backend=backend)

    monkeypatch.setattr(demo_engine, "run_engine", fake_engine)


def test_demo_gpu_path_reports_three_engines(clean_env, capsys, monkeypatch):
    seen: list = []
    fake_engines(monkeypatch, record([5, 6, 7], [-1.0, -2.0, -3.0]),
                 record([5, 6, 7], [-1.0, -2.0, -3.02]), seen,
                 second=record([5, 6, 7], [-1.0, -2.01, -3.0]))
    assert cli.main(["demo", "--model", "llama-tiny", "--policy", "always", *SMALL]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert seen == [("llama-tiny", False, "always", "FLASHINFER"),
                    ("llama-tiny", True, "always", "FLASHINFER"),
                    ("llama-tiny", False, "always", "FLASH_ATTN")]
    assert "plugin off 100 tok/s, plugin on 90 tok/s (0.90x)" in out
    assert "cascade ran on 18 of 20 engine steps; fallbacks: none" in out
    assert ("plugin on: max |d| 0.0200, mean 0.0067 over 18 tokens, 6 of 6 sequences identical"
            in out)
    assert ("plugin off, FLASH_ATTN (two correct kernels): max |d| 0.0200, mean 0.0100 over 18 "
            "tokens" in out)
    assert "within 1.5x of two correct kernels (mean, and max or 0.1): PASS" in out


# The verdict follows agreement.py: the plugin against plugin-off FLASHINFER, as close as the
# second kernel (FLASH_ATTN, plugin off) is.
@pytest.mark.parametrize(("on", "second", "status", "verdict"), [
    # Every token 0.05 off while two correct kernels differ by 0.01: beyond 1.5 times theirs.
    (record([5, 6, 7], [-1.05, -2.05, -3.05]), record([5, 6, 7], [-1.01, -2.01, -3.01]), 1,
     "FAIL"),
    # The same 0.05 where two correct kernels differ by 0.04: within 1.5 times theirs.
    (record([5, 6, 7], [-1.05, -2.05, -3.05]), record([5, 6, 7], [-1.04, -2.04, -3.04]), 0,
     "PASS"),
    # 0.5 off where the top-2 margin is below 0.1, which bf16 noise may flip: not compared.
    (record([5, 6, 7], [-1.0, -2.5, -3.0], [1.0, 0.05, 1.0]), record([5, 6, 7], [-1.0, -2.0,
                                                                                 -3.0]),
     0, "PASS"),
    # No position confident in both runs: nothing compared proves nothing.
    (record([5, 6, 7], [-1.0, -2.0, -3.0], [1e-6, 1e-6, 1e-6]), record([5, 6, 7],
                                                                       [-1.0, -2.0, -3.0]),
     1, "FAIL"),
])
def test_demo_gpu_verdict_is_relative_to_two_correct_kernels(clean_env, capsys, monkeypatch, on,
                                                              second, status, verdict):
    fake_engines(monkeypatch, on, record([5, 6, 7], [-1.0, -2.0, -3.0]), second=second)
    assert cli.main(["demo", "--model", "llama-tiny", *SMALL]) == status
    assert f"(mean, and max or 0.1): {verdict}" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("agrees", [False, True])
def test_demo_gpu_verdict_comes_from_agreement_agrees_relative(clean_env, capsys, monkeypatch,
                                                               agrees):
    from vllm_cascade_plugin.face import agreement

    calls = []
    monkeypatch.setattr(agreement, "agrees_relative", lambda *a: calls.append(a) or agrees)
    same = record([5, 6, 7], [-1.0, -2.0, -3.0])
    fake_engines(monkeypatch, same, same)
    assert cli.main(["demo", "--model", "llama-tiny", *SMALL]) == (0 if agrees else 1)
    plugin, kernels = calls[0]  # what agreement.measure found
    assert (plugin.compared, plugin.positions, kernels.compared) == (18, 18, 18)
    out = " ".join(capsys.readouterr().out.split())
    assert f"(mean, and max or 0.1): {'PASS' if agrees else 'FAIL'}" in out


def test_compare_is_agreement_py_s_and_counts_identical_sequences():
    on = demo_engine.EngineRun(True, 1.0, 1.0, 6, [record([1, 2, 3], [0.0, -1.0, -9.0]),
                                                   record([4, 5, 6], [-1.0, -1.0, -1.0],
                                                          [1.0, 0.01, 1.0])])
    off = demo_engine.EngineRun(False, 1.0, 1.0, 6, [record([1, 9, 3], [-0.05, -1.0, 0.0]),
                                                     record([4, 5, 6], [-1.0, -1.5, -1.02])])
    result = demo_engine.compare(on, off)
    # 1 token of the first pair (then they diverge), 2 of the second (5's margin is too small).
    assert result.deviation.compared == 3
    assert result.deviation.positions == 6
    assert result.deviation.worst == pytest.approx(0.05)
    assert result.deviation.mean == pytest.approx(0.07 / 3)
    assert (result.identical_sequences, result.sequences) == (1, 2)


def test_demo_engine_weights_have_the_margins_agreement_needs():
    """vLLM's dummy weights (uniform +-1e-3) give near-flat logits: no top-2 margin above
    agreement.MARGIN, nothing to compare. init_weights (transformers' init, in place) gives
    margins above it at many positions, the same weights for the same seed, norms at 1."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_cascade_plugin.face import agreement

    config = LlamaConfig(hidden_size=1024, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=8000)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, 8000, (1, 32), generator=torch.Generator().manual_seed(0))

    def margins() -> torch.Tensor:
        with torch.no_grad():
            top = model(tokens).logits.float().log_softmax(-1).topk(2, -1).values
        return top[..., 0] - top[..., 1]

    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-1e-3, 1e-3)  # vLLM's initialize_dummy_weights
    assert (margins() < 1e-3).all()
    demo_engine.init_weights(model)
    assert (margins() > agreement.MARGIN).float().mean() > 0.25
    assert model.model.norm.weight.eq(1).all()
    weight = model.model.layers[0].mlp.down_proj.weight.clone()
    assert weight.std().item() == pytest.approx(0.02, rel=0.05)
    demo_engine.init_weights(model)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, weight)


def test_vllm_llm_apply_model_runs_a_function_on_the_model():
    """The one vLLM API the demo's engine calls besides LLM and generate (init_weights)."""
    import inspect

    from vllm import LLM

    assert list(inspect.signature(LLM.apply_model).parameters) == ["self", "func"]


def test_prefix_cache_shares_full_blocks_of_identical_prefixes_only():
    shared = list(range(100, 140))  # 2 full pages and 8 tokens of a third
    a, b = shared + [1] * 10, shared + [2] * 10
    table, seq_lens, query_lens = demo.prefix_cached_step([a, b, a], generated=5, page_size=16)
    assert (table[0, :2] == table[1, :2]).all() and table[0, 2] != table[1, 2]
    assert (table[0, :3] == table[2, :3]).all()  # identical full third page: shared too
    assert table[0, 3] != table[2, 3]  # the partial page (prompt tail + generated) is private
    assert seq_lens.tolist() == [55, 55, 55] and query_lens.tolist() == [1, 1, 1]
    assert 0 not in table[:, :4]


def test_plan_demo_matches_flat_attention_and_predicts_the_saving():
    result = demo.plan_demo(demo.Workload(64, 2, 256, 3, 16, 20), "llama-tiny", CascadeConfig())
    assert result.check.passed and result.plan.num_levels == 3
    assert result.plan.stats.pages_cascade < result.plan.stats.pages_flat
    assert result.page_bytes == 2 * 16 * 2 * 128 * 2 * 4


@pytest.mark.parametrize("name", sorted(demo.MODELS))
def test_demo_models_equal_the_shipped_configs(name):
    shipped = json.loads((ROOT / "examples" / "models" / name / "config.json").read_text())
    assert demo.MODELS[name] == shipped


def test_bench_on_a_cpu_runs_the_planner_and_skips_gpu_parts(tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[1/4] planner (CPU)" in out
    assert "[2/4] kernels (GPU): skipped" in out
    assert "[3/4] end to end, vLLM (GPU): skipped, needs a CUDA GPU" in out
    rows = json.loads((tmp_path / "planner.json").read_text())
    assert {r["case"] for r in rows} and all(r["steady_median_us"] > 0 for r in rows)
    if importlib.util.find_spec("matplotlib") is None:
        assert "[4/4] plots (PNG): skipped, matplotlib is not installed" in out
    else:
        assert (tmp_path / "planner.png").stat().st_size > 0


@pytest.mark.parametrize("quick", [False, True])
def test_bench_on_a_gpu_runs_the_kernel_grid_before_the_engines(tmp_path, capsys, monkeypatch,
                                                                quick):
    """The GPU branch with every benchmark process replaced by a recorder (no GPU needed)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    commands = []

    def record(command, cwd, check):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(cli.subprocess, "run", record)
    assert cli.main(["bench", "--out", str(tmp_path), *(["--quick"] if quick else [])]) == 0
    modules = [c[2] for c in commands]
    assert modules[:3] == ["benchmarks.host.planner", "benchmarks.kernels.bench",
                           "benchmarks.e2e.bench"]
    assert all((ROOT / (m.replace(".", "/") + ".py")).is_file() for m in modules)
    kernel = commands[1]
    assert kernel[:2] == [sys.executable, "-m"]
    assert kernel[3:] == ["--out", str(tmp_path.resolve()), *(["--quick"] if quick else [])]
    assert "[2/4] kernels (GPU): " in capsys.readouterr().out
