"""README.md and docs/: their measured figures are what scripts/readme_tables.py renders from the
committed result files, the README stays a short user's document, and together they list every
runtime patch (docs/architecture.md) and every knob (README: the user's, docs/configuration.md:
the advanced ones)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"


def _tables():
    spec = importlib.util.spec_from_file_location("readme_tables", REPO / "scripts" /
                                                  "readme_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["readme_tables"] = module
    spec.loader.exec_module(module)
    return module


tables = _tables()
serve = sys.modules["readme_serve"]  # its serving figures
common = sys.modules["readme_common"]  # the result files' paths, the formatting


def test_every_generated_block_is_what_the_committed_results_render():
    assert README in tables.DOCUMENTS
    names = []
    for document in tables.DOCUMENTS:
        text = document.read_text()
        names += tables.block_names(text)
        assert tables.render(text) == text, f"{document}: run python scripts/readme_tables.py"
    assert set(names) == set(tables.BLOCKS)
    # No document outside DOCUMENTS has blocks the script would leave stale.
    for document in [README, *sorted(DOCS.rglob("*.md"))]:
        if document not in tables.DOCUMENTS:
            assert not tables.block_names(document.read_text()), document


def test_the_check_mode_fails_on_a_stale_figure(tmp_path, capsys):
    text = README.read_text()
    stale = tmp_path / "README.md"
    stale.write_text(text.replace("<!-- table:glance -->\n", "<!-- table:glance -->\n9.99 "))
    assert tables.main(["--check", "--readme", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
    fresh = tmp_path / "fresh.md"
    fresh.write_text(text)
    assert tables.main(["--check", "--readme", str(fresh)]) == 0
    assert tables.main(["--check"]) == 0  # every document as committed


def test_an_unknown_block_is_an_error():
    with pytest.raises(KeyError, match="nonesuch"):
        tables.render("<!-- table:nonesuch -->\n<!-- /table -->\n")


def _documents() -> list[Path]:
    """The README and the user's documents under docs/ (not docs/design/)."""
    return [README, *sorted(DOCS.glob("*.md"))]


def test_readme_is_short_and_has_no_development_history():
    assert len(README.read_text().splitlines()) <= 300
    compatibility = re.search(r"<!-- table:compatibility -->.*?<!-- /table -->",
                              (DOCS / "compatibility.md").read_text(), re.S)
    assert compatibility is not None
    for document in _documents():
        text = document.read_text()
        for pattern in (r"\bsession ?\d", r"\b(start|final|round|part)\d", r"DESIGN\.md",
                        r"\bnot re-run\b"):
            assert not re.search(pattern, text, re.I), (document, pattern)
        # Commit hashes only where the compatibility table names the code a GPU check last
        # passed on, read from gpu_validate.json: provenance of a measurement, not history.
        rest = text.replace(compatibility.group(0), "")
        for word in re.findall(r"\b[0-9a-f]{7,40}\b", rest):
            assert not (re.search(r"\d", word) and re.search(r"[a-f]", word)), (document, word)
    recorded = (REPO / "benchmarks/results/gpu/gpu_validate.json").read_text()
    for word in re.findall(r"\b[0-9a-f]{7,40}\b", compatibility.group(0)):
        assert word in recorded, word


def test_the_readmes_first_screen_answers_a_new_users_questions():
    """Will it help me, how much, what it costs, how to turn it on, how to see it work: in the
    first 60 lines, each figure from a rendered block."""
    first = "\n".join(README.read_text().splitlines()[:60])
    for needed in ("<!-- table:glance -->", "<!-- table:costs -->", "pip install .",
                   "vllm-cascade check", "CASCADE_ATTENTION=1 vllm serve",
                   "cascade attention on", "ran cascade", "/metrics", "## Will it help you?"):
        assert needed in first, needed


