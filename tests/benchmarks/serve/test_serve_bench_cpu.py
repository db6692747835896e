"""benchmarks/serve/ without a GPU: commands, tokenizer, datasets, parsing, rows, the loop.

The modules are imported from the ``benchmarks`` package. vLLM's own argument parsers, tokenizer
loader and benchmark datasets check the commands and prompts where vLLM is installed; the whole
loop runs against a stand-in for ``vllm serve`` / ``vllm bench serve`` (a small HTTP server and a
client writing vLLM's result fields), so process handling, rates and files are exercised too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serve import bench as sb
from benchmarks.serve import configs as sc
from benchmarks.serve import metrics as sm
from benchmarks.serve import processes as sp
from benchmarks.serve import results as sr
from benchmarks.serve import workloads as sw

ROOT = Path(__file__).parents[3]
SRC = ROOT.resolve() / "src"  # what a server process imports the plugin from
TINY = ROOT / "examples" / "models" / "llama-tiny"  # vocab 32000, bos 1, eos 2
LLAMA3 = ROOT / "examples" / "models" / "llama3-8b"  # vocab 128256, bos 128000, eos 128001
GEMMA3 = ROOT / "examples" / "models" / "gemma3-12b"  # vocab 262208, bos 2, eos 1

ROW_KEYS = ["workload", "config", "request_rate", "tensor_parallel_size", "output_tok_per_s",
            "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "cascade_step_fraction",
            "graph_replay_fraction", "capture_warnings"]




def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def _args(**kw):
    return sb.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return sw.write_model_folder(TINY, tmp_path_factory.mktemp("m") / "model")


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    pytest.importorskip("vllm")
    from vllm.tokenizers import get_tokenizer  # what vllm serve and vllm bench serve load

    return get_tokenizer(str(tiny_model))


# --- commands ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("config", "backend", "plugin"), [
    ("flashinfer", "FLASHINFER", "0"), ("cascade", "FLASHINFER", "1"),
    ("flash_attn", "FLASH_ATTN", "0"), ("cascade_flash_attn", "FLASH_ATTN", "1")])
def test_server_command_and_environment_of_each_config(config, backend, plugin, tmp_path,
                                                      monkeypatch):
    args = _args(gpu_memory_utilization=0.8, tensor_parallel_size=2, seed=7)
    cmd = sc.server_command(sc.CONFIGS[config], tmp_path, 8123, 8704, args)
    assert cmd[:4] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
    assert cmd[4] == str(tmp_path) and _flag(cmd, "--tokenizer") == str(tmp_path)
    assert _flag(cmd, "--attention-backend") == backend
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "8123"
    assert _flag(cmd, "--load-format") == "dummy" and _flag(cmd, "--max-model-len") == "8704"
    assert _flag(cmd, "--gpu-memory-utilization") == "0.8"
    assert _flag(cmd, "--tensor-parallel-size") == "2" and _flag(cmd, "--seed") == "7"
    assert {"--enable-prefix-caching", "--no-enable-flashinfer-autotune"} <= set(cmd)
    monkeypatch.setenv("CASCADE_POLICY", "always")  # a caller's plugin settings never leak in
    env = sc.server_env(sc.CONFIGS[config], tmp_path / "prom")
    assert env["CASCADE_ATTENTION"] == plugin and "CASCADE_POLICY" not in env
    assert env["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path / "prom")
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert sc.CONFIGS[config].plugin_on == (plugin == "1")


def test_a_config_with_extra_arguments_passes_them_on(tmp_path):
    config = sc.Config("FLASH_ATTN", {"CASCADE_ATTENTION": "1", "CASCADE_KERNEL": "fa3"},
                       ("--max-num-seqs", "128"))
    cmd = sc.server_command(config, tmp_path, 1, 2, _args())
    assert cmd[-2:] == ["--max-num-seqs", "128"]
    assert sc.server_env(config, tmp_path)["CASCADE_KERNEL"] == "fa3" and config.plugin_on


def _run_in_server_env(probe: str, env: dict[str, str]) -> list[str]:
    """``probe``'s printed words, run by a fresh Python in a server's environment ``env``
    (``configs.server_env``, built with this checkout's ``src`` on ``PYTHONPATH``)."""
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, check=True).stdout.split()


def test_the_host_delay_config_delays_every_planning_of_its_servers_processes(tmp_path,
                                                                              monkeypatch):
    """Its servers' processes start with 1 ms of busy host time before each planning call
    (benchmarks/serve/probes/host_delay/sitecustomize.py): a fresh Python with the server's
    environment
    finds ``plan_rows`` wrapped, and a call takes at least the delay before it reaches the
    plugin's own ``plan_rows`` (which refuses these arguments)."""
    monkeypatch.setenv("PYTHONPATH", str(SRC))
    assert sc.CONFIGS["cascade_flash_attn_host_delay_4ms"].env[
        "CASCADE_BENCH_HOST_DELAY_US"] == "4000"
    config = sc.CONFIGS["cascade_flash_attn_host_delay_1ms"]
    env = sc.server_env(config, tmp_path / "prom")
    assert env["CASCADE_BENCH_HOST_DELAY_US"] == "1000" and config.plugin_on
    assert env["PYTHONPATH"].split(os.pathsep)[-1] == str(SRC)
    probe = ("import time\n"
             "from vllm_cascade_plugin.integration import hooks_dispatch as h\n"
             "start = time.perf_counter()\n"
             "try:\n    h.plan_rows(None, None, None, None, None, None)\n"
             "except TypeError:\n    pass\n"
             "print(h.plan_rows.__name__, time.perf_counter() - start)\n")
    out = _run_in_server_env(probe, env)
    assert out[0] == "_delayed_plan_rows" and float(out[1]) >= 0.001
    plain = _run_in_server_env(probe, sc.server_env(sc.CONFIGS["cascade_flash_attn"], tmp_path))
    assert plain[0] == "plan_rows"


def test_a_model_vllm_does_not_ship_is_registered_in_its_servers_beside_the_timeline_probe(
        tmp_path, monkeypatch):
    """The gpt-oss dense stand-in's servers (every config) start with its registration folder
    first on the path: a fresh Python with the server's environment finds the architecture in
    vLLM's ModelRegistry, and the step-timeline probe's ``sitecustomize`` still ran (the
    registration's runs the next one on the path). A model vLLM ships needs none."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("PYTHONPATH", str(SRC))
    folder = ROOT / "examples/models/gpt-oss-20b-dense"
    env = sc.server_env(sc.CONFIGS["cascade_flash_attn_hybrid"], tmp_path, tmp_path / "t.json",
                        folder)
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert paths[:2] == [str(sc.REGISTERED["GptOssDenseForCausalLM"]), str(sc.TIMELINE)]
    probe = ("import sitecustomize\n"
             "from vllm.model_executor.models import ModelRegistry\n"
             "print('@@', 'GptOssDenseForCausalLM' in ModelRegistry.get_supported_archs(),\n"
             "      sitecustomize.SHADOWED.__file__)\n")
    out = _run_in_server_env(probe, env)
    registered, shadowed = out[out.index("@@") + 1:]  # vLLM may print its own lines first
    assert registered == "True" and Path(shadowed) == sc.TIMELINE / "sitecustomize.py"
    assert sc.model_pythonpath(ROOT / "examples/models/gemma3-12b") == []


def test_the_capture_second_config_captures_each_graph_at_its_keys_second_sighting(
        tmp_path, monkeypatch):
    """Its servers' processes (benchmarks/serve/probes/capture_after/sitecustomize.py) make
    every graph
    cache capture a key the second time it comes: after the cache's first graph (captured at
    its key's second run, after one eager run, in both), a new key runs eagerly once and is
    captured when it comes again; the plugin's plain config captures it at once. The whole-step
    graphs' cache is made the same way."""
    monkeypatch.setenv("PYTHONPATH", str(SRC))
    probe = ("from vllm_cascade_plugin.graphs.capture import LayerGraphs\n"
             "from vllm_cascade_plugin.graphs.fullgraph import StepGraphs\n"
             "graphs = LayerGraphs(capture=lambda fn: (fn, fn()))\n"
             "counts = []\n"
             "for key in ('a', 'a', 'b', 'b', 'b'):\n"
             "    graphs.run((key,), lambda: 0)\n"
             "    counts.append(graphs.captures)\n"
             "print(*counts, StepGraphs(None, capture=lambda fn: (fn, fn())).capture_after)\n")
    config = sc.CONFIGS["cascade_flash_attn_capture_second"]
    assert config.plugin_on and config.backend == "FLASH_ATTN"
    assert _run_in_server_env(probe, sc.server_env(config, tmp_path)) == "0 1 1 2 2 2".split()
    plain = sc.server_env(sc.CONFIGS["cascade_flash_attn"], tmp_path)
    assert _run_in_server_env(probe, plain) == "0 1 2 2 2 1".split()


@pytest.mark.parametrize(("config", "term"), [("cascade_flash_attn_split_off", 1e12),
                                             ("cascade_flash_attn_split_free", 0.0),
                                             ("cascade_flash_attn_split_mixed", None)])
