"""Online serving: real ``vllm serve`` servers driven by ``vllm bench serve``, configs side by side.

Usage (on the GPU machine; ``--dry-run`` anywhere prints the commands and writes nothing):
    python3 -m benchmarks.serve.bench --model examples/models/llama3-8b \
        [--configs flashinfer,cascade,flash_attn,cascade_flash_attn] [--workloads ...] \
        [--rates burst,50%,90%] [--out benchmarks/results/gpu/serve.json] [--plot]

One server per config serves every workload (``--load-format dummy``, prefix caching on, a
word-level tokenizer written next to a copy of config.json). Per workload: a warm-up (not
recorded), then a burst (``--request-rate inf``) and Poisson rates at 50% and 90% of what the
same backend flat (``flashinfer``, ``flash_attn``) sustained in its burst (completed / duration);
the flat servers run first. ``--rates`` may differ per workload and repeat a rate
(``"prefix_8k_x4=burst,90%*2;*=burst,90%"``). The
prefix cache is reset before every run (``POST /reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE=1``)
and every run draws prompts of its own (its own ``--seed``), the same ones in every config. The
plugin's counters come from ``/metrics`` before and after each run (``PROMETHEUS_MULTIPROC_DIR``
joins the engine processes' counters there), and during every Poisson run (every server's, flat
ones too: the same load on each API server) every second while the client runs, for the middle
half of the arrivals (``mid_run_*``, a plugin row's: the decode batches of steady serving,
without the run's own ramp up and drain; ``metrics.mid_run``). Rows go to
``--out`` after every run, merged with the file's rows of other workloads/configs;
``serve.meta.json`` beside it records the commands. Every row of one invocation has the same
``run`` (its start time and the checkout's commit) and names the model it served (``model``: the
``--model`` folder's name; relative rates come from that model's flat bursts only).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import commit
from benchmarks.serve import metrics as sm
from benchmarks.serve import results as sr
from benchmarks.serve import workloads as sw
from benchmarks.serve.configs import CONFIGS, baseline, server_command, server_env
from benchmarks.serve.processes import Server, free_port, run_client
from benchmarks.serve.profiler import Window, summarize, traces


@dataclasses.dataclass
class Bench:
    """What every run of one invocation shares."""

    args: argparse.Namespace
    rates: dict[str, list[str]]  # workload (or "*": any other) -> its rate items
    known: dict[str, dict[str, float]]  # flat config -> workload -> its sustainable req/s
    work: Path
    run_id: str
    run: str  # the invocation and the checkout it ran: "<run_id>-<commit>"
    max_len: int
    special: list[int]
    vocab_size: int
    # flat config -> workload -> the run whose burst measured ``known``'s rate (this one, or an
    # earlier run of --out, perhaps on another machine, where this run has no such burst)
    rate_runs: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    @property
    def model_dir(self) -> Path:
        return self.work / "model"

    @property
    def model(self) -> str:
        """The model's name in the rows: its config folder's (``pairs.model_of``)."""
        return model_name(self.args.model)

    def dataset(self, w: sw.Workload, label: str, n: int | str, seed: int,
                write: bool) -> Path | None:
        """The tree's JSONL for one run (shared by the configs); None for vLLM's datasets."""
        if w.kind != "tree":
            return None
        path = self.work / "datasets" / f"{w.name}-{sw.base_rate(label).rstrip('%')}-{seed}.jsonl"
        if write and not path.exists():
            assert isinstance(n, int)
            sw.write_tree_dataset(path, w, n, seed, self.vocab_size, self.special)
        return path

    def runs(self, w: sw.Workload, config: str, port: int,
             write: bool) -> Iterator[tuple[str, float | str | None, list[str], Path]]:
        """(rate item, rate, client command, result file) of each measured run; rate None (and
        placeholders in the command) while the rate waits for the flat backend's burst."""
        flat = baseline(config)
        for item in self.rates_for(w.name):
            rate = sw.resolve_rate(item, self.known.get(flat, {}).get(w.name))
            seed = sw.run_seed(self.args.seed, w.name, item)
            name = f"{config}-{w.name}-{item.replace('%', '')}.json"
            if rate is None:
                n: int | str = self.args.num_prompts or (
                    f"<max({sw.MIN_POISSON_PROMPTS}, rate x {self.args.duration:g} s)>")
                shown: float | str = f"<{sw.base_rate(item)} of {flat} burst req/s on {w.name}>"
            else:
                n = sw.num_prompts(w, rate, self.args.num_prompts, self.args.duration)
                shown = rate
            data = self.dataset(w, item, n, seed, write and rate is not None)
            cmd = sw.client_command(w, self.model_dir, port, shown, n, seed, data,
                                    (self.work / "results", name))
            yield item, rate, cmd, self.work / "results" / name

    def timeline(self, config: str) -> Path | None:
        """The step-timeline probe's file of ``config``'s server (None: no probe)."""
        return self.work / f"timeline-{config}.json" if self.args.step_timeline else None

    def rates_for(self, workload: str) -> list[str]:
        return self.rates.get(workload, self.rates.get("*", []))

    def warmup(self, w: sw.Workload, port: int, write: bool) -> list[str]:
        n = sw.round_prompts(w, self.args.warmup_prompts)
        seed = sw.run_seed(self.args.seed, w.name, "warmup")
        return sw.client_command(w, self.model_dir, port, sw.BURST, n, seed,
                                 self.dataset(w, "warmup", n, seed, write), None)


