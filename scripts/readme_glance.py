"""README.md's first screen: what the plugin gains per kind of traffic under ``vllm serve``, what
it costs (GPU memory of its CUDA graphs, host time per step), how close its outputs stay to
flat attention's, and the short serving summary. Rendered by ``readme_tables.py`` (blocks
``glance``, ``costs``, ``exactness``, ``serve_summary``) from ``benchmarks/results/gpu/``:
``serve.json`` (each plugin row against the flat row of its own run), ``gpu_validate.json`` and
the engine check's rows beside it, ``soak.json``."""

from __future__ import annotations

import sys
from decimal import ROUND_CEILING, ROUND_FLOOR, ROUND_HALF_UP, Decimal
from typing import Any

from readme_common import DASH, GPU, ROOT, TIMES, _load, _source, _table, served_rows

sys.path.insert(0, str(ROOT))  # the serve bench's pairing of its rows (benchmarks.serve)
from benchmarks.serve.pairs import ratios, serve_runs

FLAT, PLUGIN = "flash_attn", "cascade_flash_attn"  # vLLM's default backend, flat and the plugin
PLUGINS = ("cascade_flash_attn", "cascade")  # the plugin as shipped, on FLASH_ATTN and FLASHINFER
HOST_DELAY = "cascade_flash_attn_host_delay_1ms"  # the same with 1 ms of host time added a step
# Kinds of traffic of the first screen: what each is, and serve.json's workloads of that kind.
TRAFFIC = (
    ("long shared prefixes: one 32K-token or four 8K-token documents, many requests behind each",
     ("prefix_32k_x1", "prefix_8k_x4")),
    ("16 shared documents of 2K tokens", ("prefix_2k_x16",)),
    ("a short shared system prompt (chat: 1K or 1.5K tokens shared, 0.3-1K own)",
     ("chat_1k5_system", "chat_1k_prefill_heavy")),
    ("no sharing (random 2K-token prompts)", ("random_2k",)),
)
SUMMARY_WORKLOADS = {  # the short serving summary's rows: workload -> what it is
    "prefix_32k_x1": "one 32K-token document", "prefix_8k_x4": "4 documents of 8K tokens",
    "prefix_2k_x16": "16 documents of 2K tokens", "chat_1k5_system": "chat, 1.5K system prompt",
    "chat_1k_prefill_heavy": "prefill-heavy chat, 1K system prompt",
    "random_2k": "no sharing, 2K random prompts"}
ENGINE_CHECK = "engine_flash_attn"  # gpu_validate.sh's part: plugin on vs off vs a second kernel
ENGINE_ROWS = GPU / "gpu_validate" / ENGINE_CHECK / "correctness_flash_attn.json"


def _serve_rows() -> list[dict[str, Any]]:
    path = GPU / "serve.json"
    return served_rows(path) if path.is_file() else []


def gpu_name(row: dict[str, Any]) -> str:
    """The row's GPU, short: ``NVIDIA H100 80GB HBM3`` -> ``H100``."""
    return (row.get("gpu") or "GPU not recorded").split(" (")[0].removeprefix("NVIDIA ").split()[0]


def rounded_range(values: list[float]) -> str:
    """The range of ``values`` rounded outwards (so that it holds every value): two decimals
    where it stays below 2 (0.95 and 1.05 differ), else one; one value (or a range whose ends
    round alike) rounded half up; "not measured" for none."""
    if not values:
        return "not measured"
    step = Decimal("0.01") if max(values) < 2 else Decimal("0.1")
    low, high = (Decimal(repr(x)) for x in (min(values), max(values)))
    one = low.quantize(step, rounding=ROUND_HALF_UP)
    if one == high.quantize(step, rounding=ROUND_HALF_UP) and (high - low) < step:
        return f"{one}{TIMES}"
    return (f"{low.quantize(step, rounding=ROUND_FLOOR)}{DASH}"
            f"{high.quantize(step, rounding=ROUND_CEILING)}{TIMES}")