def test_the_split_configs_split_mixed_steps_at_their_per_step_term(
        tmp_path, monkeypatch, config, term):
    """Their servers' processes split mixed steps (CASCADE_SPLIT_MIXED on), with the cost
    model's per-step term of a split step changed where they say so
    (benchmarks/serve/probes/split_cost/sitecustomize.py), so the FLASH_ATTN builder's split
    cost model
    built after start-up has it; the plugin's plain config's processes keep the shipped term
    and do not split (they plan mixed steps whole)."""
    from vllm_cascade_plugin.planning import cost

    monkeypatch.setenv("PYTHONPATH", str(SRC))
    probe = ("from vllm_cascade_plugin.planning import cost\n"
             "from vllm_cascade_plugin.config import load_config\n"
             "print(cost.cost_model_for('fa3', split=True).step_fixed_us)\n"
             "print(load_config().split_mixed)\n")
    changed = sc.CONFIGS[config]
    assert changed.plugin_on and changed.backend == "FLASH_ATTN"
    out = _run_in_server_env(probe, sc.server_env(changed, tmp_path))
    assert out == [str(cost.FA3_SPLIT_STEP_FIXED_US if term is None else float(term)), "True"]
    plain = _run_in_server_env(probe, sc.server_env(sc.CONFIGS["cascade_flash_attn"], tmp_path))
    assert plain == [str(cost.FA3_SPLIT_STEP_FIXED_US), "False"]
    assert cost.FA3_SPLIT_STEP_FIXED_US > 0


@pytest.mark.parametrize(("config", "want"),
                         [("cascade_flash_attn", ["True", "100", "True"]),
                          ("cascade_flash_attn_mixed_whole", ["True", "100", "True"]),
                          ("cascade_flash_attn_split_off", ["False", "63", "False"])])
def test_a_mixed_step_is_planned_whole_by_default_and_flat_in_the_split_off_config(
        tmp_path, monkeypatch, config, want):
    """Each config's server process, configured from its environment (load_config): behind one
    32K-token document, 63 decode rows and a prefill chunk of 37 tokens are one cascade plan of
    100 query tokens, charged the eager cost, and run as cascade with the defaults (the
    mixed_whole config spells them out); the split_off config (CASCADE_SPLIT_MIXED=1 at a split
    term no plan repays) plans the decode rows alone and keeps the step flat, the plugin's
    mixed steps before they were planned whole."""
    monkeypatch.setenv("PYTHONPATH", str(SRC))
    probe = ("import numpy as np\n"
             "from vllm_cascade_plugin.config import load_config\n"
             "from vllm_cascade_plugin.planning.cost import AttentionShape, cost_model_for, "
             "flash_attn_flat\n"
             "from vllm_cascade_plugin.step import session\n"
             "fa3 = lambda **kw: flash_attn_flat(cost_model_for('fa3', **kw))\n"
             "session.configure(load_config(), AttentionShape(32, 8, 128, 2, 32),"
             " 16, None, cost_model=fa3(decode_graphs=False), steady_cost_model=fa3(),"
             " capture_sizes=(8, 16, 32, 64, 128), split_cost_model=fa3(split=True))\n"
             "table = np.zeros((64, 2052), np.int32)\n"
             "table[:, :2048] = np.arange(1, 2049)\n"
             "table[:, 2048:] = 10_000 + np.arange(64 * 4).reshape(64, 4)\n"
             "q = np.ones(64, np.int32)\n"
             "q[5] = 37\n"
             "step = session.plan_step(table, np.full(64, 32768 + 40, np.int32), q)\n"
             "print(step.decode_rows is None, step.plan.stats.num_tokens,"
             " step.decision.use_cascade)\n")
    chosen = sc.CONFIGS[config]
    assert chosen.plugin_on and chosen.backend == "FLASH_ATTN"
    assert _run_in_server_env(probe, sc.server_env(chosen, tmp_path)) == want


def _client(workload: str, rate, n=64, data=None, result=("/r", "x.json")):
    w = sw.WORKLOADS[workload]
    return sw.client_command(w, Path("/m"), 9000, rate, n, 5, data, result)


def test_client_commands_of_each_workload_kind():
    cmd = _client("prefix_8k_x4", "burst")
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    assert _flag(cmd, "--dataset-name") == "prefix_repetition"
    assert _flag(cmd, "--prefix-repetition-prefix-len") == "8192"
    assert _flag(cmd, "--prefix-repetition-num-prefixes") == "4"
    assert _flag(cmd, "--prefix-repetition-suffix-len") == "64"
    assert _flag(cmd, "--prefix-repetition-output-len") == "256"
    assert _flag(cmd, "--request-rate") == "inf" and _flag(cmd, "--num-prompts") == "64"
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "9000"
    assert _flag(cmd, "--percentile-metrics").split(",")[:3] == ["ttft", "tpot", "itl"]
    assert _flag(cmd, "--metric-percentiles") == "50,99" and "--ignore-eos" in cmd
    assert _flag(cmd, "--result-dir") == "/r" and _flag(cmd, "--result-filename") == "x.json"
    assert "--save-result" in cmd and _flag(cmd, "--seed") == "5"
    random = _client("random_32k", 2.5)
    assert _flag(random, "--dataset-name") == "random"
    assert _flag(random, "--random-input-len") == str(32768 + 64)
    assert _flag(random, "--random-prefix-len") == "0" and _flag(random, "--request-rate") == "2.5"
    tree = _client("tree_2k_4x8k", 1.0, data=Path("/d/t.jsonl"), result=None)
    assert _flag(tree, "--dataset-name") == "custom"
    assert _flag(tree, "--dataset-path") == "/d/t.jsonl"
    assert {"--skip-chat-template", "--disable-shuffle", "--no-oversample"} <= set(tree)
    assert _flag(tree, "--custom-output-len") == "256"
    assert "--save-result" not in tree  # a warm-up's result is not kept


def test_vllms_own_parsers_accept_the_commands(tmp_path):
    """vLLM's own ``serve`` and ``bench serve`` parsers read every flag as meant (a CPU platform
    stands in for the GPU; in a subprocess, so no other test sees it)."""
    pytest.importorskip("vllm")
    server = sc.server_command(sc.CONFIGS["cascade"], tmp_path, 8100, 8704, _args())
    piecewise = sc.server_command(sc.CONFIGS["flash_attn_piecewise"], tmp_path, 8101, 8704,
                                  _args())
    fp8 = sc.server_command(sc.CONFIGS["cascade_flash_attn_fp8"], tmp_path, 8102, 8704, _args())
    clients = [_client("prefix_8k_x4", "burst"), _client("random_2k", 3.0),
               _client("tree_2k_4x8k", 1.5, data=tmp_path / "t.jsonl")]
    script = textwrap.dedent("""
        import json, sys
        import vllm.platforms
        from vllm.platforms.cpu import CpuPlatform
        vllm.platforms._current_platform = CpuPlatform()
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        try:  # where `vllm serve`'s parser lives in 0.26; 0.33 has it in vllm.entrypoints.common
            from vllm.entrypoints.openai.cli_args import make_arg_parser
        except ImportError:
            from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.benchmarks.serve import add_cli_args
        server, piecewise, fp8, clients = json.loads(sys.argv[1])
        a = make_arg_parser(FlexibleArgumentParser()).parse_args(server[4:])
        out = {"server": [a.model_tag, str(a.attention_backend), a.enable_prefix_caching,
                          a.enable_flashinfer_autotune, a.load_format, a.max_model_len,
                          a.host, a.port, a.seed, a.tensor_parallel_size]}
        p = make_arg_parser(FlexibleArgumentParser()).parse_args(piecewise[4:])
        out["piecewise"] = [str(p.attention_backend), p.compilation_config.cudagraph_mode.name,
                            a.compilation_config.cudagraph_mode]
        f = make_arg_parser(FlexibleArgumentParser()).parse_args(fp8[4:])
        out["fp8"] = [f.kv_cache_dtype, a.kv_cache_dtype]
        parser = FlexibleArgumentParser(); add_cli_args(parser)
        plain = (str, int, float, bool, type(None))
        out["clients"] = [{k: v for k, v in vars(parser.parse_args(c[5:])).items()
                           if isinstance(v, plain)} for c in clients]
        print("PARSED" + json.dumps(out, default=str))
    """)
    proc = subprocess.run([sys.executable, "-c", script,
                           json.dumps([server, piecewise, fp8, clients])],
                          capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PARSED")), None)
    assert line is not None, proc.stderr[-3000:]
    parsed = json.loads(line[6:])
    assert parsed["server"] == [str(tmp_path), "FLASHINFER", True, False, "dummy", 8704,
                                "127.0.0.1", 8100, 0, 1]
    # flash_attn_piecewise: vLLM's piecewise graphs only; the others leave vLLM's default.
    assert parsed["piecewise"] == ["FLASH_ATTN", "PIECEWISE", None]
    assert parsed["fp8"] == ["fp8", "auto"]  # the FP8 pair's cache; vLLM's default otherwise
    assert sc.server_env(sc.CONFIGS["cascade_flash_attn_fp8"], tmp_path)["CASCADE_FP8_KV"] == "1"
    prefix, random, tree = parsed["clients"]
    assert prefix["dataset_name"] == "prefix_repetition" and prefix["request_rate"] == float("inf")
    assert prefix["prefix_repetition_prefix_len"] == 8192 and prefix["ignore_eos"]
    assert prefix["save_result"] and prefix["metric_percentiles"] == "50,99"
    assert prefix["temperature"] == 0 and prefix["backend"] == "openai"
    assert random["random_input_len"] == 2112 and random["request_rate"] == 3.0
    assert tree["dataset_name"] == "custom" and tree["skip_chat_template"]
    assert tree["custom_output_len"] == 256 and tree["dataset_path"] == str(tmp_path / "t.jsonl")


# --- tokenizer and prompts ----------------------------------------------------------------------


def test_model_folder_holds_config_and_tokenizer(tiny_model):
    assert json.loads((tiny_model / "config.json").read_text()) == json.loads(
        (TINY / "config.json").read_text())
    config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("w1", "w2")


@pytest.mark.parametrize("source", [TINY, LLAMA3])
def test_random_ids_decode_and_reencode_exactly(source, tmp_path):
    """Every id, the special ones too (prefix_repetition draws from the whole vocabulary)."""
    pytest.importorskip("vllm")
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(sw.write_model_folder(source, tmp_path / "m")))
    config = json.loads((source / "config.json").read_text())
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"],
                                                    config["eos_token_id"])
    assert tok.vocab_size == config["vocab_size"] and tok.num_special_tokens_to_add() == 0
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], 20000).tolist()
    ids[:8] = [0, 1, 2, 10, 12, 21, config["bos_token_id"], config["eos_token_id"]]
    ids += list(range(0, config["vocab_size"], 997))
    text = tok.decode(ids)
    assert text.split()[:3] == ["w0", "w1", "w2"]
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok(text).input_ids == ids  # what the server does with a completion's prompt


