"""How many CUDA-graph layouts a serving-like decode run needs: each new layout is a whole-step
graph captured (its first step not replayed), so ``1 - layouts / decode steps`` is the most of a
run's cascade decode steps its graphs can replay. numpy only, no GPU.

Requests arrive a Poisson number per step, each with one of a few shared documents and its own
tokens, prefill in the step they arrive and then decode until their output length; a step
without arrivals is a pure decode step, planned (``CascadePlanner``) and keyed as the executor
keys it (``graph_layout.graph_shape`` at vLLM's padded size, plus the addresses of the scratch
buffers, which move when they grow: ``graph_layout.buffer_elements``, as ``Scratch.take``
allocates them: each at once for vLLM's largest capture size, as the FA3 executor does).

    PYTHONPATH=src python benchmarks/graph_layout_count.py [--out benchmarks/results/cpu]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench_common import commit
from vllm_cascade_plugin.planning import graph_layout
from vllm_cascade_plugin.planning.planner import CascadePlanner

PAGE = 16
# vLLM 0.26's CUDA-graph capture sizes for max_num_seqs 512: 1, 2, 4, then every 8.
CAPTURE_SIZES = [1, 2, 4, *range(8, 1025, 8)]
MAX_LEVELS = 3  # CASCADE_MAX_LEVELS's default


@dataclass(frozen=True)
class Run:
    name: str
    requests: int
    documents: int
    document_pages: int
    own_tokens: int
    output_tokens: tuple[int, int]  # drawn uniformly from [low, high)
    arrivals_per_step: float = 2.0


RUNS = (
    # tests/gpu/serving_driver.py's mix: four 1K-token prefixes, 8-48 output tokens.
    Run("serving test (4 x 1K prefixes)", 1000, 4, 64, 16, (8, 49)),
    Run("4 x 8K documents", 1000, 4, 512, 64, (64, 256)),
    Run("1 x 32K document", 400, 1, 2048, 64, (64, 256), arrivals_per_step=1.0),
)


def count(run: Run, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    arrivals: list[tuple[int, int, int]] = []
    step = 0
    while len(arrivals) < run.requests:
        arrivals += [(step, int(rng.integers(run.documents)), int(rng.integers(*run.output_tokens)))
                     for _ in range(int(rng.poisson(run.arrivals_per_step)))]
        step += 1
    arrivals = arrivals[: run.requests]
    planner, next_page = CascadePlanner(), 1 + run.documents * run.document_pages
    live: list[list] = []  # [pages, sequence length, tokens still to decode]
    sizes: dict[str, int] = {}  # scratch buffer -> elements allocated
    largest = CAPTURE_SIZES[-1]  # FA3 executor: buffers sized for it at once (graph_rows)
    reserve = {"rows": largest, "static32": graph_layout.STATIC32_RESERVE,
               "static64": largest * MAX_LEVELS}
    shapes: set = set()
    keys: set = set()
    padded_sizes: set = set()
    decode_steps = step = i = 0
    while i < len(arrivals) or live:
        new = []
        while i < len(arrivals) and arrivals[i][0] <= step:
            _, doc, out = arrivals[i]
            i += 1
            own = -(-run.own_tokens // PAGE)
            pages = [*range(1 + doc * run.document_pages, 1 + (doc + 1) * run.document_pages),
                     *range(next_page, next_page + own)]
            next_page += own
            new.append([pages, run.document_pages * PAGE + run.own_tokens, out - 1])
        if live and not new:
            decode_steps += 1
            table = np.zeros((len(live), max(len(r[0]) for r in live)), np.int32)
            for row, r in enumerate(live):
                table[row, : len(r[0])] = r[0]
            plan = planner.plan(table, np.array([r[1] for r in live], np.int32),
                                np.ones(len(live), np.int32), PAGE)
            if plan.num_levels >= 2:
                padded = next(s for s in CAPTURE_SIZES if s >= len(live))
                padded_sizes.add(padded)
                levels = graph_layout.layout(plan, padded)
                want = {"rows": max(level.rows for level in levels[:-1]),
                        "static32": sum(level.cu_q.size + level.kv_lens.size + level.table.size
                                        for level in levels),
                        "static64": sum(0 if level.index is None else level.index.size
                                        for level in levels)}
                for name, numel in want.items():
                    if numel > sizes.get(name, 0):
                        sizes[name] = max(graph_layout.buffer_elements(numel), reserve[name])
                shape = graph_layout.graph_shape(plan, padded)
                shapes.add(shape)
                keys.add((shape, tuple(sorted(sizes.items()))))
        for r in live:  # every running request decodes one token
            r[1] += 1
            r[2] -= 1
            if r[1] > len(r[0]) * PAGE:
                r[0].append(next_page)
                next_page += 1
        live = [r for r in live if r[2] > 0] + [r for r in new if r[2] > 0]
        step += 1
    return {"steps": step, "decode_steps": decode_steps, "padded_sizes": len(padded_sizes),
            "shapes": len(shapes), "layouts": len(keys),
            "replayable_at_most": round(1 - len(keys) / max(decode_steps, 1), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write graph_layouts.json here")
    args = parser.parse_args()
    rows = [{**asdict(run), **count(run)} for run in RUNS]
    for row in rows:
        print(f"{row['name']:32s} decode steps {row['decode_steps']:4d}  padded sizes "
              f"{row['padded_sizes']:3d}  shapes {row['shapes']:3d}  layouts {row['layouts']:3d}"
              f"  replayable at most {row['replayable_at_most']:.1%}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": f"{platform.machine()}/{platform.python_version()}",
                "numpy": np.__version__, "command": " ".join(["python", *sys.argv]),
                "commit": commit()}
        (args.out / "graph_layouts.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                                 indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