def measure(bench: Bench, server: Server, w: sw.Workload, config: str) -> Iterator[dict]:
    """Warm-up, then each rate on ``server``: one row per finished run."""
    logs, timeout = bench.work / "client-logs", bench.args.run_timeout
    print(f"[{config}] {w.name}: warm-up", flush=True)
    if run_client(bench.warmup(w, server.port, True), logs / f"{config}-{w.name}-warmup.log",
                  timeout) != 0:
        print(f"  warm-up failed, see {logs}/{config}-{w.name}-warmup.log", file=sys.stderr)
    for item, rate, cmd, result_path in bench.runs(w, config, server.port, True):
        if rate is None:
            print(f"  {w.name} {item}: skipped, no {baseline(config)} burst to derive it from",
                  file=sys.stderr)
            continue
        if not server.reset_prefix_cache():
            print("  the prefix cache was not reset: the run's own seed keeps it fresh",
                  file=sys.stderr)
        before = sm.parse_counters(server.get("/metrics"))
        timeline = sm.read_timeline(bench.timeline(config))
        offset = server.log.stat().st_size
        print(f"[{config}] {w.name} rate {rate}: {cmd[cmd.index('--num-prompts') + 1]} requests",
              flush=True)
        client_log = logs / result_path.with_suffix(".log").name
        snapshots: list[tuple[float, dict[str, Any]]] = []
        # Every server's Poisson runs read /metrics each second, flat ones too (their mid_run_*
        # stay None): the API server that streams the tokens serves the reads, so flat and the
        # plugin must carry the same.
        poisson = rate != sw.BURST
        code = run_client(cmd, client_log, timeout,
                          functools.partial(snapshot, server, snapshots) if poisson else None)
        after = sm.parse_counters(server.get("/metrics"))
        # the probe writes a quarter second after the engine's last step
        time.sleep(1.5 if timeline is not None else 0)
        timeline = sm.timeline_deltas(timeline, sm.read_timeline(bench.timeline(config)))
        with server.log.open("rb") as f:
            f.seek(offset)
            warnings = sm.count_capture_warnings(f.read().decode(errors="replace"))
        if code != 0 or not result_path.is_file():
            tail = client_log.read_text(errors="replace")[-3000:]
            print(f"  run failed ({code}); the end of {client_log}:\n{tail}", file=sys.stderr)
            continue
        result = json.loads(result_path.read_text())
        if config == baseline(config) and rate == sw.BURST and result.get("completed"):
            bench.known.setdefault(config, {})[w.name] = sw.sustainable_rate(result)
            bench.rate_runs.setdefault(config, {})[w.name] = bench.run_id
        requests = int(cmd[cmd.index("--num-prompts") + 1])
        middle = sm.mid_run(snapshots, before, requests / float(rate) if poisson else 0.0)
        yield sr.make_row(
            workload=w.name, config=config, request_rate=rate,
            tensor_parallel_size=bench.args.tensor_parallel_size, result=result,
            delta=sm.counter_deltas(before, after), plugin_on=CONFIGS[config].plugin_on,
            capture_warnings=warnings,
            extra={"rate_spec": item,
                   "sustainable_rate": bench.known.get(baseline(config), {}).get(w.name),
                   "offered_load": sm.offered_load(rate, bench.known.get(baseline(config), {})
                                                   .get(w.name)),
                   "sustainable_rate_run": bench.rate_runs.get(baseline(config), {}).get(w.name),
                   "seed": int(cmd[cmd.index("--seed") + 1]), "run_id": bench.run_id,
                   "run": bench.run, "model": bench.model,
                   "max_model_len": bench.max_len, "prompt_len": w.input_len,
                   "output_len": w.output_len, **middle, **timeline})