def test_vllms_prefix_repetition_and_random_prompts_are_exact(hf_tokenizer):
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset, RandomDataset

    requests = PrefixRepetitionRandomDataset(random_seed=3).sample(
        hf_tokenizer, num_requests=16, prefix_len=256, suffix_len=64, num_prefixes=4,
        output_len=8)
    ids = [hf_tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
    assert all(len(x) == r.prompt_len == 320 for x, r in zip(ids, requests, strict=True))
    assert len({tuple(x[:256]) for x in ids}) == 4  # four shared prefixes, four prompts each
    requests = RandomDataset(random_seed=3).sample(
        hf_tokenizer, num_requests=8, input_len=300, output_len=8)
    lens = [len(hf_tokenizer.encode(r.prompt, add_special_tokens=False)) for r in requests]
    assert lens == [r.prompt_len for r in requests] == [300] * 8


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_tree_dataset_shares_the_system_prompt_and_each_document(hf_tokenizer, tmp_path):
    w = sw.WORKLOADS["tree_2k_4x8k"]
    path = sw.write_tree_dataset(tmp_path / "t.jsonl", w, 24, 11, 32000, [1, 2])
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 24 and {x["output_tokens"] for x in lines} == {256}
    ids = [hf_tokenizer(x["prompt"]).input_ids for x in lines]  # as CustomDataset counts
    assert {len(x) for x in ids} == {2048 + 8192 + 64}
    assert len({tuple(x[:2048]) for x in ids}) == 1
    docs = {tuple(x[2048:2048 + 8192]) for x in ids}
    assert len(docs) == 4
    assert sorted(sum(tuple(x[2048:10240]) == d for x in ids) for d in docs) == [6] * 4
    for a in ids:
        for b in ids:
            if a is not b:  # diverge right after the system prompt or right after the document
                assert _common(a, b) in range(2048, 2048 + 16) or _common(a, b) in range(
                    10240, 10240 + 16)
    assert not {1, 2} & {t for x in ids for t in x}
    other = sw.tree_prompts(w, 4, 12, 32000)
    assert other[0][:2048] != ids[0][:2048]  # another run's seed: another tree


def test_vllms_custom_dataset_reads_the_tree_file(hf_tokenizer, tmp_path):
    pytest.importorskip("pandas")
    from vllm.benchmarks.datasets.datasets import CustomDataset

    w = sw.Workload("t", "tree", prefix_len=40, groups=3, doc_len=50, suffix_len=10)
    path = sw.write_tree_dataset(tmp_path / "t.jsonl", w, 9, 1, 32000)
    requests = CustomDataset(dataset_path=str(path), disable_shuffle=True).sample(
        hf_tokenizer, num_requests=9, output_len=256, skip_chat_template=True)
    assert [r.prompt_len for r in requests] == [100] * 9
    assert [r.prompt for r in requests] == [json.loads(x)["prompt"]
                                            for x in path.read_text().splitlines()]


def test_workload_lengths_and_max_model_len():
    w = sw.WORKLOADS
    assert {w[f"prefix_{k}k_x{g}"].groups for k in (2, 8, 32) for g in (1, 4, 16)} == {1, 4, 16}
    assert w["prefix_32k_x16"].total_len == 32768 + 64 + 256
    assert w["random_8k"].input_len == w["prefix_8k_x1"].input_len == 8192 + 64
    # Llama 3's longest word is w128255 (7 characters, 8 with its space): an 8,256-token
    # prompt may take 66,048 characters, 9,436 tokens' worth by vLLM's character check.
    assert sw.max_model_len([w["prefix_8k_x4"]], 128256) == 9728  # 9692 -> a multiple of 256
    assert sw.max_model_len([w["prefix_2k_x1"], w["prefix_32k_x1"]], 128256) == 37888
    # w31999 (6 characters): 256 tokens take up to 1,792 characters, 299 tokens' worth.
    assert sw.max_model_len([sw.Workload("a", "random", suffix_len=256, output_len=256)],
                            32000) == 768


@pytest.mark.parametrize("source", [TINY, LLAMA3, GEMMA3])
def test_every_workloads_longest_prompt_passes_vllms_own_length_checks(source, tmp_path):
    """vLLM refuses, before tokenizing, a prompt of more characters than its input token limit
    times the vocabulary's longest token (400 Bad Request). The worst prompt of each workload
    (every word the longest, joined by spaces) passes that check and the token check at the
    max_model_len the servers get, with the workload's own max_tokens."""
    pytest.importorskip("vllm")
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.params import TokenizeParams
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(sw.write_model_folder(source, tmp_path / "m")))
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    longest = f"w{vocab - 1}"
    for w in sw.WORKLOADS.values():
        limit = sw.max_model_len([w], vocab)
        params = TokenizeParams(max_total_tokens=limit, max_output_tokens=w.output_len)
        prompt = " ".join([longest] * w.input_len)
        assert params.apply_pre_tokenization(tok, {"prompt": prompt})["prompt"] == prompt
        assert len(params._token_len_check(tok, tok.encode(prompt))) == w.input_len
    prompt = " ".join([longest] * (limit + 1))  # the check is real: one that is too long
    with pytest.raises(VLLMValidationError, match="maximum context length"):
        TokenizeParams(max_total_tokens=limit, max_output_tokens=256).apply_pre_tokenization(
            tok, {"prompt": prompt})


# --- rates ------------------------------------------------------------------------------------


BURST_RESULT = {  # the fields vllm bench serve --save-result writes (0.26), values made up
    "date": "20261201-120000", "backend": "openai", "num_prompts": 256, "request_rate": "inf",
    "duration": 32.0, "completed": 256, "failed": 0, "total_input_tokens": 2113536,
    "total_output_tokens": 65536, "request_throughput": 8.0, "output_throughput": 2048.0,
    "mean_ttft_ms": 900.0, "median_ttft_ms": 850.0, "p50_ttft_ms": 850.0, "p99_ttft_ms": 4000.0,
    "mean_tpot_ms": 30.0, "median_tpot_ms": 29.0, "p50_tpot_ms": 29.0, "p99_tpot_ms": 45.0,
    "p50_itl_ms": 28.0, "p99_itl_ms": 60.0, "p50_e2el_ms": 9000.0, "max_concurrent_requests": 256}


def test_rates_derived_from_a_burst_result():
    sustainable = sw.sustainable_rate(BURST_RESULT)
    assert sustainable == 8.0
    assert sw.resolve_rate("50%", sustainable) == 4.0
    assert sw.resolve_rate("90%", sustainable) == 7.2
    assert sw.resolve_rate("90%", 7.777) == 7.0  # 6.9993 with three significant digits
    assert sw.resolve_rate("50%", None) is None and sw.resolve_rate("3", None) == 3.0
    assert sw.resolve_rate("burst", None) == "burst"
    w4, w16 = sw.WORKLOADS["prefix_8k_x4"], sw.WORKLOADS["prefix_8k_x16"]
    assert sw.num_prompts(w4, 4.0, None, 60) == 240
    assert sw.num_prompts(w16, 7.2, None, 60) == 432  # already 27 per prefix
    assert sw.num_prompts(w16, 3.33, None, 60) == 208  # 200 -> whole prefixes
    assert sw.num_prompts(w4, 0.01, None, 60) == 16  # never fewer than 16
    assert sw.num_prompts(w4, "burst", None, 60) == 256
    assert sw.num_prompts(sw.WORKLOADS["random_32k"], "burst", None, 60) == 32
    assert sw.num_prompts(w16, 4.0, 100, 60) == 112
    with pytest.raises(ValueError, match="completed no request"):
        sw.sustainable_rate({**BURST_RESULT, "completed": 0})


def test_rate_items_are_validated_and_the_burst_goes_first():
    assert sw.parse_rates("90%,burst,2.5,90%") == ["burst", "90%", "2.5"]
    for bad in ("fast", "-1", "0%", "inf"):
        with pytest.raises(ValueError):
            sw.parse_rates(bad)
    with pytest.raises(SystemExit):
        sb.parse_args(["--rates", "50%,often"])
    with pytest.raises(SystemExit):
        sb.parse_args(["--configs", "flashinfer,nope"])


def test_seeds_differ_per_run_and_agree_across_configs():
    seeds = {sw.run_seed(0, w, r) for w in sw.WORKLOADS for r in ("warmup", "burst", "50%")}
    assert len(seeds) == 3 * len(sw.WORKLOADS)
    assert _flag(_client("prefix_8k_x4", 4.0), "--seed") == _flag(_client("prefix_8k_x4", 4.0),
                                                                  "--seed")