def test_the_quoted_log_lines_are_the_plugins_own():
    """The README's startup and statistics lines are in the committed server log it names, and
    the code still writes them."""
    text = README.read_text()
    log = (REPO / "benchmarks/results/gpu/gpu_validate/serving/serving-on-v2-memshared.log")
    assert f"`{log.relative_to(REPO)}`" in text
    quoted = [line.split("] ", 1)[1] for line in text.splitlines()
              if "] vllm-cascade-plugin: " in line]
    assert len(quoted) == 3
    committed = log.read_text()
    for line in quoted:
        assert line in committed, line
    src = REPO / "src" / "vllm_cascade_plugin"
    assert "cascade attention on for the FLASH_ATTN and FLASHINFER" in (
        src / "integration" / "registration.py").read_text()
    assert "ran cascade (decode steps: %s" in (src / "stats" / "line.py").read_text()


def test_every_path_the_documents_name_exists():
    for document in _documents():
        text = document.read_text()
        serve = re.search(r"<!-- table:serve -->.*?<!-- /table -->", text, re.S)
        rest = text.replace(serve.group(0), "") if serve else text  # names serve.json first
        paths = [REPO / p for p in re.findall(
            r"`((?:benchmarks|examples|scripts|tests|docs|src)/[^`\s]*)`", rest)]
        paths += [document.parent / p.split("#")[0] for p in
                  re.findall(r"\]\(((?!https?:|#)[^)\s]+)\)", rest)]
        if document == README:
            assert paths
        for path in paths:
            if not re.search(r"[<*{]", str(path)):  # a pattern (tests/<part>/...), not a path
                assert path.exists(), (document, path)


def _knob_rows(path: Path) -> list[str]:
    return re.findall(r"^\| `(CASCADE_[A-Z_]+)` \|", path.read_text(), re.M)


def test_every_knob_is_in_a_configuration_table():
    """The user's knobs in the README, the advanced ones in docs/configuration.md: every knob of
    config.py in exactly one of them."""
    knobs = set(re.findall(r'"(CASCADE_[A-Z_]+)"',
                           (REPO / "src" / "vllm_cascade_plugin" / "config.py").read_text()))
    user, advanced = _knob_rows(README), _knob_rows(DOCS / "configuration.md")
    assert knobs and sorted(user + advanced) == sorted(knobs)
    assert {"CASCADE_ATTENTION", "CASCADE_POLICY", "CASCADE_ALLOW_UNTESTED_VLLM"} <= set(user)


def test_every_runtime_patch_of_vllm_is_listed():
    pytest.importorskip("vllm")
    from vllm_cascade_plugin.integration import hooks
    from vllm_cascade_plugin.integration.compat import releases

    def runner(module: str) -> str:
        return "V2" if ".worker.gpu." in module else "V1"

    text = (DOCS / "architecture.md").read_text()  # the patch table
    listed = re.findall(r"^\| (V[12]) `(\w+)\.(\w+)` \|", text, re.M)
    # Every method patched in some supported release (V1's only up to 0.33) ...
    recorded = {(runner(module), owner, name) for methods in releases.PATCHED_METHODS.values()
                for module, owner, name in methods}
    assert sorted(listed) == sorted(recorded)
    # ... and the installed release's patches among them.
    assert {(runner(owner.__module__), owner.__name__, name)
            for owner, name, _ in hooks.patch_targets()} <= recorded
    assert "register_backend(" in text  # the backend registration in __init__.py


def test_the_kernel_tables_plugin_column_is_the_shipped_cost_models_choice(tmp_path):
    """``benchmarks.kernels.bench --redecide`` (CPU) re-takes every row's choice with the
    shipped model."""
    import shutil

    from test_planner import run_python

    for name in ("kernel_grid.json", "kernel_grid.meta.json", "kernel_grid.summary.json"):
        shutil.copy(tables.GPU / name, tmp_path / name)
    out = run_python("-m", "benchmarks.kernels.bench", "--redecide", "--out",
                     str(tmp_path))
    assert "changed: none" in out


def _serve_row(config: str, rate: str | float, spec: str, scale: float, run: str = "r1",
               **extra) -> dict:
    plugin = config.startswith("cascade")
    return {"workload": "prefix_8k_x4", "config": config, "request_rate": rate,
            "rate_spec": spec, "tensor_parallel_size": 1, "output_tok_per_s": 1000 * scale,
            "ttft_ms_p50": 100 / scale, "ttft_ms_p99": 400 / scale, "tpot_ms_p50": 20 / scale,
            "tpot_ms_p99": 30 / scale, "itl_ms_p99": 40 / scale, "request_throughput": 4 * scale,
            "cascade_step_fraction": 0.95 if plugin else None, "run_id": run, "completed": 10,
            **extra}


