"""The serve bench's reading of the plugin's counters in the middle of a run's arrivals
(``metrics.mid_run``) and the client runner's polling while it waits (``run_client``)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.serve import metrics as sm
from benchmarks.serve import processes as sp

ARRIVALS = 103.0  # decode steps from here on; the first prefill was counted at 102.5
DURATION = 20.0  # of arrivals: the middle half is 108 to 118 s


def cascade_steps(t: float) -> float:
    """Decode steps run as cascade by ``t``: 40 a second while the batch grows (103-108 s) and
    drains (after 118 s), 95 a second in between."""
    ramp = min(max(t - ARRIVALS, 0.0), 5.0)
    middle = min(max(t - 108.0, 0.0), 10.0)
    drain = max(t - 118.0, 0.0)
    return 40 * ramp + 95 * middle + 40 * drain


def counters(t: float) -> dict:
    """What ``parse_counters`` reads at ``t``: 100 decode steps a second from the first
    arrival on, 1 a second flat with no shared level, the rest not run as cascade flat for the
    cost model; vLLM's finished prefills, 30 a second from 102.5 s on."""
    out = dict.fromkeys([*sm.COUNTERS, *sm.BY_LABEL])
    running = max(t - ARRIVALS, 0.0)
    planned, cascade, nothing = 100 * running, cascade_steps(t), 1 * running
    prefills = 30 * max(t - (ARRIVALS - 0.5), 0.0)
    out.update(vllm_prefill_n=7.0 + prefills,  # 7 from earlier runs on this server
               steps_planned=planned, decode_steps_planned=planned,
               decode_steps_cascade=cascade,
               decode_flat_steps={"no shared level": nothing,
                                  "cost model": planned - cascade - nothing})
    return out


def snapshots(times) -> list:
    return [(t, counters(t)) for t in times]


def test_the_middle_of_the_arrivals_is_read_from_the_snapshots_inside_it():
    every_second = snapshots(range(100, 131))
    middle = sm.mid_run(every_second, counters(99.0), DURATION)
    # From 108 s to 118 s: 1,000 decode steps, 950 cascade, 10 with nothing shared, 40 flat for
    # the cost model (by hand from counters() above).
    assert middle["mid_run_window_s"] == [5.0, 15.0]
    assert middle["mid_run_decode_steps"] == 1000
    assert middle["mid_run_cascade_step_fraction"] == pytest.approx(0.95)
    assert middle["mid_run_flat_reasons"] == {"cost model": pytest.approx(0.04),
                                              "no shared level": pytest.approx(0.01)}
    assert middle["mid_run_shared_cascade_fraction"] == pytest.approx(950 / 990)
    # The whole run (103 s to 130 s) holds the ramps: a smaller share, as the row's own says.
    whole = sm.fractions(sm.counter_deltas(counters(99.0), counters(130.0)), True)[0]
    assert whole == pytest.approx(cascade_steps(130.0) / 2700) and whole < 0.8


def test_snapshots_a_second_apart_at_odd_times_take_the_ones_inside_the_window():
    odd = snapshots([100.4 + k for k in range(31)])  # 100.4, 101.4, ...
    middle = sm.mid_run(odd, counters(99.0), DURATION)
    # Arrivals seen from 103.4 on: window 108.4-118.4; inside it 108.4 ... 118.4.
    assert middle["mid_run_window_s"] == [5.0, 15.0]
    steps = 100 * 10
    cascade = cascade_steps(118.4) - cascade_steps(108.4)
    assert middle["mid_run_cascade_step_fraction"] == pytest.approx(cascade / steps)


@pytest.mark.parametrize("times, duration", [
    (range(100, 103), DURATION),  # no prefill counted while the client ran
    (range(100, 112), DURATION),  # the client's snapshots stop before the window's middle
    ([100, 104, 118], DURATION),  # one snapshot inside the window
    (range(100, 131), 0.0),  # no arrivals' duration (a burst)
])
def test_no_middle_without_snapshots_that_cover_it(times, duration):
    middle = sm.mid_run(snapshots(times), counters(99.0), duration)
    assert set(middle) == {"mid_run_window_s", "mid_run_decode_steps",
                           "mid_run_cascade_step_fraction", "mid_run_flat_reasons",
                           "mid_run_shared_cascade_fraction"}
    assert all(v is None for v in middle.values())


def test_the_client_runner_polls_while_the_client_runs_and_still_stops_it_in_time(tmp_path):
    calls = []
    code = sp.run_client([sys.executable, "-c", "import time; time.sleep(1.6)"],
                         tmp_path / "c.log", 30, lambda: calls.append(1), every_s=0.25)
    assert code == 0 and 3 <= len(calls) <= 7
    slow = [sys.executable, "-c", "import time; time.sleep(30)"]
    assert sp.run_client(slow, tmp_path / "s.log", 1.0, lambda: calls.append(1), 0.25) == -1
    assert sp.run_client(slow, tmp_path / "t.log", 0.5) == -1  # without polling as before