# --- server-side measurements -----------------------------------------------------------------


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm_cascade_decode_steps_planned_total Pure-decode engine steps the cascade planner saw.
# TYPE vllm_cascade_decode_steps_planned_total counter
vllm_cascade_decode_steps_planned_total{tp_rank="0"} 200.0
vllm_cascade_decode_steps_planned_total{tp_rank="1"} 200.0
# HELP vllm_cascade_decode_steps_cascade_total Pure-decode engine steps that ran cascade.
# TYPE vllm_cascade_decode_steps_cascade_total counter
vllm_cascade_decode_steps_cascade_total{tp_rank="0"} 150.0
vllm_cascade_decode_steps_cascade_total{tp_rank="1"} 150.0
# HELP vllm_cascade_decode_steps_graphed_total Cascade decode steps that replayed a graph.
# TYPE vllm_cascade_decode_steps_graphed_total counter
vllm_cascade_decode_steps_graphed_total{tp_rank="0"} 120.0
# HELP vllm_cascade_graph_capture_failures_total Captures that failed.
# TYPE vllm_cascade_graph_capture_failures_total counter
vllm_cascade_graph_capture_failures_total{tp_rank="0"} 1.0
vllm_cascade_graph_capture_failures_total{tp_rank="1"} 2.0
# HELP vllm_cascade_graph_captures_total Graphs captured.
# TYPE vllm_cascade_graph_captures_total counter
vllm_cascade_graph_captures_total{tp_rank="0"} 12.0
vllm_cascade_graph_captures_total{tp_rank="1"} 12.0
# HELP vllm_cascade_graph_capture_seconds_total Seconds capturing.
# TYPE vllm_cascade_graph_capture_seconds_total counter
vllm_cascade_graph_capture_seconds_total{tp_rank="0"} 0.75
vllm_cascade_graph_capture_seconds_total{tp_rank="1"} 0.5
# HELP vllm_cascade_planning_seconds_total Seconds planning.
# TYPE vllm_cascade_planning_seconds_total counter
vllm_cascade_planning_seconds_total{tp_rank="0"} 2.5
# HELP vllm_cascade_planning_cpu_seconds_total Of that, on a CPU.
# TYPE vllm_cascade_planning_cpu_seconds_total counter
vllm_cascade_planning_cpu_seconds_total{tp_rank="0"} 1.0
# HELP vllm_cascade_graph_pool_bytes Pool bytes.
# TYPE vllm_cascade_graph_pool_bytes gauge
vllm_cascade_graph_pool_bytes{tp_rank="0"} 1000.0
vllm_cascade_graph_pool_bytes{tp_rank="1"} 900.0
# HELP vllm_cascade_fallbacks_total Fallbacks.
# TYPE vllm_cascade_fallbacks_total counter
vllm_cascade_fallbacks_total{reason="kernel error",tp_rank="0"} 50.0
# HELP vllm_cascade_steps_planned_total Steps planned.
# TYPE vllm_cascade_steps_planned_total counter
vllm_cascade_steps_planned_total{tp_rank="0"} 250.0
vllm_cascade_steps_planned_total{tp_rank="1"} 250.0
# HELP vllm_cascade_builder_seconds_total Builder seconds.
# TYPE vllm_cascade_builder_seconds_total counter
vllm_cascade_builder_seconds_total{tp_rank="0"} 0.25
# HELP vllm_cascade_builder_staging_seconds_total Of that, staging.
# TYPE vllm_cascade_builder_staging_seconds_total counter
vllm_cascade_builder_staging_seconds_total{tp_rank="0"} 0.1
# HELP vllm_cascade_builder_launch_seconds_total Of that, launches.
# TYPE vllm_cascade_builder_launch_seconds_total counter
vllm_cascade_builder_launch_seconds_total{tp_rank="0"} 0.04
# HELP vllm_cascade_builder_cpu_seconds_total Of that, on a CPU.
# TYPE vllm_cascade_builder_cpu_seconds_total counter
vllm_cascade_builder_cpu_seconds_total{tp_rank="0"} 0.2
# HELP vllm_cascade_decode_flat_steps_total Decode steps that ran flat, by reason.
# TYPE vllm_cascade_decode_flat_steps_total counter
vllm_cascade_decode_flat_steps_total{reason="cost model",tp_rank="0"} 40.0
vllm_cascade_decode_flat_steps_total{reason="no shared level",tp_rank="0"} 10.0
vllm_cascade_decode_flat_steps_total{reason="cost model",tp_rank="1"} 40.0
# HELP vllm_cascade_full_graph_captures_total Whole-step graphs captured, by cause.
# TYPE vllm_cascade_full_graph_captures_total counter
vllm_cascade_full_graph_captures_total{cause="padded size",tp_rank="0"} 6.0
vllm_cascade_full_graph_captures_total{cause="level layout",tp_rank="0"} 3.0
# HELP vllm_cascade_step_planning_seconds Per-step planning.
# TYPE vllm_cascade_step_planning_seconds histogram
vllm_cascade_step_planning_seconds_bucket{le="0.0001",tp_rank="0"} 100.0
vllm_cascade_step_planning_seconds_bucket{le="0.001",tp_rank="0"} 240.0
vllm_cascade_step_planning_seconds_bucket{le="+Inf",tp_rank="0"} 250.0
vllm_cascade_step_planning_seconds_bucket{le="0.0001",tp_rank="1"} 250.0
vllm_cascade_step_planning_seconds_bucket{le="0.001",tp_rank="1"} 250.0
vllm_cascade_step_planning_seconds_bucket{le="+Inf",tp_rank="1"} 250.0
vllm_cascade_step_planning_seconds_count{tp_rank="0"} 250.0
# HELP vllm_cascade_planning_path_steps_total Planned steps by how their planning went.
# TYPE vllm_cascade_planning_path_steps_total counter
vllm_cascade_planning_path_steps_total{path="continued",tp_rank="0"} 200.0
vllm_cascade_planning_path_steps_total{path="from scratch",tp_rank="0"} 50.0
vllm_cascade_planning_path_steps_total{path="continued",tp_rank="1"} 200.0
# HELP vllm_cascade_planning_path_seconds_total Planning seconds by path.
# TYPE vllm_cascade_planning_path_seconds_total counter
vllm_cascade_planning_path_seconds_total{path="continued",tp_rank="0"} 0.02
vllm_cascade_planning_path_seconds_total{path="from scratch",tp_rank="0"} 0.04
vllm_cascade_step_planning_seconds_sum{tp_rank="0"} 0.1
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 200.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 250.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 250.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 200.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 50.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 40.0
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 250.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 50.0
# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 250.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 25.0
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 90000.0
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 60000.0
# HELP vllm:prompt_tokens Number of prefill tokens processed.
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 95000.0
# HELP vllm:num_preemptions Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
"""
PARSED = {"steps_planned": 250.0, "decode_steps_planned": 200.0, "decode_steps_cascade": 150.0,
          "decode_steps_graphed": 120.0, "graph_capture_failures": 3.0, "graph_captures": 12.0,
          "graph_capture_s": 0.75, "planning_s": 2.5, "planning_cpu_s": 1.0, "builder_s": 0.25,
          "builder_staging_s": 0.1, "builder_launch_s": 0.04, "builder_cpu_s": 0.2,
          "graph_pool_bytes": 1900.0,
          # vLLM's histograms, summed over their label sets (engines)
          "vllm_ttft_s": 240.0, "vllm_ttft_n": 300.0, "vllm_queue_s": 50.0,
          "vllm_queue_n": 250.0, "vllm_prefill_s": 25.0, "vllm_prefill_n": 250.0,
          # vLLM's engine counters
          "vllm_prefix_cache_queries": 90000.0, "vllm_prefix_cache_hits": 60000.0,
          "vllm_prompt_tokens": 95000.0, "vllm_preemptions": 3.0,
          "decode_flat_steps": {"cost model": 40.0, "no shared level": 10.0},
          "full_graph_capture_causes": {"padded size": 6.0, "level layout": 3.0},
          "planning_buckets": {1e-4: 100.0, 1e-3: 240.0, float("inf"): 250.0},
          "planning_path_steps": {"continued": 200.0, "from scratch": 50.0},
          "planning_path_s": {"continued": 0.02, "from scratch": 0.04}}


def test_counters_parsed_from_metrics_text():
    counters = sm.parse_counters(METRICS)
    assert counters == PARSED
    assert sm.parse_counters(METRICS.split("# HELP vllm_cascade")[0]) == dict.fromkeys(counters)


def test_counters_as_prometheus_client_writes_them():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    planned = Counter("vllm_cascade_decode_steps_planned", "d", ["tp_rank"], registry=registry)
    planned.labels("0").inc(7)
    planned.labels("1").inc(7)
    counters = sm.parse_counters(generate_latest(registry).decode())  # with _created series
    assert counters["decode_steps_planned"] == 7.0 and counters["decode_steps_cascade"] is None


def test_fractions_from_counter_deltas():
    before = {"steps_planned": 100.0, "decode_steps_planned": 100.0,
              "decode_steps_cascade": 50.0, "decode_steps_graphed": 40.0,
              "graph_capture_failures": 0.0, "graph_captures": 2.0, "graph_capture_s": 0.25,
              "planning_s": 0.5, "planning_cpu_s": 0.2, "builder_s": 0.05,
              "builder_staging_s": 0.02, "builder_launch_s": 0.01, "builder_cpu_s": 0.05,
              "graph_pool_bytes": 400.0, "vllm_ttft_s": 40.0, "vllm_ttft_n": 100.0,
              "vllm_queue_s": 10.0, "vllm_queue_n": 100.0, "vllm_prefill_s": 5.0,
              "vllm_prefill_n": 100.0, "vllm_prefix_cache_queries": 30000.0,
              "vllm_prefix_cache_hits": 20000.0, "vllm_prompt_tokens": 35000.0,
              "vllm_preemptions": 1.0,
              "decode_flat_steps": {"cost model": 30.0},
              "full_graph_capture_causes": {"padded size": 4.0},
              "planning_buckets": {1e-4: 60.0, 1e-3: 90.0, float("inf"): 100.0},
              "planning_path_steps": {"continued": 100.0},
              "planning_path_s": {"continued": 0.01}}
    after = sm.parse_counters(METRICS)
    delta = sm.counter_deltas(before, after)
    assert delta == {"steps_planned": 150.0, "decode_steps_planned": 100.0,
                     "decode_steps_cascade": 100.0, "decode_steps_graphed": 80.0,
                     "graph_capture_failures": 3.0, "graph_captures": 10.0,
                     "graph_capture_s": 0.5, "planning_s": 2.0, "planning_cpu_s": 0.8,
                     "builder_s": 0.2, "builder_staging_s": pytest.approx(0.08),
                     "builder_launch_s": pytest.approx(0.03),
                     "builder_cpu_s": pytest.approx(0.15),
                     "graph_pool_bytes": 1900.0, "vllm_ttft_s": 200.0, "vllm_ttft_n": 200.0,
                     "vllm_queue_s": 40.0, "vllm_queue_n": 150.0, "vllm_prefill_s": 20.0,
                     "vllm_prefill_n": 150.0, "vllm_prefix_cache_queries": 60000.0,
                     "vllm_prefix_cache_hits": 40000.0, "vllm_prompt_tokens": 60000.0,
                     "vllm_preemptions": 2.0,
                     "decode_flat_steps": {"cost model": 10.0, "no shared level": 10.0},
                     "full_graph_capture_causes": {"padded size": 2.0, "level layout": 3.0},
                     "planning_buckets": {1e-4: 40.0, 1e-3: 150.0, float("inf"): 150.0},
                     "planning_path_steps": {"continued": 100.0, "from scratch": 50.0},
                     "planning_path_s": {"continued": 0.01, "from scratch": 0.04}}
    # 100 steps continued the last one in 10 ms, 50 were planned from scratch in 40 ms.
    paths = sm.derived(delta, True)["planning_paths"]
    assert paths == {"continued": [pytest.approx(100 / 150), pytest.approx(100.0)],
                     "from scratch": [pytest.approx(50 / 150), pytest.approx(800.0)]}
    assert sm.fractions(delta, True) == (1.0, 0.8)
    assert sm.fractions(delta, False) == (None, None)
    idle = sm.counter_deltas(after, after)
    assert sm.fractions(idle, True) == (None, None)  # no decode step at all
    missing = sm.counter_deltas(dict.fromkeys(before), {**after, "decode_steps_graphed": None})
    assert sm.fractions(missing, True) == (0.75, None)


def test_the_cascade_share_of_decode_steps_that_share_leaves_out_steps_with_nothing_shared():
    """Of 100 decode steps, 60 cascade, 10 flat for the cost model, 20 with no shared level and
    10 of a single request: 60 of the 70 steps whose rows share a page ran cascade."""
    row = {"cascade_step_fraction": 0.6,
           "flat_reasons": {"cost model": 0.1, "no shared level": 0.2, "single request": 0.1}}
    assert sm.shared_cascade_fraction(row) == pytest.approx(60 / 70)
    # A row without a "single request" count holds those steps in "no shared level".
    older = {"cascade_step_fraction": 0.6, "flat_reasons": {"cost model": 0.1,
                                                           "no shared level": 0.3}}
    assert sm.shared_cascade_fraction(older) == pytest.approx(60 / 70)
    assert sm.shared_cascade_fraction({"cascade_step_fraction": 0.0,
                                       "flat_reasons": {"no shared level": 1.0}}) is None
    assert sm.shared_cascade_fraction({"cascade_step_fraction": None,
                                       "flat_reasons": None}) is None  # a flat server's row
    row = sr.make_row(workload="prefix_8k_x4", config="cascade_flash_attn",
                      request_rate="burst", tensor_parallel_size=1, result=BURST_RESULT,
                      delta=sm.counter_deltas(dict.fromkeys(PARSED), PARSED), plugin_on=True,
                      capture_warnings=0, extra={})
    counted = PARSED["decode_flat_steps"]
    decode = PARSED["decode_steps_planned"]
    sharing = decode - counted.get("no shared level", 0) - counted.get("single request", 0)
    assert row["shared_cascade_fraction"] == pytest.approx(
        PARSED["decode_steps_cascade"] / sharing)


def test_request_times_are_vllms_own_means_over_the_run_with_or_without_the_plugin():
    """The server's part of a run's TTFT from vLLM's histograms: mean = Δsum / Δcount, in ms;
    None where a histogram is missing or counted no request. Rows of flat servers get them."""
    before = {**dict.fromkeys(PARSED), "vllm_ttft_s": 40.0, "vllm_ttft_n": 100.0,
              "vllm_queue_s": 10.0, "vllm_queue_n": 100.0}
    delta = sm.counter_deltas(before, {**PARSED, "vllm_prefill_s": None})
    assert sm.request_times(delta) == {"server_ttft_ms_mean": pytest.approx(1000.0),
                                       "queue_ms_mean": pytest.approx(40.0 / 150 * 1e3),
                                       "prefill_ms_mean": None}
    idle = sm.request_times(sm.counter_deltas(PARSED, PARSED))
    assert idle == dict.fromkeys(idle) and len(idle) == 3
    row = sr.make_row(workload="prefix_8k_x4", config="flash_attn", request_rate="burst",
                      tensor_parallel_size=1, result=BURST_RESULT, delta=delta,
                      plugin_on=False, capture_warnings=0, extra={})
    assert row["server_ttft_ms_mean"] == pytest.approx(1000.0)
    assert row["planning_us_p50"] is None  # the plugin's figures stay empty on a flat server


def test_planning_percentiles_host_time_and_flat_reasons_of_a_run():
    """What a row derives from the deltas: a percentile interpolated inside the bucket that
    holds it (40 steps up to 100 us, 110 more up to 1 ms: the median, the 75th of 150, is the
    35th of those 110 from 100 us), host time over planned steps, flat decode steps per decode
    step."""
    delta = sm.counter_deltas({**dict.fromkeys(PARSED), "steps_planned": 100.0,
                               "planning_s": 0.5, "planning_cpu_s": 0.5, "builder_s": 0.05,
                               "builder_staging_s": 0.05, "builder_launch_s": 0.02,
                               "builder_cpu_s": 0.1,
                               "graph_capture_s": 0.25,
                               "decode_steps_planned": 150.0,
                               "decode_flat_steps": {"cost model": 30.0},
                               "planning_buckets": {1e-4: 60.0, 1e-3: 90.0,
                                                    float("inf"): 100.0}},
                              sm.parse_counters(METRICS))
    got = sm.derived(delta, True)
    assert got["planning_us_p50"] == pytest.approx(100 + 900 * 35 / 110)
    assert got["planning_us_p99"] == pytest.approx(100 + 900 * (148.5 - 40) / 110)
    assert got["host_us_per_step"] == pytest.approx(1e6 * (2.0 + 0.2 + 0.5) / 150)
    assert got["planning_cpu_share"] == pytest.approx(0.5 / 2.0)  # waited for 3/4 of it
    assert got["builder_staging_share"] == pytest.approx(0.05 / 0.2)
    assert got["builder_launch_share"] == pytest.approx(0.02 / 0.2)
    assert got["builder_cpu_share"] == pytest.approx(0.1 / 0.2)
    assert got["flat_reasons"] == {"cost model": 0.2, "no shared level": 0.2}
    assert got["full_graph_capture_causes"] == {"level layout": 3, "padded size": 6}
    assert sm.derived(delta, False) == dict.fromkeys(got)
    idle = sm.derived(sm.counter_deltas(PARSED, PARSED), True)
    assert idle == {**dict.fromkeys(got), "host_us_per_step": None,
                    "planning_cpu_share": None, "builder_staging_share": None,
                    "builder_launch_share": None, "builder_cpu_share": None,
                    "full_graph_capture_causes": {}}


def test_derived_values_agree_with_the_plugins_own_metrics_and_counters():
    """End to end through the plugin's real exporter: steps counted by ``stats`` (known
    planning times and outcomes), written by prometheus_client, parsed and derived here; the
    percentiles against numpy's of the same times, to a bucket's width."""
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_cascade_plugin import stats
    from vllm_cascade_plugin.stats.histogram import BOUNDS_S
    from vllm_cascade_plugin.stats.prometheus import PrometheusCounters

    registry = CollectorRegistry()
    saved = stats._metrics
    stats.reset()
    stats._metrics = PrometheusCounters(registry, tp_rank="0")
    rng = np.random.default_rng(3)
    times = rng.lognormal(np.log(200e-6), 0.8, 400)
    try:
        before = sm.parse_counters(generate_latest(registry).decode())
        for i, t in enumerate(times):
            stats.record_planned(decode=i % 4 != 0)
            stats.record_planning(float(t))
            if i % 3 == 0:
                stats.record_cascade(10, 2, decode=i % 4 != 0)
            elif i % 3 == 1:
                stats.flat_decision("cost model", 1.2)
            else:
                stats.record_fallback("plan does not match the batch", level=10)
            stats.record_builder(1e-5, 4e-6, 8e-6, 1e-6)
            if i % 50 == 0:
                stats.record_capture_cause("padded size" if i < 200 else "level layout")
        stats.end_step()
        counters = stats.snapshot()
        after = sm.parse_counters(generate_latest(registry).decode())
    finally:
        stats._metrics = saved
        stats.reset()
    got = sm.derived(sm.counter_deltas(before, after), True)
    for q, key in ((50, "planning_us_p50"), (99, "planning_us_p99")):
        exact = float(np.percentile(times, q))
        at = int(np.searchsorted(BOUNDS_S, exact))
        lower = BOUNDS_S[at - 1] if at else 0.0
        assert lower * 1e6 <= got[key] <= BOUNDS_S[at] * 1e6, (q, exact)
    assert got["host_us_per_step"] == pytest.approx(1e6 * (times.sum() + 400 * 1e-5) / 400)
    assert got["builder_staging_share"] == pytest.approx(0.4)
    assert got["builder_launch_share"] == pytest.approx(0.1)
    assert got["builder_cpu_share"] == pytest.approx(0.8)
    decode = sum(i % 4 != 0 for i in range(400))
    want = {r: n / decode for r, n in counters.decode_flat_reasons.items()}
    assert got["flat_reasons"] == pytest.approx(want)
    assert set(want) == {"cost model", "plan does not match the batch"}
    cascade = counters.decode_steps_cascade / decode
    assert sum(got["flat_reasons"].values()) + cascade == pytest.approx(1.0)
    # i = 0, 50, 100, 150 and 200, 250, 300, 350
    assert got["full_graph_capture_causes"] == {"level layout": 4, "padded size": 4}
    assert dict(counters.full_graph_capture_causes) == got["full_graph_capture_causes"]


def test_capture_warnings_counted_in_log_text():
    log = "\n".join([
        "(EngineCore pid=1) WARNING [kernels.py:457] vllm-cascade-plugin: capturing a CUDA graph "
        "of a cascade decode step failed (RuntimeError: x); cascade decode steps launch eagerly",
        "(EngineCore pid=1) WARNING vllm-cascade-plugin: capturing a whole cascade decode step in a"
        " CUDA graph failed (AssertionError: y)",
        "(EngineCore pid=1) INFO vllm-cascade-plugin: capturing a CUDA graph of a decode step",
        "RuntimeError: t.is_cuda() INTERNAL ASSERT FAILED at /pytorch/c10/cuda/CUDAGraph.cpp:1",
        "(EngineCore pid=1) INFO 1 steps, 0.0% ran cascade; fallbacks: capture failed: 0",
    ])
    assert sm.count_capture_warnings(log) == 3
    assert sm.count_capture_warnings("") == 0


def test_row_schema_and_values():
    delta = {"decode_steps_planned": 10.0, "decode_steps_cascade": 5.0,
             "decode_steps_graphed": 5.0, "graph_capture_failures": 0.0}
    row = sr.make_row(workload="prefix_8k_x4", config="cascade", request_rate="burst",
                      tensor_parallel_size=1, result=BURST_RESULT, delta=delta, plugin_on=True,
                      capture_warnings=2, extra={"run_id": "r"})
    assert list(row)[:12] == ROW_KEYS == list(sr.ROW_KEYS)
    assert [row[k] for k in ROW_KEYS] == ["prefix_8k_x4", "cascade", "burst", 1, 2048.0, 850.0,
                                          4000.0, 29.0, 45.0, 0.5, 1.0, 2]
    assert row["completed"] == 256 and row["duration_s"] == 32.0 and row["run_id"] == "r"
    assert row["ttft_ms_mean"] == 900.0 and row["request_throughput"] == 8.0
    json.dumps(row)


def test_new_rows_join_the_earlier_runs_and_replace_only_their_own_run(tmp_path):
    def row(w, c, rate, run, tp=1):
        return {"workload": w, "config": c, "request_rate": rate, "tensor_parallel_size": tp,
                "run_id": run}

    old = [row("a", "flashinfer", "burst", "0"), row("a", "cascade", "burst", "0"),
           row("a", "cascade", 4.0, "0"), row("b", "cascade", "burst", "0"),
           row("a", "cascade", 3, "0", 2)]
    first = [row("a", "cascade", "burst", "1")]
    merged = sr.merge_rows(old, first)
    assert merged == [*old, first[0]]  # the same point again: a second run of it
    second = [*first, row("a", "cascade", 4.0, "1")]  # the invocation's rows so far
    assert sr.merge_rows(merged, second) == [*old, *second]
    out = tmp_path / "h200" / "serve.json"
    sr.write_results(out, merged, {"run_id": "1", "command": "first"})
    sr.write_results(out, merged, {"run_id": "2", "command": "second"})
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert meta["command"] == "second" and [r["run_id"] for r in meta["runs"]] == ["1", "2"]
    assert json.loads(out.read_text()) == merged
    assert sr.baseline_rates([{**old[0], "request_throughput": 8.0}], "flashinfer", 1) == {
        "a": 8.0}


def test_plot_reads_only_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{**dict.fromkeys(ROW_KEYS), "workload": w, "config": c, "request_rate": r,
             "tensor_parallel_size": 1, "tpot_ms_p50": 10.0 + i, "ttft_ms_p99": 100.0 * (i + 1),
             "request_throughput": 9.0}
            for w in ("a", "b") for c in ("flashinfer", "cascade")
            for i, r in enumerate(["burst", 4.0, 7.2])]
    out = tmp_path / "serve.json"
    out.write_text(json.dumps(rows))
    png = sr.plot(out, list(sc.CONFIGS))
    assert png == tmp_path / "serve.png" and png.read_bytes()[:4] == b"\x89PNG"


# --- processes and the whole loop, against a stand-in for vLLM --------------------------------


FAKE_VLLM = '''
import http.server, json, os, subprocess, sys, time, urllib.request
argv = sys.argv[1:]
flag = lambda name, default=None: argv[argv.index(name) + 1] if name in argv else default
if argv[0] == "serve":
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                      "fake-engine-core:" + os.path.abspath(__file__)])
    plugin = os.environ.get("CASCADE_ATTENTION") == "1"
    assert os.path.isdir(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    state = {"requests": 0}
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def reply(self, body, code=200):
            self.send_response(code); self.end_headers(); self.wfile.write(body.encode())
        def do_GET(self):
            if self.path == "/health":
                return self.reply("")
            n = state["requests"]
            text = ("" if not plugin else
                    f'vllm_cascade_decode_steps_planned_total{{tp_rank="0"}} {10 * n}\\n'
                    f'vllm_cascade_decode_steps_cascade_total{{tp_rank="0"}} {8 * n}\\n'
                    f'vllm_cascade_decode_steps_graphed_total{{tp_rank="0"}} {6 * n}\\n'
                    f'vllm_cascade_steps_planned_total{{tp_rank="0"}} {12 * n}\\n'
                    f'vllm_cascade_planning_seconds_total{{tp_rank="0"}} {0.012 * n}\\n'
                    f'vllm_cascade_builder_seconds_total{{tp_rank="0"}} {0.006 * n}\\n'
                    f'vllm_cascade_graph_capture_seconds_total{{tp_rank="0"}} {0.006 * n}\\n'
                    f'vllm_cascade_decode_flat_steps_total{{reason="cost model",tp_rank="0"}} '
                    f'{2 * n}\\n'
                    f'vllm_cascade_step_planning_seconds_bucket{{le="0.001",tp_rank="0"}} '
                    f'{12 * n}\\n'
                    f'vllm_cascade_step_planning_seconds_bucket{{le="+Inf",tp_rank="0"}} '
                    f'{12 * n}\\n')
            self.reply("vllm:num_requests_running 0.0\\n" + text)
        def do_POST(self):
            if self.path == "/reset_prefix_cache":
                dev = os.environ["VLLM_SERVER_DEV_MODE"] == "1"
                return self.reply(json.dumps({"success": dev}))
            state["requests"] += 1
            if plugin:
                print("WARNING vllm-cascade-plugin: capturing a CUDA graph failed", flush=True)
            self.reply("{}")
    time.sleep(1)
    http.server.ThreadingHTTPServer((flag("--host"), int(flag("--port"))), H).serve_forever()
else:  # bench serve
    n = int(flag("--num-prompts"))
    path = flag("--dataset-path")
    if path is not None:
        assert len(open(path).read().splitlines()) == n, "the tree file has --num-prompts lines"
    url = f"http://{flag('--host')}:{flag('--port')}/v1/completions"
    urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST")).read()
    print(" ".join(argv))
    if "--save-result" in argv:
        result = {"num_prompts": n, "completed": n, "duration": n / 8.0, "output_throughput": 100.0,
                  "p50_ttft_ms": 1.0, "p99_ttft_ms": 2.0, "p50_tpot_ms": 3.0, "p99_tpot_ms": 4.0}
        os.makedirs(flag("--result-dir"), exist_ok=True)  # as vLLM does
        with open(os.path.join(flag("--result-dir"), flag("--result-filename")), "w") as f:
            json.dump(result, f)
'''


def _fake_vllm(tmp_path, monkeypatch) -> None:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    monkeypatch.setattr(sw, "VLLM", [sys.executable, str(script)])


def _engine_core(tmp_path) -> str:
    """What this test's fake engine core has on its command line (tests running at the same
    time, as the test command's FlashInfer cells do, each have their own)."""
    return "fake-engine-core:" + str(tmp_path / "fake_vllm.py")