def test_serve_block_says_not_measured_without_results(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "GPU", tmp_path)
    assert "Not measured yet" in "\n".join(serve.block_serve())


def test_serve_block_shows_the_plugin_against_flat_per_backend_workload_and_rate(
        tmp_path, monkeypatch):
    reasons = {"cost model": 0.22, "no shared level": 0.02, "mixed prefill+decode step": 0.001}
    rows = [_serve_row("flashinfer", "burst", "burst", 1.0), _serve_row("cascade", "burst",
                                                                         "burst", 2.0),
            _serve_row("flashinfer", 2.0, "50%", 1.0), _serve_row("cascade", 2.0, "50%", 1.25),
            _serve_row("flash_attn", 2.0, "50%", 0.9),
            _serve_row("cascade_flash_attn", 2.0, "50%", 1.8, run="r2", flat_reasons=reasons,
                       planning_us_p50=650.0, planning_us_p99=1900.0, host_us_per_step=1300.0,
                       mid_run_shared_cascade_fraction=0.994),
            # every request failed: nothing measured, no row
            _serve_row("flash_attn", "burst", "burst", 1.0, completed=0),
            _serve_row("cascade_flash_attn", "burst", "burst", 2.0)]
    (tmp_path / "serve.json").write_text(json.dumps(rows))
    monkeypatch.setattr(serve, "GPU", tmp_path)
    monkeypatch.setattr(common, "ROOT", tmp_path.parent)
    lines = serve.block_serve()
    table = [line for line in lines if "| prefix_8k_x4 |" in line]
    assert len(table) == 3
    flash_attn, burst, half = table
    x = tables.TIMES
    assert burst.startswith("| FLASHINFER |") and "| burst |" in burst
    assert f"1,000 → 2,000 (2.00{x})" in burst and f"400 → 200 (0.50{x})" in burst
    assert "95%" in burst
    assert "| 50% (2.0 req/s) |" in half and f"20.0 → 16.0 (0.80{x})" in half
    # vLLM's default backend against its own flat run, the plugin's counters shown
    assert flash_attn.startswith("| FLASH_ATTN |") and f"(2.00{x})" in flash_attn
    assert "cost model 22%, no shared level 2% |" in flash_attn  # under 0.5% left out
    assert "650 / 1,900 (1,300)" in flash_attn
    # of the decode steps that share (0.95 of 0.98), and mid-run where the row has it
    assert "| 95% (97%; 99% mid-run) |" in flash_attn and "mid-run" not in burst
    # measured by two invocations: marked, and the mark explained
    assert f"50% (2.0 req/s){serve.APART} |" in flash_attn
    assert any(line.startswith(serve.APART) for line in lines)


def test_a_point_measured_in_several_runs_shows_its_latest_run_and_every_runs_ratio(
        tmp_path, monkeypatch):
    """Each run's plugin row is paired with its own run's flat row: the latest run's figures
    are shown, then the range of the runs' ratios (not ratios across runs)."""
    rows = [_serve_row("flash_attn", 2.0, "90%", 1.0, run="a"),
            _serve_row("cascade_flash_attn", 2.0, "90%", 2.0, run="a"),
            _serve_row("flash_attn", 2.1, "90%", 0.5, run="b"),  # a slower flat server
            _serve_row("cascade_flash_attn", 2.1, "90%", 1.5, run="b")]
    (tmp_path / "serve.json").write_text(json.dumps(rows))
    monkeypatch.setattr(serve, "GPU", tmp_path)
    monkeypatch.setattr(common, "ROOT", tmp_path.parent)
    lines = serve.block_serve()
    [row] = [line for line in lines if "| prefix_8k_x4 |" in line]
    x = tables.TIMES
    assert "| 90% (2.1 req/s), 2 runs |" in row  # the latest run's rate
    # run b: 500 -> 1,500 (3.00x); run a: 2.00x. Never 1,500 / 1,000 (run b over run a's flat).
    dash = tables.DASH
    assert f"| 500 → 1,500 (3.00{x}; 2.00{dash}3.00{x}) |" in row
    assert f"| 40.0 → 13.3 (0.33{x}; 0.33{dash}0.50{x}) |" in row
    assert serve.APART not in row