def profile_run(bench: Bench, server: Server, w: sw.Workload, config: str) -> None:
    """``--profile``'s rate once more (the same prompts) under vLLM's torch profiler; the
    summary of its trace to ``serve_profile/`` beside ``--out``, no row (serve/profiler.py)."""
    for item, rate, cmd, result_path in bench.runs(w, config, server.port, True):
        if item != bench.args.profile or rate is None:
            continue
        requests = int(cmd[cmd.index("--num-prompts") + 1])
        arrivals_s = requests / float(rate) if rate != sw.BURST else 10.0
        cmd[cmd.index("--result-filename") + 1] = "profiled-" + result_path.name
        window = Window(server.url, 0.4 * arrivals_s, bench.args.profile_s)
        trace_dir = Path(bench.args.work_dir) / "traces" / config  # server_command names it
        before = set(traces(trace_dir))
        server.reset_prefix_cache()
        print(f"[{config}] {w.name} rate {rate}: profiled run", flush=True)
        run_client(cmd, bench.work / "client-logs" / f"profiled-{result_path.stem}.log",
                   bench.args.run_timeout, window)
        window.finish()
        summaries = [summarize(p) for p in traces(trace_dir) if p not in before]
        out = bench.args.out.parent / "serve_profile" / f"{w.name}-{item.strip('%')}-{config}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"run": bench.run, "workload": w.name, "config": config,
                                   "rate_spec": item, "request_rate": rate,
                                   "window_s": bench.args.profile_s, "traces": summaries},
                                  indent=1))
        print(f"  profile summary: {out}", flush=True)


def snapshot(server: Server, into: list[tuple[float, dict[str, Any]]]) -> None:
    """The server's counters now, appended to ``into`` with the monotonic time (a failed read
    is left out: the run's own numbers do not need it)."""
    try:
        into.append((time.monotonic(), sm.parse_counters(server.get("/metrics"))))
    except Exception as exc:  # a slow or refused read: this second has no snapshot
        print(f"  /metrics not read mid-run: {type(exc).__name__}: {exc}", file=sys.stderr)


def print_dry_run(bench: Bench, configs: list[str], workloads: list[sw.Workload]) -> None:
    print(f"# model {bench.model}: {bench.args.model}/config.json, max_model_len {bench.max_len}")
    for i, config in enumerate(configs):
        port = bench.args.port + i
        env = server_env(CONFIGS[config], bench.work / f"prometheus-{config}",
                         bench.timeline(config), Path(bench.args.model))
        shown = [f"{k}={env[k]}" for k in (*CONFIGS[config].env, "PROMETHEUS_MULTIPROC_DIR",
                                           "VLLM_SERVER_DEV_MODE", "PYTHONPATH") if k in env]
        cmd = server_command(CONFIGS[config], bench.model_dir, port, bench.max_len, bench.args,
                             config)
        print(f"# server {config}: {' '.join(shown)} {shlex.join(cmd)}")
        for w in workloads:
            print(f"#   {w.name} warm-up: {shlex.join(bench.warmup(w, port, False))}")
            for item, _, client, _ in bench.runs(w, config, port, False):
                print(f"#   {w.name} {item}: {shlex.join(client)}")