def _start_port() -> int:
    """A free port from the OS to start looking from: runs at the same time start apart."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(marker: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode()
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if marker in text and state != "Z":
            found.append(text)
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_server_stops_with_its_child_processes_and_reports_an_early_exit(tmp_path, monkeypatch):
    _fake_vllm(tmp_path, monkeypatch)
    port = sp.free_port(_start_port())
    cmd = sc.server_command(sc.CONFIGS["cascade"], tmp_path, port, 1024, _args())
    env = sc.server_env(sc.CONFIGS["cascade"], tmp_path)
    with sp.Server(cmd, env, tmp_path / "log" / "s.log", port) as server:
        server.wait_healthy(30)
        assert server.reset_prefix_cache()
        assert _alive(_engine_core(tmp_path))
    assert not _alive(_engine_core(tmp_path)) and not _alive(str(tmp_path / "fake_vllm.py"))
    crash = [sys.executable, "-c", "print('no GPU here'); raise SystemExit(3)"]
    with (pytest.raises(RuntimeError, match=r"exited \(3\)[\s\S]*no GPU here"),
          sp.Server(crash, dict(os.environ), tmp_path / "c.log", port) as server):
        server.wait_healthy(30)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
@pytest.mark.flashinfer
def test_whole_loop_writes_rows_after_each_run_and_merges(tmp_path, monkeypatch, capsys):
    pytest.importorskip("prometheus_client")
    _fake_vllm(tmp_path, monkeypatch)
    monkeypatch.setattr(sw, "missing_modules", lambda workloads: [])  # the fake reads no pandas
    out = tmp_path / "res" / "serve.json"
    common = ["--model", str(TINY), "--out", str(out), "--work-dir", str(tmp_path / "work"),
              "--workloads", "prefix_2k_x4,tree_2k_4x8k", "--duration", "10",
              "--port", str(sp.free_port(_start_port())), "--server-timeout", "60",
              "--run-timeout", "60"]
    assert sb.main([*common, "--configs", "cascade,flashinfer", "--plot"]) == 0
    rows = json.loads(out.read_text())
    assert [(r["config"], r["workload"], r["request_rate"]) for r in rows] == [
        (c, w, r) for c in ("flashinfer", "cascade") for w in ("prefix_2k_x4", "tree_2k_4x8k")
        for r in ("burst", 4.0, 7.2)]  # flashinfer first: 8 req/s -> 50% and 90%
    assert [r["num_prompts"] for r in rows[:3]] == [256, 40, 72]
    for r in rows:
        assert list(r)[:12] == ROW_KEYS
        plugin = r["config"] == "cascade"
        assert r["cascade_step_fraction"] == (0.8 if plugin else None)
        assert r["graph_replay_fraction"] == (0.75 if plugin else None)
        assert r["capture_warnings"] == (1 if plugin else 0)  # the warm-up's are not counted
        # Per run: 12 steps planned, 10 of them decode steps, 8 cascade, 2 flat (cost model);
        # 24 ms of host time; every step's planning up to 1 ms.
        assert r["flat_reasons"] == ({"cost model": 0.2} if plugin else None)
        assert r["host_us_per_step"] == (pytest.approx(2000) if plugin else None)
        assert r["planning_us_p50"] == (pytest.approx(500) if plugin else None)
        assert r["planning_us_p99"] == (pytest.approx(990) if plugin else None)
        # the fake client ends before the first mid-run read: the keys, without a window
        assert r["mid_run_window_s"] is None and r["mid_run_shared_cascade_fraction"] is None
    assert len({r["seed"] for r in rows}) == 6  # same prompts in both configs
    [run] = {r["run"] for r in rows}  # one per invocation: when, and which commit
    assert {r["model"] for r in rows} == {"llama-tiny"}  # the --model folder's name
    assert run.startswith(rows[0]["run_id"] + "-") and run == meta_run(out)
    assert (out.parent / "serve.png").is_file() and (out.parent / "logs").is_dir()
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    # tree_2k_4x8k: 10,304 prompt tokens of words up to 6 characters (7 with a space)
    assert meta["max_model_len"] == 12288 and meta["vllm"] and meta["gpu"]
    assert meta["command"].endswith("--configs cascade,flashinfer --plot")
    assert meta["command"].split()[1:3] == ["-m", "benchmarks.serve.bench"]
    assert not _alive(str(tmp_path / "fake_vllm.py")) and not _alive(_engine_core(tmp_path))
    # Later: cascade alone, its rates from the file's flashinfer bursts; every earlier row
    # kept, the cascade points measured again become their second runs.
    assert sb.main([*common, "--configs", "cascade", "--rates", "burst,50%"]) == 0
    again = json.loads(out.read_text())
    assert again[:len(rows)] == rows
    key = [(r["config"], r["workload"], r["request_rate"]) for r in again[len(rows):]]
    assert key == [("cascade", w, r) for w in ("prefix_2k_x4", "tree_2k_4x8k")
                   for r in ("burst", 4.0)]
    assert len(json.loads(out.with_suffix(".meta.json").read_text())["runs"]) == 2
    later = {r["run"] for r in again[len(rows):]}
    assert len(later) == 1 and later != {run} and later == {meta_run(out)}
    assert {r["run"] for r in again if r["config"] == "flashinfer"} == {run}
    capsys.readouterr()


def meta_run(out: Path) -> str:
    return json.loads(out.with_suffix(".meta.json").read_text())["run"]


def test_a_run_names_the_commit_it_ran(monkeypatch):
    from benchmarks import common as bench_common
    monkeypatch.delenv("CASCADE_COMMIT", raising=False)
    commit = bench_common.commit()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    if head.returncode != 0:
        assert commit == "unknown"
        return
    assert head.stdout.startswith(commit.removesuffix("+dirty")) and len(commit) >= 12


def test_a_copy_of_the_checkout_names_the_commit_it_was_told(monkeypatch):
    """The GPU machine's copy has files newer than its git metadata: CASCADE_COMMIT wins."""
    from benchmarks import common as bench_common
    monkeypatch.setenv("CASCADE_COMMIT", "2a23dfd")
    assert bench_common.commit() == "2a23dfd"