def test_a_run_its_meta_leaves_out_is_in_no_table_and_the_caption_names_it(
        tmp_path, monkeypatch):
    """A run marked ``left_out`` in serve.meta.json (one that cannot resolve what it measured)
    keeps its rows in serve.json; the table shows the other run alone and names the left-out
    run; the headline reads no row of it either."""
    rows = [_serve_row("flash_attn", 2.0, "90%", 1.0, run="a"),
            _serve_row("cascade_flash_attn", 2.0, "90%", 2.0, run="a"),
            _serve_row("flash_attn", 2.1, "90%", 0.5, run="b"),
            _serve_row("cascade_flash_attn", 2.1, "90%", 1.5, run="b")]
    (tmp_path / "serve.json").write_text(json.dumps(rows))
    (tmp_path / "serve.meta.json").write_text(json.dumps({"runs": [
        {"run_id": "a"}, {"run_id": "b", "left_out": "its two flat servers far apart"}]}))
    monkeypatch.setattr(serve, "GPU", tmp_path)
    monkeypatch.setattr(common, "ROOT", tmp_path.parent)
    assert [r["run_id"] for r in common.served_rows(tmp_path / "serve.json")] == ["a", "a"]
    lines = serve.block_serve()
    [row] = [line for line in lines if "| prefix_8k_x4 |" in line]
    x = tables.TIMES
    assert "| 90% (2.0 req/s) |" in row and f"| 1,000 → 2,000 (2.00{x}) |" in row
    assert "left_out" in "\n".join(lines) and "run b" in "\n".join(lines)


def test_a_pair_measured_at_two_rates_names_both(tmp_path, monkeypatch):
    """A plugin row paired with a flat row of another run at another request rate (the flat
    burst its rate came from changed in between) shows both rates, and is marked apart."""
    rows = [_serve_row("flash_attn", 13.6, "90%", 1.0, run="a"),
            _serve_row("cascade_flash_attn", 13.4, "90%", 2.0, run="b")]
    (tmp_path / "serve.json").write_text(json.dumps(rows))
    monkeypatch.setattr(serve, "GPU", tmp_path)
    monkeypatch.setattr(common, "ROOT", tmp_path.parent)
    [row] = [line for line in serve.block_serve() if "| prefix_8k_x4 |" in line]
    assert f"| 90% (flat 13.6, plugin 13.4 req/s){serve.APART} |" in row


def test_each_serving_row_names_the_gpu_its_own_row_records(tmp_path, monkeypatch):
    """serve.json's rows come from several machines: the table's header names the GPU of most
    runs, a row from another GPU names its own beside its rate (read from the row, whatever the
    meta's latest run was measured on), and the headline names the GPUs of the runs it uses."""
    rows = [_serve_row("flash_attn", "burst", "burst", 1.0, run="a", gpu="NVIDIA H200"),
            _serve_row("cascade_flash_attn", "burst", "burst", 2.0, run="a", gpu="NVIDIA H200"),
            _serve_row("flash_attn", 2.0, "90%", 1.0, run="b", gpu="NVIDIA H100 80GB HBM3"),
            _serve_row("cascade_flash_attn", 2.0, "90%", 2.0, run="b",
                       gpu="NVIDIA H100 80GB HBM3")]
    (tmp_path / "serve.json").write_text(json.dumps(rows))
    (tmp_path / "serve.meta.json").write_text(json.dumps({
        "gpu": "NVIDIA H100 80GB HBM3", "runs": [
            {"run_id": "a", "date": "2026-12-01", "gpu": "NVIDIA H100 80GB HBM3"},  # wrong
            {"run_id": "b", "date": "2026-12-02", "gpu": "NVIDIA H100 80GB HBM3"}]}))
    monkeypatch.setattr(serve, "GPU", tmp_path)
    monkeypatch.setattr(common, "ROOT", tmp_path.parent)
    lines = serve.block_serve()
    burst, half = [line for line in lines if "| prefix_8k_x4 |" in line]
    assert "| burst |" in burst and "| 90% (2.0 req/s), NVIDIA H100 80GB HBM3 |" in half
    assert "NVIDIA H200 2026-12-01; NVIDIA H100 80GB HBM3 2026-12-02" in "\n".join(lines)
    assert "against it flat, NVIDIA H100 80GB HBM3, NVIDIA H200," in serve.serve_headline()