def server_order(config: str) -> int:
    """Where ``config``'s server runs in a run: the flat baselines first (the plugin's rates
    come from their bursts), then the plugin's, then the flat configs compared with a baseline
    (its repeat ``flash_attn_again``, so two identical servers bracket the plugin's and their
    distance includes the run's drift over time; a variant such as ``flash_attn_piecewise``)."""
    if CONFIGS[config].plugin_on:
        return 1
    return 0 if baseline(config) == config else 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.plot_only:
        print(sr.plot(args.out, list(CONFIGS)))
        return 0
    configs = args.configs if args.servers_as_listed else sorted(args.configs, key=server_order)
    bursts = any(sw.base_rate(r) == sw.BURST for items in args.rates.values() for r in items)
    if args.servers_as_listed and bursts and any(baseline(c) == c for c in configs):
        sys.exit("--servers-as-listed with a flat burst: a server before it would take its "
                 "relative rates from an earlier run's burst, the ones after from this one's")
    workloads = [sw.WORKLOADS[w] for w in args.workloads]
    rates = args.rates
    if unknown := sorted(set(rates) - {"*", *args.workloads}):
        sys.exit(f"--rates names {', '.join(unknown)}, not in --workloads")
    old = [] if args.fresh else sr.load_rows(args.out)
    model = model_name(args.model)
    flats = sorted({baseline(c) for c in CONFIGS})
    kept = sr.rows_kept(args.out, old)  # no rate from a run left out of the tables
    known = {flat: sr.baseline_rates(kept, flat, args.tensor_parallel_size, model)
             for flat in flats}
    rate_runs = {flat: sr.baseline_rates(kept, flat, args.tensor_parallel_size, model, "run_id")
                 for flat in flats}
    for flat in sorted({baseline(c) for c in configs} - set(configs)):
        missing = [w.name for w in workloads if w.name not in known[flat] and any(
            sw.base_rate(r).endswith("%") for r in rates.get(w.name, rates.get("*", [])))]
        if missing:
            print(f"no {flat} burst row of {model} in {args.out} for {', '.join(missing)}: their "
                  f"relative rates are skipped (add {flat} to --configs, or give req/s)",
                  file=sys.stderr)
    run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    while (Path(args.work_dir) / run_id).exists():  # two invocations in one second
        run_id += "x"
    config_json = json.loads((Path(args.model) / "config.json").read_text())
    bench = Bench(args, rates, known, Path(args.work_dir) / run_id, run_id,
                  f"{run_id}-{commit()}", sw.max_model_len(workloads, config_json["vocab_size"]),
                  [config_json["bos_token_id"], config_json["eos_token_id"]],
                  config_json["vocab_size"], rate_runs)
    if args.dry_run:
        print_dry_run(bench, configs, workloads)
        return 0
    if sw.missing_modules(workloads):
        sys.exit(f"missing {', '.join(sw.missing_modules(workloads))}: vllm bench serve's custom "
                 "dataset (the tree workload) reads its JSONL with pandas")
    sw.write_model_folder(Path(args.model), bench.model_dir)
    meta = {"run_id": run_id, "run": bench.run, "date": datetime.date.today().isoformat(),
            **sr.provenance(),
            "command": shlex.join([Path(sys.executable).name, "-m", __spec__.name, *argv]),
            "model": f"{args.model} config.json, --load-format dummy, word-level tokenizer",
            "max_model_len": bench.max_len,
            "configs": {c: dataclasses.asdict(CONFIGS[c]) for c in configs},
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    log_dir = Path(args.log_dir) if args.log_dir else args.out.parent / "logs"
    new: list[dict[str, Any]] = []
    failed, port = [], args.port
    for config in configs:
        port = free_port(port)
        prometheus = bench.work / f"prometheus-{config}"
        prometheus.mkdir(parents=True)  # empty: the run id is new
        cmd = server_command(CONFIGS[config], bench.model_dir, port, bench.max_len, args, config)
        log = log_dir / f"serve-{config}-{run_id}.log"
        print(f"[{config}] vllm serve on port {port}, log {log}", flush=True)
        try:
            env = server_env(CONFIGS[config], prometheus, bench.timeline(config),
                             Path(args.model))
            with Server(cmd, env, log, port) as server:
                server.wait_healthy(args.server_timeout)
                for w in workloads:
                    for row in measure(bench, server, w, config):
                        row["gpu"] = meta["gpu"]  # rows of several machines share a file
                        new.append(row)
                        sr.write_results(args.out, sr.merge_rows(old, new), meta)
                        print(json.dumps({k: row[k] for k in sr.ROW_KEYS}), flush=True)
                    if args.profile and args.profile in bench.rates_for(w.name):
                        profile_run(bench, server, w, config)
        except Exception:  # this config failed (its rows so far are written); the others run
            traceback.print_exc()
            failed.append(config)
        port += 1
    if args.plot and new:
        print(sr.plot(args.out, list(CONFIGS)))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def model_name(model: str | Path) -> str:
    """A model folder's name, as rows name the model they served (``examples/models/gemma3-12b``
    -> ``gemma3-12b``)."""
    return Path(model).resolve().name


def _names(known: Any) -> Any:
    def parse(text: str) -> list[str]:
        names = text.split(",")
        if bad := [n for n in names if n not in known]:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; known: "
                                             f"{', '.join(known)}")
        return names
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="examples/models/llama3-8b",
                   help="folder with the model's config.json (no weights: --load-format dummy)")
    p.add_argument("--configs", type=_names(CONFIGS), default=",".join(CONFIGS),
                   help=f"any of {', '.join(CONFIGS)}; the flat ones run first (see "
                        "--servers-as-listed)")
    p.add_argument("--workloads", type=_names(sw.WORKLOADS), default=",".join(sw.WORKLOADS),
                   help="comma-separated")
    p.add_argument("--rates", type=sw.parse_rate_plan, default="burst,50%,90%",
                   help="'burst' (all requests at once), N%% (of the same backend's flat burst "
                        "req/s on that workload) or req/s; RATE*N repeats one; per workload: "
                        "'WORKLOAD=RATES;*=RATES'")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per run; default: the workload's burst count for bursts, "
                        "rate x --duration for Poisson rates")
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds of Poisson arrivals per run (the default --num-prompts)")
    p.add_argument("--warmup-prompts", type=int, default=16,
                   help="requests of each workload's warm-up burst (not recorded)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="server seed; base of the runs' seeds")
    p.add_argument("--port", type=int, default=8100, help="first server's port (then +1 ...)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu/serve.json"))
    p.add_argument("--log-dir", default=None, help="server logs (default: logs/ beside --out)")
    p.add_argument("--work-dir", default="/tmp/vllm-cascade-serve-bench",
                   help="model folder, datasets, client results and logs (a folder per run)")
    p.add_argument("--fresh", action="store_true", help="drop the rows already in --out")
    p.add_argument("--server-timeout", type=float, default=900.0,
                   help="seconds for a server to answer /health")
    p.add_argument("--run-timeout", type=float, default=1800.0,
                   help="seconds one vllm bench serve may take")
    p.add_argument("--profile", default=None, metavar="RATE",
                   help="one of --rates (e.g. 110%%): after a workload's runs, run it once more "
                        "under vLLM's torch profiler and summarize the trace (serve/profiler.py)")
    p.add_argument("--profile-s", type=float, default=4.0, help="seconds the profile lasts")
    p.add_argument("--step-timeline", action="store_true",
                   help="every server with the step-timeline probe (step_timeline/): rows gain "
                        "the GPU's time per step waiting for the host")
    p.add_argument("--servers-as-listed", action="store_true",
                   help="the servers run in --configs' order, e.g. the plugin's first (whether "
                        "a server's place in the run moves its figures): give relative rates "
                        "no flat burst then, so that every server's come from the same earlier "
                        "run's")
    p.add_argument("--plot", action="store_true", help="write serve.png beside --out at the end")
    p.add_argument("--plot-only", action="store_true", help="only plot --out, run nothing")
    p.add_argument("--dry-run", action="store_true",
                   help="print the server and client commands; run and write nothing")
    return p.parse_args(argv)

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the servers are stopped
    sys.exit(main())