def _gains(rows: list[dict[str, Any]], workloads: tuple[str, ...], spec: str, key: str,
           lower_is_better: bool) -> tuple[list[float], set[str]]:
    """Every run's gain at ``spec`` over ``workloads`` (vLLM's default backend), and its GPUs."""
    found: list[float] = []
    gpus: set[str] = set()
    for workload in workloads:
        runs = serve_runs(rows, FLAT, PLUGIN, workload).get(spec, [])
        found += ratios(runs, key, lower_is_better)
        gpus.update(gpu_name(r) for pair in runs for r in pair)
    return found, gpus


def block_glance() -> list[str]:
    """Per kind of traffic: served TPOT p50 flat ÷ plugin at 90% and 50% of flat's burst rate,
    a burst's output tokens/s plugin ÷ flat; each the range over every run, and the GPUs."""
    rows = _serve_rows()
    if not rows:
        return ["Served figures: not measured yet (`benchmarks/serve/bench.py` writes "
                "`benchmarks/results/gpu/serve.json`)."]
    body = []
    for what, workloads in TRAFFIC:
        busy, g1 = _gains(rows, workloads, "90%", "tpot_ms_p50", True)
        half, g2 = _gains(rows, workloads, "50%", "tpot_ms_p50", True)
        burst, g3 = _gains(rows, workloads, "burst", "output_tok_per_s", False)
        runs = len(busy) + len(half) + len(burst)
        body.append([what, rounded_range(busy), rounded_range(half), rounded_range(burst),
                     f"{', '.join(sorted(g1 | g2 | g3)) or DASH}, {runs} run{'s' * (runs != 1)}"])
    return [f"`vllm serve`, vLLM's default backend (`FLASH_ATTN`) with the plugin against it flat, "
            f"Llama-3-8B shapes; ranges over every run, each against its own flat server "
            f"({_source(GPU / 'serve.json')}):", "",
            *_table(["your traffic", "TPOT p50, times lower: busy (90% of flat's max rate)",
                     "half that load", "a burst's output tokens/s, times flat's", "GPU, runs"],
                    body)]


def block_costs() -> list[str]:
    """GPU memory the plugin's CUDA-graph pools held and its host time per step under
    ``vllm serve``, and what 1 ms more host time per step did to TPOT (serve.json)."""
    rows = [r for r in _serve_rows() if r["config"] in PLUGINS and r.get("completed", 1)]
    pools = [r["graph_pool_bytes"] / 2**30 for r in rows if r.get("graph_pool_bytes")]
    if not pools:
        return ["GPU memory and host time under `vllm serve`: not measured yet."]
    gpus = ", ".join(sorted({gpu_name(r) for r in rows if r.get("graph_pool_bytes")}))
    host = [r["host_us_per_step"] / 1000 for r in rows if r.get("host_us_per_step")
            and r["config"] == PLUGIN and str(r.get("rate_spec")).startswith("90%")]
    delay = _serve_rows()
    moved = []
    for workload in dict.fromkeys(r["workload"] for r in delay):
        for spec, runs in serve_runs(delay, PLUGIN, HOST_DELAY, workload).items():
            if spec != "burst":
                moved += [c["tpot_ms_p50"] - p["tpot_ms_p50"] for p, c in runs
                          if p.get("run_id") == c.get("run_id")]
    line = (f"**Costs**, measured under `vllm serve` ({_source(GPU / 'serve.json')}, {gpus}, "
            f"Llama-3-8B shapes): the plugin's CUDA graphs held {min(pools):.2f}{DASH}"
            f"{max(pools):.2f} GiB of GPU memory, taken from the headroom vLLM leaves under "
            f"`--gpu-memory-utilization` (none where nothing is shared); its scratch buffers at "
            f"these shapes are not measured. Host time: {min(host):.1f}{DASH}{max(host):.1f} ms "
            f"per step at 90% load (planning, metadata, graph captures), mostly hidden by vLLM's "
            f"asynchronous scheduling")
    if moved:
        line += (f": 1 ms of host time added to every step moved TPOT p50 by "
                 f"{min(moved):+.1f} to {max(moved):+.1f} ms")
    return [line + "."]