def test_a_bursts_time_to_first_token_is_split_into_its_parts(tmp_path, monkeypatch):
    """Below the table, each shown burst pair that carries vLLM's own TTFT histograms: the
    client's mean = HTTP (client less server) + tokenizing and hand-off (server less queue and
    prefill) + queue + prefill; a pair without them says nothing."""
    split = {"ttft_ms_mean": 3000.0, "server_ttft_ms_mean": 2500.0, "queue_ms_mean": 10.0,
             "prefill_ms_mean": 190.0}
    rows = [_serve_row("flash_attn", "burst", "burst", 1.0, **split),
            _serve_row("cascade_flash_attn", "burst", "burst", 2.0,
                       **{**split, "prefill_ms_mean": 90.0}),
            _serve_row("flashinfer", "burst", "burst", 1.0),  # no split: no sentence
            _serve_row("cascade", "burst", "burst", 2.0)]
    (tmp_path / "serve.json").write_text(json.dumps(rows))
    monkeypatch.setattr(serve, "GPU", tmp_path)
    monkeypatch.setattr(common, "ROOT", tmp_path.parent)
    [line] = [x for x in serve.block_serve() if x.startswith("Where a burst's")]
    assert ("FLASH_ATTN prefix_8k_x4: flat 3,000 ms = HTTP 500 + tokenizing and hand-off 2,300 "
            "+ queue 10 + prefill 190; plugin 3,000 ms = HTTP 500 + tokenizing and hand-off "
            "2,400 + queue 10 + prefill 90.") in line
    assert "FLASHINFER" not in line


def test_the_serving_headline_reads_each_points_latest_run_against_its_own_flat_row(
        tmp_path, monkeypatch):
    """The summary's serving sentence: TPOT p50 at 90% (flat / plugin) and a burst's output
    (plugin / flat), the latest run of each point paired with its own run's flat server, then
    the range over the point's runs and the days they ran, "not measured" for a missing point,
    and nothing at all without serving rows."""
    monkeypatch.setattr(serve, "GPU", tmp_path)
    assert serve.serve_headline() == ""
    rows = [_serve_row("flash_attn", 2.0, "90%", 1.0, run="20261201T000000"),
            _serve_row("cascade_flash_attn", 2.0, "90%", 4.0, run="20261201T000000"),
            # a later run of the same point, beside a faster flat server: it is the one shown
            _serve_row("flash_attn", 2.0, "90%", 1.5, run="20261202T000000"),
            _serve_row("cascade_flash_attn", 2.0, "90%", 3.0, run="20261202T000000"),
            # another backend's rows are not vLLM's default backend's
            _serve_row("flashinfer", "burst", "burst", 1.0, run="20261202T000000"),
            _serve_row("cascade", "burst", "burst", 9.0, run="20261202T000000")]
    (tmp_path / "serve.json").write_text(json.dumps(rows))
    x = tables.TIMES
    said = serve.serve_headline()
    assert (f"2.00{x} lower (2.00{tables.DASH}4.00{x} over 2 runs) / not measured with 4 "
            f"documents of 8K tokens") in said
    assert "2026-12-01, 2026-12-02)" in said
    assert "9.00" not in said and "one of 32K" not in said


