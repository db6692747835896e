"""The end-to-end benchmark's workloads are the ones the performance targets name (no GPU)."""

from __future__ import annotations

import pytest

from benchmarks.e2e import bench as e2e_bench


def _workloads() -> dict:
    return e2e_bench.workloads()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_b128_16k_prefix_64_own_tokens_256_generated():
    prompts, params = _workloads()["b128_16k_prefix_64_own"]
    assert len(prompts) == 128 and {len(p) for p in prompts} == {16384 + 64}
    assert {tuple(p[:16384]) for p in prompts} == {tuple(prompts[0][:16384])}
    assert _common_prefix(prompts[0], prompts[1]) == 16384  # random own tokens differ at once
    assert params["max_tokens"] == 256 and params["ignore_eos"]


def test_eight_8k_prefixes_times_16_interleaved():
    prompts, _ = _workloads()["8_prefixes_8k_x16_interleaved"]
    assert len(prompts) == 128
    groups = [tuple(p[:8192]) for p in prompts]
    assert len(set(groups)) == 8
    assert all(groups[i] == groups[i % 8] for i in range(128))  # interleaved in request order
    assert all(_common_prefix(prompts[i], prompts[i + 1]) == 0 for i in range(7))


def test_n16_sampling_on_32_prompts_of_4k():
    prompts, params = _workloads()["n16_sampling_32_prompts_4k"]
    assert len(prompts) == 32 and {len(p) for p in prompts} == {4096}
    assert params["n"] == 16 and params["temperature"] > 0
    assert max(_common_prefix(a, b) for a in prompts for b in prompts if a is not b) < 16


def test_no_sharing_256_random_2k_prompts():
    prompts, _ = _workloads()["no_sharing_256_random_2k"]
    assert len(prompts) == 256 and {len(p) for p in prompts} == {2048}
    # Not even one KV page (16 tokens) in common: the plugin can only cost time here.
    assert len({tuple(p[:16]) for p in prompts}) == 256


def test_serving_sized_batches_share_the_serving_benchmarks_prefixes_interleaved():
    """The batches behind the per-step cost calibration: 2K x 16, 8K x 4 and a chat prompt,
    each request one of the shared prefixes (in turn) and its own tokens, which share nothing."""
    module = e2e_bench
    w = module.workloads()
    for name, count, length, own in module.SERVING_SHAPES:
        for rows in module.SERVING_BATCHES[name]:
            prompts, params = w[f"{name}_b{rows}"]
            assert len(prompts) == rows and {len(p) for p in prompts} == {length + own}
            prefixes = [tuple(p[:length]) for p in prompts]
            assert len(set(prefixes)) == count
            assert all(prefixes[i] == prefixes[i % count] for i in range(rows))
            assert len({tuple(p[length:length + 16]) for p in prompts}) == rows
            assert params["max_tokens"] == 256 and params["ignore_eos"]


def test_every_workload_fits_the_engines_max_model_len():
    module = e2e_bench
    for prompts, params in module.workloads().values():
        assert max(map(len, prompts)) + params["max_tokens"] <= module.MAX_MODEL_LEN


def test_counters_come_from_the_worker_and_an_rpc_failure_keeps_the_timings():
    """``_plugin_counters`` asks the (one) worker through ``LLM.collective_rpc``; when that fails
    the row records the error instead of the run failing."""
    module = e2e_bench

    class Llm:
        def __init__(self, reply):
            self.reply, self.sent = reply, []

        def collective_rpc(self, method):
            self.sent.append(method)
            if isinstance(self.reply, Exception):
                raise self.reply
            return [self.reply]

    ok = Llm({"steps_planned": 3, "steps_cascade": 2, "fallbacks": {}, "executors": ["fa3"]})
    assert module._plugin_counters(ok)["steps_cascade"] == 2
    assert ok.sent == [module._worker_counters]  # the function runs in the worker's process
    failed = module._plugin_counters(Llm(TimeoutError("engine busy")))
    assert failed == {"error": "TimeoutError: engine busy"}


def test_worker_counters_report_this_process_plugin_state():
    from vllm_cascade_plugin import stats

    counters = e2e_bench._worker_counters(object())
    snapshot = stats.snapshot()
    assert counters["steps_planned"] == snapshot.steps_planned
    assert counters["steps_cascade"] == snapshot.steps_cascade
    assert counters["fallbacks"] == dict(snapshot.fallbacks)
    assert isinstance(counters["executors"], list)


@pytest.mark.flashinfer
def test_worker_counters_sum_the_graph_counts_of_every_executor(monkeypatch):
    import torch

    from vllm_cascade_plugin.execution import kernels, vllm_kernels

    monkeypatch.setattr(vllm_kernels, "fa3_kernels", lambda: (None, None))
    before = e2e_bench._worker_counters(object())
    graphed = [kernels.FlashAttnCascadeExecutor(cuda_graphs=True) for _ in range(2)]
    eager = kernels.FlashAttnCascadeExecutor(cuda_graphs=False)
    for n, executor in enumerate(graphed, start=1):
        executor.graphs.captures, executor.graphs.replays = n, 10 * n
    held = kernels.graph_stats()["graphs_held"]
    graphed[0].graphs._graphs[("key",)] = lambda: torch.zeros(1)
    assert kernels.graph_stats()["graphs_held"] == held + 1
    counters = e2e_bench._worker_counters(object())
    assert counters["graph_captures"] - before["graph_captures"] == 3
    assert counters["graph_replays"] - before["graph_replays"] == 30
    assert "fa3" in counters["executors"] and eager.graphs is None


def test_the_plugin_in_vllms_default_backend_is_compared_with_plain_flash_attn():
    module = e2e_bench
    assert module.CONFIGS["cascade_flash_attn"] == ("FLASH_ATTN", {"CASCADE_ATTENTION": "1"})
    assert module.CONFIGS["flash_attn"] == ("FLASH_ATTN", {})
    assert {"flash_attn", "cascade_flash_attn"} <= set(module.DEFAULT_CONFIGS.split(","))


def test_dry_run_prints_each_engines_command_and_runs_nothing(tmp_path, capsys, monkeypatch):
    module = e2e_bench
    monkeypatch.setenv("CASCADE_POLICY", "always")  # a caller's plugin settings never leak in
    out = tmp_path / "out"
    assert module.main(["--dry-run", "--out", str(out), "--workloads", "one_8k_prefix_x64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    configs = module.DEFAULT_CONFIGS.split(",")
    assert [x.split()[1] for x in lines] == [f"{c}:" for c in configs]
    by_config = dict(zip(configs, lines, strict=True))
    assert by_config["flash_attn"].split()[2:4] == ["FLASH_ATTN", module.sys.executable]
    assert "FLASH_ATTN CASCADE_ATTENTION=1 " in by_config["cascade_flash_attn"]
    assert "--child cascade_flash_attn" in by_config["cascade_flash_attn"]
    assert all("CASCADE_POLICY=always" not in x for x in lines[:3])
    assert "CASCADE_POLICY=always" in by_config["cascade_always"] and not out.exists()


def test_unknown_configs_and_workloads_are_refused(capsys):
    import pytest

    for argv in (["--dry-run", "--configs", "nope"], ["--dry-run", "--workloads", "nope"]):
        with pytest.raises(SystemExit):
            e2e_bench.main(argv)
    assert "unknown nope" in capsys.readouterr().err
