"""The README's first screen (scripts/readme_glance.py): the gains by kind of traffic, the costs,
the exactness figures and the short serving summary, each checked against a small synthetic
result file whose expected figures are worked out here by hand."""

from __future__ import annotations

import json
import sys

import pytest

from test_readme import tables  # loads scripts/readme_tables.py and its parts

glance = sys.modules["readme_glance"]
common = sys.modules["readme_common"]
X, DASH = "\u00d7", "\u2013"


def row(config: str, workload: str, spec: str, run: str, tpot: float, out: float,
        gpu: str = "NVIDIA H200", **extra) -> dict:
    rate = "burst" if spec == "burst" else 10.0
    return {"workload": workload, "config": config, "request_rate": rate, "rate_spec": spec,
            "tensor_parallel_size": 1, "tpot_ms_p50": tpot, "output_tok_per_s": out,
            "ttft_ms_p99": 100.0, "run_id": run, "completed": 10, "gpu": gpu, **extra}


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(glance, "GPU", tmp_path)
    monkeypatch.setattr(common, "ROOT", tmp_path.parent)  # sources named relative to it

    def write(name: str, content) -> None:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(content))
    return write


@pytest.mark.parametrize("values, shown", [
    ([1.654, 2.52], f"1.6{DASH}2.6{X}"),  # one decimal from 2 on, rounded outwards
    ([0.953, 1.074], f"0.95{DASH}1.08{X}"),  # two below 2: 0.95 and 1.05 differ
    ([0.9954], f"1.00{X}"),  # one value: rounded half up
    ([2.24, 2.36], f"2.2{DASH}2.4{X}"),  # outwards, so the range holds both
    ([2.26, 2.31], f"2.3{X}"),  # both ends round alike: one figure
    ([], "not measured"),
])
def test_a_range_is_rounded_outwards(values, shown):
    assert glance.rounded_range(values) == shown


def test_the_glance_table_gives_each_kind_of_traffic_its_range_over_every_run(results):
    results("serve.json", [
        # long prefixes at 90%: run a 20/10 = 2.0x lower, run b 36/12 = 3.0x lower
        row("flash_attn", "prefix_8k_x4", "90%", "a", 20.0, 1000),
        row("cascade_flash_attn", "prefix_8k_x4", "90%", "a", 10.0, 1000),
        row("flash_attn", "prefix_32k_x1", "90%", "b", 36.0, 500),
        row("cascade_flash_attn", "prefix_32k_x1", "90%", "b", 12.0, 500),
        # a burst: 1,000 -> 2,500 tokens/s, 2.5x flat's
        row("flash_attn", "prefix_8k_x4", "burst", "a", 50.0, 1000),
        row("cascade_flash_attn", "prefix_8k_x4", "burst", "a", 20.0, 2500),
        # another backend's pair is not vLLM's default backend's: left out
        row("flashinfer", "prefix_8k_x4", "90%", "c", 90.0, 100),
        row("cascade", "prefix_8k_x4", "90%", "c", 1.0, 100),
        # chat on an H100: 11/10 = 1.1x lower
        row("flash_attn", "chat_1k5_system", "90%", "d", 11.0, 900, gpu="NVIDIA H100 80GB HBM3"),
        row("cascade_flash_attn", "chat_1k5_system", "90%", "d", 10.0, 900,
            gpu="NVIDIA H100 80GB HBM3"),
        # a run whose every request failed measured nothing
        row("flash_attn", "chat_1k5_system", "90%", "e", 10.0, 0, completed=0),
        row("cascade_flash_attn", "chat_1k5_system", "90%", "e", 99.0, 0, completed=0),
    ])
    lines = glance.block_glance()
    long_, mid, chat, none = (line for line in lines if line.startswith("| ")
                              and not line.startswith(("| your", "|---")))
    assert f"| 2.0{DASH}3.0{X} | not measured | 2.5{X} | H200, 3 runs |" in long_
    assert "| not measured | not measured | not measured |" in mid
    assert f"| 1.10{X} | not measured | not measured | H100, 1 run |" in chat
    assert none.startswith("| no sharing") and "| not measured |" in none