def test_dry_run_prints_the_commands_and_writes_nothing(tmp_path, capsys):
    out, work = tmp_path / "serve.json", tmp_path / "work"
    assert sb.main(["--dry-run", "--model", str(TINY), "--out", str(out), "--work-dir", str(work),
                    "--configs", "cascade,flashinfer", "--workloads", "prefix_8k_x4,tree_2k_4x8k",
                    "--duration", "30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    servers = [x for x in lines if x.startswith("# server")]
    assert [x.split()[2] for x in servers] == ["flashinfer:", "cascade:"]
    assert "CASCADE_ATTENTION=1" in servers[1] and "--port 8101" in servers[1]
    assert sum(" bench serve " in x for x in lines) == 2 * 2 * 4  # warm-up, burst, two rates
    assert any("'<50% of flashinfer burst req/s on prefix_8k_x4>'" in x for x in lines)
    assert not out.exists() and not work.exists()


def test_dry_run_of_the_plugin_in_vllms_default_backend_beside_plain_flash_attn(tmp_path, capsys):
    out, work = tmp_path / "serve.json", tmp_path / "work"
    assert sb.main(["--dry-run", "--model", str(TINY), "--out", str(out), "--work-dir", str(work),
                    "--configs", "flash_attn,cascade_flash_attn", "--workloads",
                    "prefix_8k_x4", "--rates", "burst"]) == 0
    servers = [x for x in capsys.readouterr().out.splitlines() if x.startswith("# server")]
    assert [x.split()[2] for x in servers] == ["flash_attn:", "cascade_flash_attn:"]
    assert all("--attention-backend FLASH_ATTN" in x for x in servers)
    assert "CASCADE_ATTENTION=0" in servers[0] and "CASCADE_ATTENTION=1" in servers[1]
    assert not out.exists() and not work.exists()


def test_rates_per_workload_and_repeated_rates():
    assert sw.parse_rates("burst,90%*2,50%") == ["burst", "90%", "90%#2", "50%"]
    assert sw.parse_rate_plan("burst,90%") == {"*": ["burst", "90%"]}
    assert sw.parse_rate_plan("prefix_8k_x4=burst,50%,90%*2; *=90%,burst") == {
        "prefix_8k_x4": ["burst", "50%", "90%", "90%#2"], "*": ["burst", "90%"]}
    assert sw.resolve_rate("90%#2", 10.0) == 9.0 and sw.base_rate("90%#2") == "90%"
    # A repeat draws the same prompts as the rate it repeats; another rate does not.
    assert sw.run_seed(0, "prefix_8k_x4", "90%#2") == sw.run_seed(0, "prefix_8k_x4", "90%")
    assert sw.run_seed(0, "prefix_8k_x4", "90%") != sw.run_seed(0, "prefix_8k_x4", "50%")
    for bad in ("90%*0", "90%*x", "=burst", "prefix_8k_x4=burst;nonsense", "x=often"):
        with pytest.raises(ValueError):
            sw.parse_rate_plan(bad)


def test_the_chat_workload_shares_a_system_prompt_and_draws_each_users_length():
    chat = sw.WORKLOADS["chat_1k5_system"]
    args = sw.dataset_args(chat, None)
    assert args[args.index("--dataset-name") + 1] == "random"
    assert args[args.index("--random-prefix-len") + 1] == "1536"
    assert json.loads(args[args.index("--random-range-ratio") + 1]) == {"input": 0.6,
                                                                        "output": 0.0}
    assert chat.input_len == 1536 + 1024  # the longest prompt sizes --max-model-len


def test_a_second_flat_server_runs_after_the_plugins_so_the_two_flat_ones_bracket_them(
        tmp_path, capsys):
    out, work = tmp_path / "serve.json", tmp_path / "work"
    assert sb.main(["--dry-run", "--model", str(TINY), "--out", str(out), "--work-dir", str(work),
                    "--configs", "flash_attn_again,cascade_flash_attn,flash_attn",
                    "--workloads", "chat_1k5_system", "--rates", "burst,50%"]) == 0
    lines = capsys.readouterr().out.splitlines()
    servers = [x.split()[2] for x in lines if x.startswith("# server")]
    assert servers == ["flash_attn:", "cascade_flash_attn:", "flash_attn_again:"]


def test_servers_as_listed_run_the_plugins_first_at_an_earlier_runs_rates(tmp_path, capsys):
    """--servers-as-listed keeps --configs' order (the plugin's server before flat's, to tell
    the plugin from its place in the run); every server's 50% then comes from the same flat
    burst on record, and a flat burst in the run, which would give the servers after it
    another rate, stops the bench."""
    out, work = tmp_path / "serve.json", tmp_path / "work"
    out.write_text(json.dumps([{"workload": "chat_1k5_system", "config": "flashinfer",
                                "request_rate": "burst", "tensor_parallel_size": 1,
                                "request_throughput": 40.0, "model": "llama-tiny"}]))
    args = ["--dry-run", "--model", str(TINY), "--out", str(out), "--work-dir", str(work),
            "--configs", "cascade,flashinfer,flashinfer_again", "--workloads", "chat_1k5_system",
            "--servers-as-listed"]
    assert sb.main([*args, "--rates", "50%"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x.split()[2] for x in lines if x.startswith("# server")] == [
        "cascade:", "flashinfer:", "flashinfer_again:"]
    runs = [x for x in lines if " bench serve " in x and "warm-up" not in x]
    assert len(runs) == 3 and all("--request-rate 20.0 " in x for x in runs)
    with pytest.raises(SystemExit, match="flat burst"):
        sb.main([*args, "--rates", "burst,50%"])


def test_dry_run_of_both_backends_derives_each_configs_rates_from_its_own_flat_burst(
        tmp_path, capsys):
    out, work = tmp_path / "serve.json", tmp_path / "work"
    assert sb.main(["--dry-run", "--model", str(TINY), "--out", str(out), "--work-dir", str(work),
                    "--configs", "cascade_flash_attn,cascade,flash_attn,flashinfer",
                    "--workloads", "prefix_8k_x4,chat_1k5_system",
                    "--rates", "prefix_8k_x4=burst,90%*2;*=burst,90%"]) == 0
    lines = capsys.readouterr().out.splitlines()
    servers = [x.split()[2] for x in lines if x.startswith("# server")]
    assert servers[:2] == ["flash_attn:", "flashinfer:"]  # the flat ones first
    runs = [x for x in lines if " bench serve " in x and "warm-up" not in x]
    assert sum("prefix_8k_x4 90%#2:" in x for x in runs) == 4  # every config repeats it
    assert sum("chat_1k5_system 90%#2:" in x for x in runs) == 0
    # Ports in server order: flash_attn 8100, flashinfer 8101, cascade_flash_attn 8102, cascade.
    fa = [x for x in runs if "--port 8100 " in x or "--port 8102 " in x]
    assert fa and all("of flashinfer" not in x for x in fa)
    assert any("<90% of flash_attn burst req/s on prefix_8k_x4>" in x for x in fa)
    assert any("<90% of flashinfer burst req/s on chat_1k5_system>" in x for x in runs)
    assert not out.exists() and not work.exists()


def test_rates_for_a_workload_not_run_stop_the_bench(tmp_path):
    with pytest.raises(SystemExit, match="prefix_32k_x1"):
        sb.main(["--dry-run", "--model", str(TINY), "--out", str(tmp_path / "s.json"),
                 "--workloads", "prefix_8k_x4", "--rates", "prefix_32k_x1=burst"])


def test_the_serving_grid_of_gpu_validate_is_a_valid_bench(tmp_path, capsys):
    """``scripts/gpu_validate.sh serve_grid``'s slices (``scripts/serve_grid.sh``), as dry runs:
    known configs, workloads and rates, each plugin config beside the same backend flat, every
    slice nameable."""
    import re
    import shlex

    script = (ROOT / "scripts/serve_grid.sh").read_text()
    assert "source scripts/serve_grid.sh" in (ROOT / "scripts/gpu_validate.sh").read_text()
    body = script[script.index("part_serve_grid() {"):]
    body = body[:body.index("\n}\n")].replace("\\\n", " ")
    slices = re.findall(r'^ +(\w+)\) serve_slice (\w+) \d+ (.*) ;;$', body, re.M)
    assert {name for name, _, _ in slices} == {"flash_attn_shared", "flash_attn_long",
                                               "flashinfer", "flashinfer_burst",
                                               "host_delay", "flash_attn_policy",
                                               "flash_attn_moderate", "api_servers", "split",
                                               "split_gated", "pow2_graphs",
                                               "host_delay_2k", "burst_pair",
                                               "mixed_bursts", "chat_burst",
                                               "capture_bursts", "chat", "policy_moderate",
                                               "flashinfer_chat", "chat_capacity",
                                               "never_slower", "never_slower_chat",
                                               "never_slower_paired", "hybrid_gemma3",
                                               "hybrid_bamba", "hybrid_bamba_paired",
                                               "hybrid_bamba_graphs", "fp8_kv",
                                               "shared_docs_pair", "hybrid_gemma3_policy",
                                               "never_slower_flashinfer_paired",
                                               "never_slower_flashinfer_half_paired",
                                               "never_slower_flashinfer_plugin_first",
                                               "hybrid_gpt_oss_plugin_first",
                                               "flashinfer_flat_burst", "no_sharing_pair",
                                               "hybrid_gpt_oss_flat_burst",
                                               "docs_and_no_sharing_paired", "hybrid_gpt_oss",
                                               "hybrid_gpt_oss_paired"}
    assert all(name == log for name, log, _ in slices)
    models = {}
    for name, _, args in slices:
        argv = shlex.split(args)
        keep = []
        for flag in ("--configs", "--workloads", "--rates"):
            keep += [flag, argv[argv.index(flag) + 1]]
        configs = keep[1].split(",")
        # A slice of another model serves its own folder (the grid's Llama otherwise: TINY).
        model = argv[argv.index("--model") + 1] if "--model" in argv else str(TINY)
        models[name] = Path(model).name
        assert len({sc.CONFIGS[c].backend for c in configs}) == 1
        # A pair at least, or a flat burst alone (a machine's capacity for the slices after it).
        assert len(configs) >= 2 or keep[5] == "burst"
        flat = [c for c in configs if sc.baseline(c) == c]
        assert len(flat) == 1  # its backend flat, the one every other config is compared with
        assert all(sc.baseline(c) == flat[0] for c in configs)
        assert sb.main(["--dry-run", "--model", str(ROOT / model), "--out",
                        str(tmp_path / "s.json"), "--work-dir", str(tmp_path / "w"), *keep]) == 0
    assert models["hybrid_gemma3"] == models["hybrid_gemma3_policy"] == "gemma3-12b"
    assert models["hybrid_bamba"] == "bamba-9b"
    assert models["hybrid_gpt_oss"] == models["hybrid_gpt_oss_paired"] == "gpt-oss-20b-dense"
    assert models["hybrid_bamba_paired"] == models["hybrid_bamba_graphs"] == "bamba-9b"
    printed = capsys.readouterr().out
    assert "# model gemma3-12b: " in printed and "# model bamba-9b: " in printed
    assert re.search(r"prefix_8k_x4 90%#2: ", printed) and "chat_1k5_system 90%: " in printed
    assert "random_2k 90%: " in printed and "prefix_32k_x1 burst: " in printed


@pytest.mark.parametrize(("plugin", "flat", "arg"), [
    ("cascade_flash_attn_api_servers_4", "flash_attn_api_servers_4", "--api-server-count 4"),
    ("cascade_flash_attn_pow2_graphs", "flash_attn_pow2_graphs",
     "--cudagraph-capture-sizes 1 2 4 8 16 32 64 128 256 512 "),
])
def test_configs_with_their_own_server_args_pair_with_each_other_and_take_their_own_flat_rates(
        tmp_path, capsys, plugin, flat, arg):
    """A plugin config with server arguments of its own (4 API servers; capture sizes in powers
    of two) is compared with the flat config of the same arguments: its Poisson rates come from
    that config's burst, never from the plain flat config's, and both servers get them."""
    assert sc.baseline(plugin) == flat and sc.baseline(flat) == flat
    assert sc.baseline("cascade_flash_attn") == "flash_attn"
    out = tmp_path / "s.json"
    # Only a one-API-server flat burst on record: no rate for the 4-API-server configs.
    out.write_text(json.dumps([{"workload": "prefix_8k_x4", "config": "flash_attn",
                                "request_rate": "burst", "tensor_parallel_size": 1,
                                "request_throughput": 13.0, "model": "llama-tiny"}]))
    assert sb.main(["--dry-run", "--model", str(TINY), "--out", str(out),
                    "--work-dir", str(tmp_path / "w"), "--configs", plugin,
                    "--workloads", "prefix_8k_x4", "--rates", "90%"]) == 0
    printed = capsys.readouterr().out
    server = next(line for line in printed.splitlines() if line.startswith("# server"))
    assert arg in server + " "
    flat_server = sc.server_command(sc.CONFIGS[flat], Path("/m"), 8000, 4096,
                                    sb.parse_args(["--model", "/m"]))
    assert arg in " ".join(flat_server) + " "
    assert f"<90% of {flat} burst req/s on prefix_8k_x4>" in printed
    out.write_text(json.dumps([{"workload": "prefix_8k_x4", "config": flat,
                                "request_rate": "burst", "tensor_parallel_size": 1,
                                "request_throughput": 20.0, "model": "llama-tiny"}]))
    assert sb.main(["--dry-run", "--model", str(TINY), "--out", str(out),
                    "--work-dir", str(tmp_path / "w"), "--configs", plugin,
                    "--workloads", "prefix_8k_x4", "--rates", "90%"]) == 0
    assert "--request-rate 18" in capsys.readouterr().out