def test_a_plugin_row_without_its_own_flat_row_pairs_with_the_flat_row_it_was_measured_against(
        ):
    """A plugin server run alone (no flat server in its run) is compared with the latest flat
    row before it in serve.json, not with a flat row a later run added."""
    rows = [_serve_row("flash_attn", 2.0, "90%", 1.0, run="a"),
            _serve_row("cascade_flash_attn", 2.0, "90%", 4.0, run="b"),  # alone, after run a
            _serve_row("flash_attn", 2.0, "90%", 2.0, run="c"),
            _serve_row("cascade_flash_attn", 2.0, "90%", 3.0, run="c")]
    runs = serve.serve_runs(rows, "flash_attn", "cascade_flash_attn", "prefix_8k_x4")["90%"]
    assert [(f["run_id"], c["run_id"]) for f, c in runs] == [("a", "b"), ("c", "c")]
    # No flat row before it: the first one after.
    runs = serve.serve_runs(rows[1:], "flash_attn", "cascade_flash_attn", "prefix_8k_x4")["90%"]
    assert [(f["run_id"], c["run_id"]) for f, c in runs] == [("c", "b"), ("c", "c")]


def test_a_repeat_at_the_same_rate_is_another_run_of_it_paired_with_its_own_flat_repeat():
    """serve_bench's "90%*2" writes rate specs "90%" and "90%#2" in one run: both are runs of
    the 90% point, and each plugin row pairs with the flat row of the same repeat."""
    rows = [_serve_row("flash_attn", 2.0, "90%", 1.0, run="r"),
            _serve_row("flash_attn", 2.0, "90%#2", 2.0, run="r"),
            _serve_row("cascade_flash_attn", 2.0, "90%", 4.0, run="r"),
            _serve_row("cascade_flash_attn", 2.0, "90%#2", 3.0, run="r")]
    runs = serve.serve_runs(rows, "flash_attn", "cascade_flash_attn", "prefix_8k_x4")
    assert list(runs) == ["90%"]
    assert [(f["rate_spec"], c["rate_spec"]) for f, c in runs["90%"]] == [
        ("90%", "90%"), ("90%#2", "90%#2")]


def test_the_serving_headline_adds_the_burst_with_four_api_servers(tmp_path, monkeypatch):
    """Where the 4-API-server pair measured the burst, the headline gives its output ratio
    beside the one-API-server burst's."""
    monkeypatch.setattr(serve, "GPU", tmp_path)
    rows = [_serve_row("flash_attn", "burst", "burst", 1.0, run="20261202T000000"),
            _serve_row("cascade_flash_attn", "burst", "burst", 1.5, run="20261202T000000"),
            _serve_row("flash_attn_api_servers_4", "burst", "burst", 2.0, run="20261203T000000"),
            _serve_row("cascade_flash_attn_api_servers_4", "burst", "burst", 5.0,
                       run="20261203T000000")]
    (tmp_path / "serve.json").write_text(json.dumps(rows))
    x = tables.TIMES
    said = serve.serve_headline()
    assert (f"not measured / 1.50{x} (2.50{x} with `--api-server-count 4`) with 4 documents"
            in said)
    assert "2026-12-02, 2026-12-03" in said
    # An earlier burst run: its range, then the 4-API-server burst, in one parenthesis.
    earlier = [_serve_row("flash_attn", "burst", "burst", 1.0, run="20261201T000000"),
               _serve_row("cascade_flash_attn", "burst", "burst", 1.2, run="20261201T000000")]
    (tmp_path / "serve.json").write_text(json.dumps(earlier + rows))
    assert (f"not measured / 1.50{x} (1.20{tables.DASH}1.50{x} over 2 runs; 2.50{x} with "
            f"`--api-server-count 4`) with 4 documents") in serve.serve_headline()


def test_the_readme_and_the_package_metadata_agree():
    """pyproject's setuptools floor is the one the README's Install names, and its description
    names both backends the plugin runs in."""
    pyproject = (REPO / "pyproject.toml").read_text()  # read as text: tomllib needs 3.11
    [floor] = re.findall(r'^requires = \["setuptools>=([\d.]+)"', pyproject, re.M)
    assert f"setuptools ≥ {floor}" in README.read_text()
    [description] = re.findall(r'^description = "(.*)"$', pyproject, re.M)
    assert "FlashAttention" in description and "FlashInfer" in description
