"""The pure parts of the kernel benchmark (``benchmarks.kernels.bench``): grid, floor, page layout
(``kernels.grid``), targets (``kernels.targets``); no GPU. Its GPU half is exercised on the GPU
machine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.kernels import bench as kb
from benchmarks.kernels import grid as kg  # the grid, floor and page layouts
from benchmarks.kernels import targets as kt  # ratios, targets, summary
from vllm_cascade_plugin.planning.planner import plan_cascade

ROOT = Path(__file__).parents[3]
MODULE = "benchmarks.kernels.bench"
Case = kg.Case


# ------------------------------------------------------------------------------------ grid


def test_grid_is_exactly_the_issue_grid():
    expected = {(b, p, 128, 1) for b in (8, 32, 64, 128, 256) for p in (512, 2048, 8192, 32768)}
    expected |= {(256, 8192, 128, 4), (256, 8192, 128, 16)}
    rows = [(c.B, c.P, c.S, c.groups) for c in kg.grid()]
    assert len(rows) == 22 == len(set(rows))
    assert set(rows) == expected


def test_quick_is_a_small_subset_of_the_grid_with_a_grouped_row():
    assert 2 <= len(kg.QUICK) <= 3
    assert set(kg.QUICK) <= set(kg.grid())
    assert any(c.groups > 1 for c in kg.QUICK)


def test_rows_parse_with_default_groups_and_own_tokens():
    assert kg.parse_rows("256x8192x4, 8x512,8X512X1X64") == [
        Case(256, 8192, 128, 4), Case(8, 512, 128, 1), Case(8, 512, 64, 1)]


@pytest.mark.parametrize("text", [
    "", "8", "8x512x1x64x3", "axb",
    "8x500",  # a prefix of partial pages: FA3's cascade_attention asserts whole pages
    "8x512x3",  # groups must divide B
    "8x512x8",  # a group of one request shares nothing
    "8x0",
])
def test_bad_rows_are_refused(text):
    with pytest.raises(ValueError):
        kg.parse_rows(text)


def test_bad_rows_are_a_usage_error_before_any_gpu_import(capsys):
    with pytest.raises(SystemExit) as info:
        kb.main(["--rows", "8x500"])
    assert info.value.code == 2
    assert "whole pages" in capsys.readouterr().err


def test_help_and_import_need_no_gpu_library():
    probe = (
        "import importlib, sys\n"
        f"importlib.import_module({MODULE!r})\n"
        "heavy = {'torch', 'flashinfer', 'vllm'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=ROOT).returncode == 0
    proc = subprocess.run([sys.executable, "-m", MODULE, "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "--quick" in proc.stdout and "--rows" in proc.stdout


# ----------------------------------------------------------------------------------- floor


def test_unique_bytes_count_each_prefix_once_and_every_own_token():
    token = 8 * 128 * 2 * 2  # kv heads x head_dim x (K, V) x bf16
    assert kg.unique_kv_bytes(Case(256, 8192, 128, 16)) == (16 * 8192 + 256 * 128) * token
    assert kg.attention_flops(Case(8, 512)) == 4 * 8 * 32 * 128 * 640


@pytest.mark.parametrize(("b", "p", "floor"), [
    # The floor of each shape as first tabulated from its bytes and FLOPs (4.3 TB/s, 790 TFLOP/s).
    (8, 512, 0.0015), (64, 2048, 0.010), (256, 2048, 0.033), (128, 8192, 0.023),
    (256, 8192, 0.044), (64, 32768, 0.044), (256, 32768, 0.175),
])
def test_floor_reproduces_the_design_table(b, p, floor):
    digits = 4 if floor < 0.01 else 3
    assert round(kg.floor_ms(Case(b, p)), digits) == floor


def test_floor_is_the_slower_of_bandwidth_and_compute():
    small, large = Case(8, 512), Case(256, 32768)
    assert kg.floor_ms(small) == pytest.approx(1e3 * kg.unique_kv_bytes(small) / 4.3e12)
    assert kg.floor_ms(large) == pytest.approx(1e3 * kg.attention_flops(large) / 790e12)


# ---------------------------------------------------------------------------------- layout


LAYOUT_CASES = [Case(8, 512), Case(256, 8192, 128, 16), Case(6, 32, 17, 3), Case(4, 16, 1, 2)]


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.label)
def test_layout_gives_each_group_its_prefix_and_each_request_its_own_pages(case):
    layout = kg.build_layout(case, np.random.default_rng(0), pool_pages=4096)
    prefix_w, own_w = case.P // 16, -(-case.S // 16)
    table = layout.block_table
    assert table.dtype == np.int32 and table.shape == (case.B, prefix_w + own_w)
    assert layout.seq_lens.tolist() == [case.P + case.S] * case.B
    assert layout.num_blocks == max(4096, case.groups * prefix_w + case.B * own_w + 1)
    assert table.min() >= 1 and table.max() < layout.num_blocks  # never block 0
    n = case.B // case.groups
    for g in range(case.groups):
        rows = table[g * n:(g + 1) * n]
        assert (rows[:, :prefix_w] == layout.prefix_pages[g]).all()
    assert (table[:, prefix_w:] == layout.own_pages).all()
    # Distinct everywhere else: groups share nothing, requests own their pages.
    ids = np.concatenate([layout.prefix_pages.ravel(), layout.own_pages.ravel()])
    assert len(np.unique(ids)) == len(ids)


def test_layout_pages_are_shuffled_and_seeded():
    case = Case(64, 2048)
    a = kg.build_layout(case, np.random.default_rng(0), 32768).block_table
    b = kg.build_layout(case, np.random.default_rng(0), 32768).block_table
    c = kg.build_layout(case, np.random.default_rng(1), 32768).block_table
    assert (a == b).all() and not (a == c).all()
    assert not (np.diff(a[0]) == 1).all()  # not handed out in order


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.label)
def test_flat_level_lists_every_request_s_full_page_list(case):
    layout = kg.build_layout(case, np.random.default_rng(0))
    flat = layout.flat()
    width = layout.block_table.shape[1]
    assert flat.qo_indptr.tolist() == list(range(case.B + 1))
    assert flat.kv_page_indptr.tolist() == [r * width for r in range(case.B + 1)]
    assert (flat.kv_page_indices.reshape(case.B, width) == layout.block_table).all()
    tokens = (width - 1) * 16 + flat.kv_last_page_len
    assert tokens.tolist() == layout.seq_lens.tolist()
    assert all(a.dtype == np.int32 for a in (flat.qo_indptr, flat.kv_page_indptr,
                                             flat.kv_page_indices, flat.kv_last_page_len))


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.label)
def test_cascade_levels_read_every_page_of_every_request_once(case):
    layout = kg.build_layout(case, np.random.default_rng(0))
    shared, own = layout.cascade()
    n = case.B // case.groups
    assert shared.qo_indptr.tolist() == [g * n for g in range(case.groups + 1)]
    assert (shared.kv_last_page_len == 16).all()
    assert own.qo_indptr.tolist() == list(range(case.B + 1))
    for r in range(case.B):
        g = r // n
        group_pages = shared.kv_page_indices[shared.kv_page_indptr[g]:shared.kv_page_indptr[g + 1]]
        own_pages = own.kv_page_indices[own.kv_page_indptr[r]:own.kv_page_indptr[r + 1]]
        assert np.concatenate([group_pages, own_pages]).tolist() == layout.block_table[r].tolist()
        assert (len(group_pages) * 16 + (len(own_pages) - 1) * 16 + own.kv_last_page_len[r]
                == layout.seq_lens[r])


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.label)
def test_the_planner_finds_exactly_the_layout_s_groups(case):
    """What the plugin row expects: two levels whose shared level is the groups' prefixes."""
    layout = kg.build_layout(case, np.random.default_rng(0))
    plan = plan_cascade(layout.block_table, layout.seq_lens, np.ones(case.B, np.int32), 16)
    assert plan.num_levels == 2
    shared = plan.levels[0]
    assert plan.stats.group_sizes == (case.B // case.groups,) * case.groups
    got = {tuple(shared.kv_page_indices[shared.kv_page_indptr[g]:shared.kv_page_indptr[g + 1]])
           for g in range(shared.num_groups)}
    assert got == {tuple(p) for p in layout.prefix_pages.tolist()}
    assert plan.stats.pages_cascade == case.groups * case.P // 16 + layout.own_pages.size


# --------------------------------------------------------------------------------- targets


def _row(case, plugin, fi_decode, fa3_cascade, ok=True):
    return {"B": case.B, "P": case.P, "S": case.S, "groups": case.groups,
            "floor_ms": kg.floor_ms(case), "plugin_choice": "cascade", "plan_us": 100.0,
            "ms": {"plugin": plugin, "fi_decode": fi_decode, "fi_cascade": 1.0,
                   "fa3_decode": 1.0, "fa3_cascade": fa3_cascade},
            "ok": ok, "errors": [] if ok else ["fa3_decode: max abs error 0.3 > 0.02"]}


def _good_grid():
    """Every target met: plugin = 2x floor, fi_decode 4x plugin, fa3_cascade 1.5x plugin."""
    return [_row(c, 2 * kg.floor_ms(c), 8 * kg.floor_ms(c), 3 * kg.floor_ms(c))
            for c in kg.grid()]


def _targets(rows):
    return {t["name"]: t for t in kt.evaluate_targets(rows)}


def test_targets_pass_on_a_grid_that_meets_them_and_list_their_rows():
    targets = _targets(_good_grid())
    assert [t["pass"] for t in targets.values()] == [True] * 4
    assert len(targets["plugin_never_slower"]["rows"]) == 22
    assert set(targets["geomean_speedup_vs_fi_decode"]["rows"]) == {
        f"B={b} P={p} G=1" for b, p in [(8, 32768), (32, 8192), (32, 32768), (64, 8192),
                                        (64, 32768), (128, 2048), (128, 8192), (128, 32768),
                                        (256, 2048), (256, 8192), (256, 32768)]}
    assert targets["geomean_speedup_vs_fi_decode"]["value"] == pytest.approx(4.0)
    assert set(targets["beats_fa3_cascade"]["rows"]) == {
        f"B={b} P={p} G=1" for b in (64, 128, 256) for p in (8192, 32768)} | {
        "B=256 P=8192 G=4", "B=256 P=8192 G=16"}
    assert set(targets["near_floor"]["rows"]) == {
        "B=64 P=32768 G=1", "B=128 P=32768 G=1", "B=256 P=32768 G=1", "B=256 P=8192 G=1",
        "B=256 P=8192 G=4", "B=256 P=8192 G=16"}
    assert targets["near_floor"]["value"] == pytest.approx(2.0)


def test_a_row_slower_than_flat_fails_only_the_never_slower_target():
    rows = _good_grid()
    rows[0]["ms"]["plugin"] = rows[0]["ms"]["fi_decode"] * 1.01  # B=8 P=512: eligible for no other
    targets = _targets(rows)
    assert targets["plugin_never_slower"]["pass"] is False
    assert targets["plugin_never_slower"]["failing"] == ["B=8 P=512 G=1"]
    assert targets["plugin_never_slower"]["value"] == pytest.approx(1.01)
    assert [t["pass"] for t in targets.values()][1:] == [True] * 3


def test_the_speedup_target_is_a_geometric_mean():
    rows = _good_grid()
    for r in rows:  # fi_decode / plugin: 8 on one eligible row, 1 on the ten others
        if r["groups"] == 1 and r["B"] * r["P"] >= 262144:
            r["ms"]["fi_decode"] = r["ms"]["plugin"] * (8 if (r["B"], r["P"]) == (8, 32768) else 1)
    target = _targets(rows)["geomean_speedup_vs_fi_decode"]
    assert target["value"] == pytest.approx(8 ** (1 / 11))
    assert target["pass"] is False


def test_fa3_and_floor_targets_fail_on_the_rows_that_miss_them():
    rows = _good_grid()
    big = next(r for r in rows if (r["B"], r["P"], r["groups"]) == (256, 32768, 1))
    big["ms"]["fa3_cascade"] = big["ms"]["plugin"] * 1.2  # needs 1.3
    big["floor_ms"] = big["ms"]["plugin"] / 3.5  # needs <= 3x
    targets = _targets(rows)
    assert targets["beats_fa3_cascade"]["failing"] == ["B=256 P=32768 G=1"]
    assert targets["beats_fa3_cascade"]["value"] == pytest.approx(1.2)
    assert targets["near_floor"]["failing"] == ["B=256 P=32768 G=1"]
    assert targets["near_floor"]["value"] == pytest.approx(3.5)


def test_missing_numbers_fail_the_targets_they_are_eligible_for():
    rows = _good_grid()
    big = next(r for r in rows if (r["B"], r["P"], r["groups"]) == (256, 32768, 1))
    big["ms"]["plugin"] = None  # the method raised on the GPU
    targets = _targets(rows)
    assert all(t["pass"] is False for t in targets.values())
    assert all(t["missing"] == ["B=256 P=32768 G=1"] for t in targets.values())


def test_targets_without_eligible_rows_are_not_applicable():
    targets = _targets([_row(Case(8, 512), 0.05, 0.06, 0.1)])
    assert targets["plugin_never_slower"]["pass"] is True
    assert [t["pass"] for t in targets.values()][1:] == [None] * 3


def test_summary_shows_ratios_targets_and_a_loud_correctness_failure():
    rows = _good_grid()
    rows[3] = {**rows[3], "ok": False, "errors": ["fa3_decode: max abs error 0.3 > 0.02"]}
    lines = kt.summary_lines(rows, kt.evaluate_targets(rows))
    text = "\n".join(lines)
    assert "fi/pl" in lines[0] and "fa3c/pl" in lines[0] and "pl/floor" in lines[0]
    big = next(line for line in lines if line.split()[:3] == ["256", "32768", "1"])
    assert "4.00" in big and "1.50" in big and "2.0" in big
    assert text.count("target PASS") == 4
    assert "!!! CORRECTNESS/ERRORS in 1 row(s)" in text
    assert "B=128 P=512 G=1: fa3_decode: max abs error" in text
    json.dumps(kt.evaluate_targets(rows))  # the summary file is JSON


def test_ratios_of_a_row():
    ratios = kt.row_ratios(_row(Case(64, 8192), 0.2, 0.8, 0.3))
    assert ratios["fi_decode/plugin"] == pytest.approx(4.0)
    assert ratios["fa3_cascade/plugin"] == pytest.approx(1.5)
    assert ratios["plugin/floor"] == pytest.approx(0.2 / kg.floor_ms(Case(64, 8192)))
    assert math.isnan(kt.row_ratios(_row(Case(8, 512), math.nan, 1.0, 1.0))["plugin/floor"])


# ------------------------------------------------------------------------------------ plot


def test_plot_results_renders_the_kernel_grid(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plot_results as plot

    (tmp_path / "kernel_grid.json").write_text(json.dumps(_good_grid()))
    assert plot.main([str(tmp_path)]) == 0
    assert (tmp_path / "kernel_grid.png").stat().st_size > 10_000