def test_the_costs_line_reads_graph_memory_host_time_and_the_added_host_time(results):
    gib = 2 ** 30
    results("serve.json", [
        row("cascade_flash_attn", "prefix_8k_x4", "90%", "a", 10.0, 1000,
            graph_pool_bytes=gib / 2, host_us_per_step=500.0),
        row("cascade", "chat_1k5_system", "burst", "b", 10.0, 1000, graph_pool_bytes=gib,
            host_us_per_step=9000.0),  # a burst's host time: not the 90% figure
        row("cascade_flash_attn", "prefix_2k_x16", "90%", "a", 10.0, 1000,
            graph_pool_bytes=0.0, host_us_per_step=1500.0),  # nothing shared: no graphs
        # an experimental config is not the plugin as shipped
        row("cascade_flash_attn_split_free", "prefix_2k_x16", "90%", "a", 10.0, 1000,
            graph_pool_bytes=4 * gib, host_us_per_step=7000.0),
        # 1 ms of host time added: TPOT p50 10.0 -> 10.3 ms in the same run
        row("cascade_flash_attn_host_delay_1ms", "prefix_8k_x4", "90%", "a", 10.3, 1000),
    ])
    [line] = glance.block_costs()
    assert f"held 0.50{DASH}1.00 GiB" in line
    assert f"Host time: 0.5{DASH}1.5 ms per step at 90% load" in line
    assert "moved TPOT p50 by +0.3 to +0.3 ms" in line


def test_the_exactness_line_sets_the_plugin_beside_two_correct_kernels(results, monkeypatch):
    engine = [{"workload": "a_x", "max_abs_dlogprob": 0.05, "mean_abs_dlogprob": 0.010,
               "reference_max_abs_dlogprob": 0.06, "reference_mean_abs_dlogprob": 0.012,
               "compared_fraction": 0.7, "reference_compared_fraction": 0.8,
               "cascade_step_fraction": 1.0},
              {"workload": "a_x (mixed steps whole)", "max_abs_dlogprob": 0.09,
               "mean_abs_dlogprob": 0.014, "reference_max_abs_dlogprob": 0.08,
               "reference_mean_abs_dlogprob": 0.013, "compared_fraction": 0.5,
               "reference_compared_fraction": 0.6, "cascade_step_fraction": 0.5},
              # a corrupted plan, and a workload without cascade: not the plugin's deviation
              {"workload": "a_x (corrupted)", "max_abs_dlogprob": 0.4, "mean_abs_dlogprob": 0.1,
               "reference_max_abs_dlogprob": 0.06, "reference_mean_abs_dlogprob": 0.012,
               "compared_fraction": 0.1, "reference_compared_fraction": 0.8,
               "cascade_step_fraction": 1.0},
              {"workload": "x_no_sharing", "max_abs_dlogprob": 0.0, "mean_abs_dlogprob": 0.0,
               "reference_max_abs_dlogprob": 0.07, "reference_mean_abs_dlogprob": 0.015,
               "compared_fraction": 0.9, "reference_compared_fraction": 0.7,
               "cascade_step_fraction": 0.0}]
    results("gpu_validate/engine_flash_attn/rows.json", engine)
    results("gpu_validate.json", [{"part": "engine_flash_attn", "gpu": "NVIDIA H100 80GB HBM3",
                                   "date": "2026-01-02"}])
    results("soak.json", {"subset_identical": 30, "subset_compared": 40})
    monkeypatch.setattr(glance, "ENGINE_ROWS", glance.GPU / "gpu_validate/engine_flash_attn/"
                        "rows.json")
    [line] = glance.block_exactness()
    assert "NVIDIA H100 80GB HBM3, 2026-01-02; 2 runs of 1 workloads" in line
    assert f"per workload 0.050{DASH}0.090, mean 0.010{DASH}0.014" in line
    assert f"on the same workloads 0.060{DASH}0.080, mean 0.012{DASH}0.013" in line
    assert f"plugin vs flat 50{DASH}70%, the two kernels 60{DASH}80%" in line
    assert "30 of 40 greedy requests" in line


def test_the_serving_summary_shows_the_latest_run_and_the_gain_over_every_run(results):
    results("serve.json", [
        row("flash_attn", "chat_1k5_system", "90%", "a", 12.0, 1000),
        row("cascade_flash_attn", "chat_1k5_system", "90%", "a", 10.0, 1100),
        row("flash_attn", "chat_1k5_system", "90%", "b", 16.0, 1000),
        row("cascade_flash_attn", "chat_1k5_system", "90%", "b", 10.0, 1000),
        row("cascade_flash_attn_always", "chat_1k5_system", "90%", "b", 1.0, 9000),  # not shipped
    ])
    [line] = [x for x in glance.block_serve_summary() if x.startswith("| chat")]
    # latest run b: 16.0 -> 10.0; gains 1.2 (a) and 1.6 (b); output 1.10 (a), 1.00 (b)
    assert line == (f"| chat, 1.5K system prompt | 90% (10.0 req/s) | 16.0 → 10.0 "
                    f"(1.20{DASH}1.60{X}) | 1,000 → 1,000 (1.00{DASH}1.10{X}) | 100 → 100 "
                    f"(1.00{X}) | H200, 2 |")


def test_every_first_screen_block_is_rendered_in_the_readme():
    text = tables.README.read_text()
    for name in ("glance", "costs", "exactness", "serve_summary"):
        assert f"<!-- table:{name} -->" in text
