"""The kernel benchmark's verdicts (``kernels/bench.py``): the plugin's flat/cascade choice per row,
the ratios, the issue's four targets and the summary table. No GPU.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from benchmarks.kernels.grid import (
    DTYPE_BYTES,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    NUM_QO_HEADS,
    TOLERANCE,
)


def _ms(row: dict[str, Any], method: str) -> float | None:
    value = (row.get("ms") or {}).get(method)
    return float(value) if isinstance(value, (int, float)) else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def row_ratios(row: dict[str, Any]) -> dict[str, float | None]:
    plugin = _ms(row, "plugin")
    return {
        "fi_decode/plugin": _ratio(_ms(row, "fi_decode"), plugin),
        "fa3_cascade/plugin": _ratio(_ms(row, "fa3_cascade"), plugin),
        "plugin/floor": _ratio(plugin, row.get("floor_ms")),
    }


def row_label(row: dict[str, Any]) -> str:
    return f"B={row['B']} P={row['P']} G={row['groups']}"


def evaluate_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's four targets on ``rows``; ``pass`` is None where no row is eligible.

    A row whose numbers are missing (a method failed) fails the target it is eligible for.
    """

    def each(name: str, rule: str, eligible: Callable[[dict], bool],
             value: Callable[[dict], float | None], ok: Callable[[float], bool],
             worst: Callable[[Iterable[float]], float], threshold: float) -> dict[str, Any]:
        chosen = [r for r in rows if eligible(r)]
        values = {row_label(r): value(r) for r in chosen}
        missing = [k for k, v in values.items() if v is None]
        present = {k: v for k, v in values.items() if v is not None}
        failing = [k for k, v in present.items() if not ok(v)]
        return {"name": name, "rule": rule, "rows": list(values), "threshold": threshold,
                "value": worst(present.values()) if present else None,
                "failing": failing, "missing": missing,
                "pass": None if not chosen else not failing and not missing}

    def both(r: dict, a: str, b: str) -> tuple[float, float] | None:
        x, y = _ms(r, a), _ms(r, b)
        return None if x is None or y is None else (x, y)

    targets = [
        each("plugin_never_slower", "plugin <= fi_decode on every row (value: worst "
             "plugin/fi_decode)", lambda r: True,
             lambda r: (lambda p: p and p[0] / p[1])(both(r, "plugin", "fi_decode")),
             lambda v: v <= 1.0, max, 1.0),
    ]
    eligible2 = [r for r in rows if r["groups"] == 1 and r["B"] * r["P"] >= 262144]
    speedups = [row_ratios(r)["fi_decode/plugin"] for r in eligible2]
    missing2 = [row_label(r) for r, s in zip(eligible2, speedups, strict=True) if s is None]
    present2 = [s for s in speedups if s is not None and s > 0]
    geomean = math.exp(statistics.fmean(math.log(s) for s in present2)) if present2 else None
    targets.append({
        "name": "geomean_speedup_vs_fi_decode",
        "rule": "geomean(fi_decode/plugin) >= 3 over single-group rows with B*P >= 262144",
        "rows": [row_label(r) for r in eligible2], "threshold": 3.0, "value": geomean,
        "failing": [] if geomean is None or geomean >= 3.0 else ["geomean"],
        "missing": missing2,
        "pass": None if not eligible2 else (geomean is not None and geomean >= 3.0
                                            and not missing2),
    })
    targets.append(each(
        "beats_fa3_cascade", "plugin <= fa3_cascade / 1.3 for B >= 64 and P >= 8192 (value: "
        "smallest fa3_cascade/plugin)", lambda r: r["B"] >= 64 and r["P"] >= 8192,
        lambda r: (lambda p: p and p[1] / p[0])(both(r, "plugin", "fa3_cascade")),
        lambda v: v >= 1.3, min, 1.3))
    targets.append(each(
        "near_floor", "plugin <= 3 * floor for B*P >= 2,000,000 (value: largest plugin/floor)",
        lambda r: r["B"] * r["P"] >= 2_000_000,
        lambda r: row_ratios(r)["plugin/floor"], lambda v: v <= 3.0, max, 3.0))
    return targets


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def summary_lines(rows: Sequence[dict[str, Any]], targets: Sequence[dict[str, Any]]) -> list[str]:
    """The compact table printed at the end: ms per method, ratios, targets, correctness."""
    head = (f"{'B':>4} {'P':>6} {'G':>3} | {'plugin':>13} {'fi_dec':>7} {'fi_casc':>7} "
            f"{'fa3_dec':>7} {'fa3_casc':>8} {'floor':>7} | {'fi/pl':>6} {'fa3c/pl':>7} "
            f"{'pl/floor':>8} | {'plan_us':>7} ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratios = row_ratios(r)
        choice = {"cascade": "c", "flat": "f"}.get(r.get("plugin_choice") or "", "?")
        lines.append(
            f"{r['B']:>4} {r['P']:>6} {r['groups']:>3} | {fmt(_ms(r, 'plugin')):>11} {choice}"
            f" {fmt(_ms(r, 'fi_decode')):>7} {fmt(_ms(r, 'fi_cascade')):>7}"
            f" {fmt(_ms(r, 'fa3_decode')):>7} {fmt(_ms(r, 'fa3_cascade')):>8}"
            f" {fmt(r.get('floor_ms'), '.4f'):>7} | {fmt(ratios['fi_decode/plugin'], '.2f'):>6}"
            f" {fmt(ratios['fa3_cascade/plugin'], '.2f'):>7}"
            f" {fmt(ratios['plugin/floor'], '.1f'):>8} | {fmt(r.get('plan_us'), '.0f'):>7}"
            f" {'yes' if r.get('ok') else 'NO'}")
    lines.append("ms per layer call (median GPU time); plugin: c = cascade, f = flat (fi_decode)")
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["pass"]]
        extra = ""
        if t["failing"]:
            extra += f"; failing: {', '.join(t['failing'])}"
        if t["missing"]:
            extra += f"; missing data: {', '.join(t['missing'])}"
        lines.append(f"target {verdict:<4} {t['rule']}: value {fmt(t['value'], '.3g')}{extra}")
    bad = [r for r in rows if not r.get("ok")]
    if bad:
        lines.append(f"!!! CORRECTNESS/ERRORS in {len(bad)} row(s): numbers of those rows are "
                     "not trustworthy")
        lines += [f"!!!   {row_label(r)}: {'; '.join(r.get('errors', []))}" for r in bad]
    else:
        lines.append(f"correctness: all {len(rows)} rows agree with fi_decode within {TOLERANCE}")
    return lines



def record_choice(row: dict[str, Any], plan: Any, kernel: str) -> str:
    """The plugin's flat/cascade choice for ``plan`` as the step session makes it (policy auto, the
    shipped model of ``kernel``'s executor, Llama-3-8B's layers), written into ``row``."""
    from vllm_cascade_plugin.planning.cost import COST_MODELS, AttentionShape, decide

    shape = AttentionShape(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE_BYTES,
                           num_layers=NUM_LAYERS)
    decision = decide(plan, shape, COST_MODELS[kernel])
    choice = "cascade" if plan.num_levels >= 2 and decision.use_cascade else "flat"
    row["plugin_choice"] = choice
    row["cost_model"] = {"flat_us": decision.flat_us, "cascade_us": decision.cascade_us,
                         "reason": decision.reason}
    return choice
