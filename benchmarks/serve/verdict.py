"""Never slower, judged per served point: the plugin against flat, beside two flat servers
against each other in the same run.

A run of ``scripts/serve_grid.sh``'s ``never_slower_paired`` slice serves the same requests, at
the same Poisson arrival times, three times: flat (``flash_attn``), the plugin
(``cascade_flash_attn``), and flat again (``flash_attn_again``; on FlashInfer ``flashinfer``,
``cascade`` and ``flashinfer_again``). Two identical flat servers are
several percent apart in one short run (``benchmarks/results/gpu/serve_noise_floor.json``), so
each point gets two verdicts:

* ``target``: the fixed bounds, TPOT p50 at least 0.99x flat's and TTFT p99 at most 1.05x;
* ``spread``: the same bounds widened to how far flat again is from flat at that point in that
  run (TPOT p50: ``min(0.99, 1 - |1 - again|)``; TTFT p99: ``max(1.05, 1 + |1 - again|)``): the
  plugin fails only where it is further from flat than flat is from itself.

    python3 -m benchmarks.serve.verdict [--file benchmarks/results/gpu/serve.json]
        [--run RUN | --latest] [--plugin cascade_flash_attn] [--json]

``scripts/serve_grid.sh`` appends the latest run's verdicts to each slice's log.

Standard library only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.serve.configs import CONFIGS, baseline
from benchmarks.serve.metrics import matched_decode
from benchmarks.serve.pairs import model_of, rate_spec

FLAT, PLUGIN = "flash_attn", "cascade_flash_attn"
AGAIN = "_again"  # a flat config's repeat in the same run: flash_attn_again, flashinfer_again
TPOT_FLOOR = 0.99  # the plugin's TPOT p50 gain (flat / plugin) at least this
TTFT_CEILING = 1.05  # the plugin's TTFT p99 over flat's at most this
SERVE_JSON = Path(__file__).resolve().parents[1] / "results" / "gpu" / "serve.json"


def _point(row: dict[str, Any]) -> tuple[str, str, str, str]:
    """Where a row was measured: its run, model, workload and rate point (a repeat, ``90%#2``,
    is a point of its own: its requests are not the first's)."""
    return (str(row.get("run_id")), model_of(row), str(row["workload"]),
            str(row.get("rate_spec") or rate_spec(row)))


def flat_of(plugin: str) -> str:
    """The flat config ``plugin`` is judged against (``configs.baseline``; ``flash_attn`` for a
    name the configs do not know)."""
    return baseline(plugin) if plugin in CONFIGS else FLAT


def judge(rows: list[dict[str, Any]], plugin: str = PLUGIN,
          run: str | None = None) -> list[dict[str, Any]]:
    """Per point that has flat and ``plugin`` rows in one run (``run``: that run only): the
    plugin's TPOT p50 gain (flat / plugin), TTFT p99 ratio (plugin / flat) and output
    throughput ratio; flat again's, where the run has it; and both verdicts (``spread``: None
    without flat again). Flat is the plugin config's own (``configs.baseline``: ``flash_attn``,
    or e.g. ``flash_attn_fp8`` for the FP8 pair); flat again is that flat config's repeat
    (``flash_attn_again``, ``flashinfer_again``) where the configs have one."""
    flat_config = flat_of(plugin)
    again_config = flat_config + AGAIN if flat_config + AGAIN in CONFIGS else None
    by_point: dict[tuple[str, str, str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row.get("config") in (flat_config, again_config, plugin) and row.get("completed", 1):
            if run is None or row.get("run_id") == run or row.get("run") == run:
                by_point.setdefault(_point(row), {})[row["config"]] = row
    out = []
    for (run_id, model, workload, spec), got in by_point.items():
        flat, on = got.get(flat_config), got.get(plugin)
        if flat is None or on is None:
            continue
        point: dict[str, Any] = {"plugin": plugin, "flat": flat_config,
                                 "run_id": run_id, "model": model, "workload": workload,
                                 "rate": spec, "gpu": on.get("gpu"),
                                 "rate_from_run": _rate_from_elsewhere(flat),
                                 **_ratios(flat, on, "")}
        point["target"] = _passes(point, "", TPOT_FLOOR, TTFT_CEILING)
        again = got.get(again_config) if again_config else None
        point["steps"] = {name: _steps(row) for name, row in
                          (("flat", flat), ("plugin", on), ("again", again))
                          if row is not None and row.get("gpu_step_ms_per_step") is not None}
        point["matched"] = _matched(flat, on, again)
        mixed = {name: _mixed(row) for name, row in
                 (("flat", flat), ("plugin", on), ("again", again)) if row is not None}
        point["mixed"] = {name: shown for name, shown in mixed.items() if shown is not None}
        engine = {name: _engine(row) for name, row in
                  (("flat", flat), ("plugin", on), ("again", again)) if row is not None}
        point["engine"] = {name: shown for name, shown in engine.items() if shown is not None}
        if again is None:
            point["spread"] = None
        else:
            point.update(_ratios(flat, again, "again_"))
            tpot_floor = min(TPOT_FLOOR, 1 - abs(1 - point["again_tpot_gain"]))
            ttft_ceiling = max(TTFT_CEILING, 1 + abs(1 - point["again_ttft_p99_ratio"]))
            point.update(tpot_floor=tpot_floor, ttft_ceiling=ttft_ceiling)
            point["spread"] = _passes(point, "", tpot_floor, ttft_ceiling)
        out.append(point)
    return out


def _rate_from_elsewhere(flat: dict[str, Any]) -> str | None:
    """The run whose flat burst set a relative rate point's rate, where it is not the row's own
    run (the rate may then sit elsewhere on this run's machine: near its capacity), else
    None."""
    source = flat.get("sustainable_rate_run")
    return source if source not in (None, flat.get("run_id")) else None


def _times(k: dict[str, Any], size: str = "rows") -> str:
    """GPU ms per step, then in brackets the GPU's wait for the host, where the probe timed them
    the host's ms preparing the step (``prep``) and launching it (``launch``), and the steps'
    ``size`` (``rows``: requests, ``tokens``: scheduled tokens) per step."""
    prep, launch = k.get("host_prep_ms_per_step"), k.get("host_run_ms_per_step")
    n = k.get(f"{size}_per_step")
    return (f"{k['gpu_step_ms_per_step']:.1f} ({k['gpu_wait_ms_per_step']:.2f}"
            + ("" if prep is None else f", prep {prep:.2f}")
            + ("" if launch is None else f", launch {launch:.2f}")
            + ("" if n is None else f", {n:.0f} {size}") + ")")


def _steps(row: dict[str, Any]) -> str:
    """A server's steps as the step-timeline probe saw them (:func:`_times`), in all and by
    kind of step where it told them apart."""
    kinds = row.get("timeline_by_kind") or {}
    return ", ".join([_times(row)] + [f"{kind} {k['steps']}x {_times(k)}"
                                      for kind, k in kinds.items()])


def _mixed(row: dict[str, Any]) -> str | None:
    """A server's mixed steps (a prefill in them: launched layer by layer, outside a FULL
    graph), where the probe told them apart: how many, and :func:`_times` with their tokens."""
    k = (row.get("timeline_by_phase") or {}).get("mixed")
    return None if k is None else f"{k['steps']}x {_times(k, 'tokens')}"


def _engine(row: dict[str, Any]) -> str | None:
    """A server's prefix-cache hits and preemptions over the run (vLLM's counters), where the
    row has them: two servers that scheduled different work for the same requests."""
    queries, hits = row.get("vllm_prefix_cache_queries"), row.get("vllm_prefix_cache_hits")
    if not queries or hits is None:
        return None
    return (f"prefix cache {hits / queries:.1%} of {queries:.0f} tokens, "
            f"{row.get('vllm_preemptions') or 0:.0f} preempted")


def _matched(flat: dict[str, Any], on: dict[str, Any],
             again: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Decode steps' GPU ms against flat's at equal requests per step (the probe's
    ``decode_by_rows``; ``metrics.matched_decode``): the plugin's flat and cascade steps, and
    flat again's (how far two flat servers are apart the same way)."""
    got = {"plugin's flat": matched_decode(on, "flat", flat),
           "cascade": matched_decode(on, "cascade", flat),
           "again": None if again is None else matched_decode(again, "flat", flat)}
    return {name: m for name, m in got.items() if m is not None}


def _ratios(flat: dict[str, Any], other: dict[str, Any], prefix: str) -> dict[str, float]:
    return {f"{prefix}tpot_gain": flat["tpot_ms_p50"] / other["tpot_ms_p50"],
            f"{prefix}ttft_p99_ratio": other["ttft_ms_p99"] / flat["ttft_ms_p99"],
            f"{prefix}output_ratio": other["output_tok_per_s"] / flat["output_tok_per_s"]}


def _passes(point: dict[str, Any], prefix: str, tpot_floor: float, ttft_ceiling: float) -> bool:
    return bool(point[f"{prefix}tpot_gain"] >= tpot_floor
                and point[f"{prefix}ttft_p99_ratio"] <= ttft_ceiling)


def table(points: list[dict[str, Any]]) -> str:
    """The verdicts, a line per point."""
    def verdict(ok: bool | None) -> str:
        return "-" if ok is None else ("pass" if ok else "FAIL")
    lines = [f"{'run':<16} {'workload':<22} {'rate':<7} {'TPOT gain':>9} {'TTFT p99':>8} "
             f"{'output':>6} | {'again TPOT':>10} {'TTFT':>5} | target spread"]
    for p in points:
        again = (f"{p['again_tpot_gain']:>10.3f} {p['again_ttft_p99_ratio']:>5.2f}"
                 if p["spread"] is not None else f"{'':>10} {'':>5}")
        lines.append(f"{p['run_id']:<16} {p['workload']:<22} {p['rate']:<7} "
                     f"{p['tpot_gain']:>9.3f} {p['ttft_p99_ratio']:>8.2f} "
                     f"{p['output_ratio']:>6.2f} | {again} | {verdict(p['target']):<6} "
                     f"{verdict(p['spread'])}")
        if p.get("rate_from_run"):
            lines[-1] += f"  (rate from run {p['rate_from_run']}'s flat burst)"
        if p.get("steps"):  # the step-timeline probe's: GPU ms per step (waiting for the host)
            lines.append("    GPU ms per step (host wait): " + "; ".join(
                f"{name} {shown}" for name, shown in p["steps"].items()))
        if p.get("mixed"):  # the steps with a prefill, each server's
            lines.append("    mixed steps, GPU ms (host wait): " + "; ".join(
                f"{name} {shown}" for name, shown in p["mixed"].items()))
        if p.get("engine"):  # the work each server scheduled for the same requests
            lines.append("    engine: " + "; ".join(
                f"{name} {shown}" for name, shown in p["engine"].items()))
        if p.get("matched"):  # decode steps against flat's at the same batch sizes
            lines.append("    decode GPU ms at equal requests, over flat's: " + ", ".join(
                f"{name} {m['ratio']:.3f} ({m['steps']} steps, {m['sizes']} sizes)"
                for name, m in p["matched"].items()))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", type=Path, default=SERVE_JSON)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--run", help="one run (its run_id or run)")
    which.add_argument("--latest", action="store_true",
                       help="the run of the file's last row (what a slice just wrote)")
    p.add_argument("--plugin", default=None,
                   help="the plugin's config (default: every plugin config with rows in the "
                        "run, each against its own flat config; cascade_flash_attn where none)")
    p.add_argument("--json", action="store_true", help="the points as JSON")
    args = p.parse_args()
    rows = json.loads(args.file.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    run = rows[-1].get("run_id") if args.latest and rows else args.run
    plugins = [args.plugin] if args.plugin else sorted(
        {r["config"] for r in rows if (run is None or run in (r.get("run_id"), r.get("run")))
         and r.get("config") in CONFIGS and CONFIGS[r["config"]].plugin_on}) or [PLUGIN]
    judged = {plugin: judge(rows, plugin, run) for plugin in plugins}
    if args.json:
        print(json.dumps([p for plugin in plugins for p in judged[plugin]], indent=1))
        return
    for plugin in plugins:
        print(f"# {plugin} against {flat_of(plugin)}, run {run or 'every run'} of {args.file}")
        print(table(judged[plugin]))


if __name__ == "__main__":
    main()