def block_exactness() -> list[str]:
    """Plugin on vs off against two correct kernels (gpu_validate's engine check on
    ``FLASH_ATTN``), and the soak's greedy subset replayed without the plugin."""
    rows = [r for r in _load(ENGINE_ROWS) if "corrupt" not in r["workload"]
            and r.get("reference_max_abs_dlogprob") is not None and r["cascade_step_fraction"]]
    parts = {p["part"]: p for p in _load(GPU / "gpu_validate.json")}
    check = parts.get(ENGINE_CHECK, {})
    where = f"{(check.get('gpu') or 'GPU not recorded').split(' (')[0]}, {check.get('date', '')}"

    def spread(key: str) -> str:
        values = [r[key] for r in rows]
        return f"{min(values):.3f}{DASH}{max(values):.3f}"

    def share(key: str) -> str:
        values = [100 * r[key] for r in rows]
        return f"{min(values):.0f}{DASH}{max(values):.0f}%"

    soak = _load(GPU / "soak.json")
    workloads = len({r["workload"].split(" (")[0] for r in rows})
    return [f"Measured ({_source(ENGINE_ROWS)}, {where}; {len(rows)} runs of {workloads} "
            f"workloads with cascade on, "
            f"greedy, chosen-token logprobs): plugin vs flat FlashAttention, largest "
            f"\\|Δ logprob\\| per workload {spread('max_abs_dlogprob')}, mean "
            f"{spread('mean_abs_dlogprob')}; two correct kernels (flat FlashInfer vs flat "
            f"FlashAttention) on the same workloads {spread('reference_max_abs_dlogprob')}, mean "
            f"{spread('reference_mean_abs_dlogprob')}. Greedy text: positions compared before a "
            f"completion's first differing token (where both runs' top-2 margin exceeds 0.1), "
            f"plugin vs flat {share('compared_fraction')}, the two kernels "
            f"{share('reference_compared_fraction')}. In the soak ({_source(GPU / 'soak.json')}) "
            f"{soak['subset_identical']} of {soak['subset_compared']} greedy requests replayed "
            f"without the plugin gave identical text."]


def block_serve_summary() -> list[str]:
    """The shipped plugin on vLLM's default backend against it flat, per workload and rate: the
    latest run's TPOT p50, output tokens/s and TTFT p99 ratios, the range over its runs."""
    rows = _serve_rows()
    body = []
    for workload, what in SUMMARY_WORKLOADS.items():
        for spec, runs in serve_runs(rows, FLAT, PLUGIN, workload).items():
            f, c = runs[-1]
            rate = "burst" if spec == "burst" else f"{spec} ({f['request_rate']} req/s)"

            def cell(key: str, lower: bool, digits: int, runs: list[Any] = runs,
                     f: dict[str, Any] = f, c: dict[str, Any] = c) -> str:
                gains = ratios(runs, key, lower)
                shown = f"{f[key]:,.{digits}f} → {c[key]:,.{digits}f}"
                return f"{shown} ({rounded_range(gains)})" if gains else shown

            body.append([what, rate, cell("tpot_ms_p50", True, 1),
                         cell("output_tok_per_s", False, 0), cell("ttft_ms_p99", True, 0),
                         f"{gpu_name(f)}, {len(runs)}"])
    return [f"Flat → plugin in the latest run; in brackets the plugin's gain over every run, each "
            f"against its own flat server, above 1 better (flat ÷ plugin for latencies, plugin ÷ "
            f"flat for output); vLLM's `FLASH_ATTN` backend, the plugin's defaults "
            f"({_source(GPU / 'serve.json')}):", "",
            *_table(["workload", "load", "TPOT p50 ms", "output tokens/s", "TTFT p99 ms",
                     "GPU, runs"], body)]
