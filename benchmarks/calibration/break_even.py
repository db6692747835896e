"""Where the cost model lets a decode step run as cascade: its cascade ÷ flat estimate, per
served model family, at batches of 8 to 256 requests of a served workload, with the plugin's
whole-step CUDA graphs (an engine of one KV-cache group: Llama) and with per-layer graphs only
(what every engine of several groups gets: Gemma 3, gpt-oss, Mamba hybrids), and the smallest
batch at which it picks cascade under each. What the FLASH_ATTN backend decides on a graphed
decode step (``flash_attn_flat(cost_model_for("fa3", ...))``, its steady cost model), on plans
of the workload's rows: the prompt's shared pages, then each request's own prompt (spread over
the workload's range) and a decode position spread over its output. A model's prediction, not
a measurement: ``serve.json``'s hybrid rows say what serving measured.

    PYTHONPATH=src python3 -m benchmarks.calibration.break_even [--workload chat_6k_system]
        [--out benchmarks/results/cpu]
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS
from benchmarks.serve import expected
from benchmarks.serve import workloads as sw
from vllm_cascade_plugin.planning.cost import (
    AttentionShape,
    CostModel,
    cost_model_for,
    decide,
    flash_attn_flat,
)
from vllm_cascade_plugin.planning.planner import plan_cascade

BATCHES = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
GRAPHS = {"whole-step graphs": flash_attn_flat(cost_model_for("fa3")),
          "per-layer graphs": flash_attn_flat(cost_model_for("fa3", full_graphs=False))}


def shape_of(folder: Path) -> AttentionShape:
    """The attention shape the plugin plans a model's full-attention layers with."""
    config = json.loads((folder / "config.json").read_text())
    text = expected._text(config)
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    full = expected.model_of(folder).full_layers
    return AttentionShape(heads, int(text["num_key_value_heads"]), head_dim,
                          expected.DTYPE_BYTES, num_layers=full)


def decode_rows(w: sw.Workload, batch: int, page: int,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A decode step of ``batch`` requests of ``w``: its block table (the shared prompt's whole
    pages first in every row, then each row's own) and sequence lengths."""
    shared = w.prefix_len // page * page
    low, high = int(w.suffix_len * (1 - w.range_ratio)), int(w.suffix_len * (1 + w.range_ratio))
    seq = (w.prefix_len + rng.integers(low, high + 1, batch)
           + rng.integers(1, w.output_len + 1, batch)).astype(np.int32)
    pages = -(-seq // page)
    table = np.zeros((batch, int(pages.max())), np.int32)
    table[:, :shared // page] = np.arange(1, shared // page + 1)
    start = 1 + shared // page
    for row in range(batch):
        own = int(pages[row]) - shared // page
        table[row, shared // page:int(pages[row])] = np.arange(start, start + own)
        start += own
    return table, seq


def decode_plan(w: sw.Workload, batch: int, page: int, rng: np.random.Generator) -> Any:
    """The plan of :func:`decode_rows`' step (one group: the shared prompt)."""
    table, seq = decode_rows(w, batch, page, rng)
    return plan_cascade(table, seq, np.ones(batch, np.int32), page)


def family(folder: Path, w: sw.Workload, batches: tuple[int, ...] = BATCHES,
           models: dict[str, CostModel] = GRAPHS) -> dict[str, Any]:
    """One family's row: cascade ÷ flat per batch and the break-even batch, per graph kind."""
    shape, page = shape_of(folder), expected.model_of(folder).page
    plans = {b: decode_plan(w, b, page, np.random.default_rng(b)) for b in batches}
    row: dict[str, Any] = {"model": folder.name, "planned_layers": shape.num_layers,
                           "heads": [shape.num_qo_heads, shape.num_kv_heads, shape.head_dim],
                           "page": page}
    for name, model in models.items():
        decisions = {b: decide(plans[b], shape, model) for b in batches}
        row[name] = {"cascade_over_flat": {str(b): round(d.cascade_us / d.flat_us, 3)
                                           for b, d in decisions.items()},
                     "break_even_batch": next(
                         (b for b in batches if decisions[b].use_cascade), None)}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="chat_6k_system",
                        choices=sorted(n for n, w in sw.WORKLOADS.items() if w.kind == "chat"))
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu")
    args = parser.parse_args(argv)
    w = sw.WORKLOADS[args.workload]
    rows = [family(expected.MODELS / name, w) for name in expected.FAMILIES]
    for row in rows:
        print(row["model"], {g: row[g]["break_even_batch"] for g in GRAPHS})
    result = {"date": datetime.date.today().isoformat(), "workload": args.workload,
              "what": __doc__.split("\n\n")[0].replace("\n", " "),
              "command": "PYTHONPATH=src python3 -m benchmarks.calibration.break_even"
                         f" --workload {args.workload}", "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "break_even.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
