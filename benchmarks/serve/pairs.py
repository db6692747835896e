"""Which flat row each plugin row of a serving results file is measured against, and the
plugin-over-flat ratios read from those pairs (the plot here, the README's figures in
``scripts/readme_serve.py`` and ``scripts/readme_glance.py``). Standard library only."""

from __future__ import annotations

from typing import Any

BURST = "burst"
# The model a row served, by its folder's name (``serve/bench.py --model``); rows written before
# rows named their model served Llama-3-8B's shapes (examples/models/llama3-8b).
DEFAULT_MODEL = "llama3-8b"


def model_of(row: dict[str, Any]) -> str:
    """The model folder's name a row served (:data:`DEFAULT_MODEL` for a row without one)."""
    return str(row.get("model") or DEFAULT_MODEL)


def rate_spec(row: dict[str, Any]) -> str:
    """A row's rate point: ``"burst"``, ``"90%"``, or its req/s; a repeat at the same rate
    (``"90%#2"``, ``serve/bench.py``'s ``"90%*2"``) is another run of the same point."""
    return str(row.get("rate_spec") or row["request_rate"]).partition("#")[0]


def _rate_key(row: dict[str, Any]) -> tuple[int, float, str]:
    rate = row["request_rate"]
    return (0, 0.0, rate_spec(row)) if rate == BURST else (1, float(rate), rate_spec(row))


def serve_runs(rows: list[dict[str, Any]], flat_config: str, plugin_config: str, workload: str,
               tp: int = 1, model: str = DEFAULT_MODEL,
               ) -> dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Per rate point (in rate order), every run's (flat row, plugin row) of ``workload`` served
    with ``model`` (:func:`model_of`), in file order: each plugin row with the flat row of its
    own run, else the latest flat row before it in the file (the one it was measured against),
    else the first after it. A run whose every request failed measured nothing and is left
    out."""
    def of(config: str) -> dict[str, list[tuple[int, dict[str, Any]]]]:
        out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for i, r in enumerate(rows):
            if (r["workload"] == workload and r["config"] == config and model_of(r) == model
                    and r.get("tensor_parallel_size", 1) == tp and r.get("completed", 1)):
                out.setdefault(rate_spec(r), []).append((i, r))
        return out
    flat, on = of(flat_config), of(plugin_config)
    runs = {}
    for spec in sorted(set(flat) & set(on), key=lambda s: _rate_key(flat[s][-1][1])):
        runs[spec] = []
        for at, c in on[spec]:
            same = [f for _, f in flat[spec] if f.get("run_id") == c.get("run_id")]
            same = [f for f in same if f.get("rate_spec") == c.get("rate_spec")] or same
            before = [f for i, f in flat[spec] if i < at]
            runs[spec].append(((same or before or [flat[spec][0][1]])[-1], c))
    return runs


def ratios(runs: list[tuple[dict[str, Any], dict[str, Any]]], key: str,
           lower_is_better: bool = False) -> list[float]:
    """Each run's plugin over flat on ``key``, as a gain (above 1: the plugin better): flat ÷
    plugin where lower is better (latencies), plugin ÷ flat otherwise (throughput)."""
    out = []
    for flat, plugin in runs:
        a, b = flat.get(key), plugin.get(key)
        if a and b:
            out.append(a / b if lower_is_better else b / a)
    return out