@pytest.mark.parametrize("config", ["flash_attn", "cascade_flash_attn"])
def test_every_servers_poisson_runs_read_the_metrics_each_second_and_bursts_do_not(
        config, tmp_path, monkeypatch):
    """Flat and the plugin alike: the API server that streams the tokens also answers the
    mid-run reads of ``/metrics``, so a comparison needs the same reads on both servers."""
    import types

    from benchmarks.serve import bench as sb
    from benchmarks.serve import workloads as sw

    polled: dict[str, bool] = {}

    def fake_client(cmd, log, timeout_s, poll=None, every_s=1.0):
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        if "--seed" in cmd:
            polled[cmd[cmd.index("--request-rate") + 1]] = poll is not None
        return 1  # the run "failed": measure() goes on to the next rate without a row

    monkeypatch.setattr(sb, "run_client", fake_client)
    monkeypatch.setattr(sb.sm, "read_timeline", lambda path: None)
    runs = [("burst", sw.BURST, ["--request-rate", "inf", "--num-prompts", "8", "--seed", "1"],
             tmp_path / "burst.json"),
            ("50%", 4.0, ["--request-rate", "4.0", "--num-prompts", "8", "--seed", "2"],
             tmp_path / "half.json")]
    bench = types.SimpleNamespace(
        work=tmp_path, args=types.SimpleNamespace(run_timeout=60.0),
        warmup=lambda w, port, write: ["warm-up"],
        runs=lambda w, config, port, write: iter(runs), timeline=lambda config: None)
    (tmp_path / "server.log").write_text("")
    server = types.SimpleNamespace(port=1, reset_prefix_cache=lambda: True,
                                   get=lambda path: "", log=tmp_path / "server.log")
    rows = list(sb.measure(bench, server, types.SimpleNamespace(name="chat"), config))
    assert rows == []
    assert polled == {"inf": False, "4.0": True}


def _measured_rows(tmp_path, monkeypatch, config: str, rate_runs: dict) -> list:
    """``bench.measure`` over a burst and a 50% run whose fake client completes 8 requests in 2 s
    each, for ``config`` with the bench's ``rate_runs`` as given."""
    import json
    import types

    from benchmarks.serve import bench as sb
    from benchmarks.serve import workloads as sw

    def fake_client(cmd, log, timeout_s, poll=None, every_s=1.0):
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        if "--result-filename" in cmd:
            path = tmp_path / cmd[cmd.index("--result-filename") + 1]
            path.write_text(json.dumps({"completed": 8, "duration": 2.0}))
        return 0

    monkeypatch.setattr(sb, "run_client", fake_client)
    monkeypatch.setattr(sb.sm, "read_timeline", lambda path: None)
    runs = [(item, rate, ["--request-rate", str(rate), "--num-prompts", "8", "--seed", "1",
                          "--result-filename", f"{item}.json"], tmp_path / f"{item}.json")
            for item, rate in (("burst", sw.BURST), ("50%", 2.0))]
    bench = types.SimpleNamespace(
        work=tmp_path, args=types.SimpleNamespace(run_timeout=60.0, tensor_parallel_size=1),
        warmup=lambda w, port, write: ["warm-up"], known={"flash_attn": {"chat": 4.0}},
        rate_runs=rate_runs, run_id="this", run="this-abc", model="m", max_len=1,
        runs=lambda w, config, port, write: iter(runs), timeline=lambda config: None)
    (tmp_path / "server.log").write_text("")
    server = types.SimpleNamespace(port=1, reset_prefix_cache=lambda: True,
                                   get=lambda path: "", log=tmp_path / "server.log")
    workload = types.SimpleNamespace(name="chat", input_len=1, output_len=1)
    return list(sb.measure(bench, server, workload, config))


def test_a_rows_rate_names_the_run_whose_flat_burst_measured_it(tmp_path, monkeypatch):
    """Flat's burst in this run: its rate and the plugin's relative rates are this run's. A
    plugin run whose rate came from an earlier run's burst (another machine, perhaps) names it."""
    flat = _measured_rows(tmp_path, monkeypatch, "flash_attn", {"flash_attn": {"chat": "old"}})
    assert [r["sustainable_rate_run"] for r in flat] == ["this", "this"]
    assert [r["sustainable_rate"] for r in flat] == [4.0, 4.0]  # 8 requests in 2 s
    plugin = _measured_rows(tmp_path, monkeypatch, "cascade_flash_attn",
                            {"flash_attn": {"chat": "old"}})
    assert [r["sustainable_rate_run"] for r in plugin] == ["old", "old"]


def test_the_rate_of_an_earlier_run_is_its_latest_flat_burst():
    from benchmarks.serve import results as sr

    row = {"config": "flash_attn", "request_rate": "burst", "workload": "chat",
           "tensor_parallel_size": 1, "model": "llama3-8b"}
    rows = [{**row, "request_throughput": 3.0, "run_id": "a"},
            {**row, "request_throughput": 5.0, "run_id": "b"},
            {**row, "request_throughput": 9.0, "run_id": "c", "config": "flashinfer"}]
    assert sr.baseline_rates(rows, "flash_attn", 1) == {"chat": 5.0}
    assert sr.baseline_rates(rows, "flash_attn", 1, key="run_id") == {"chat": "b"}


def test_no_rate_is_taken_from_a_run_its_meta_leaves_out(tmp_path):
    """A run serve.meta.json marks ``left_out`` (e.g. its two flat servers far apart) gives no
    later run its burst rate: the latest kept run's does."""
    from benchmarks.serve import results as sr

    row = {"config": "flash_attn", "request_rate": "burst", "workload": "chat",
           "tensor_parallel_size": 1, "model": "llama3-8b"}
    rows = [{**row, "request_throughput": 3.0, "run_id": "a"},
            {**row, "request_throughput": 5.0, "run_id": "b"}]
    out = tmp_path / "serve.json"
    assert sr.rows_kept(out, rows) == rows  # no meta yet: every row
    (tmp_path / "serve.meta.json").write_text(json.dumps(
        {"runs": [{"run_id": "a"}, {"run_id": "b", "left_out": "flat servers 1.6x apart"}]}))
    kept = sr.rows_kept(out, rows)
    assert sr.baseline_rates(kept, "flash_attn", 1) == {"chat": 3.0}
    assert sr.baseline_rates(kept, "flash_attn", 1, key="run_id") == {"chat": "a"}
