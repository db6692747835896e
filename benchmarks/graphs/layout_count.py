"""How many CUDA-graph layouts a serving-like decode run needs: each new layout is a whole-step
graph captured (its first step not replayed), so ``1 - layouts / decode steps`` is the most of a
run's cascade decode steps its graphs can replay; and how many whole-step graphs it captures
when a runner holds at most ``MAX_GRAPHS`` of them (``graphs.fullgraph``: the least recently
replayed evicted), each capture a stall of the engine. Both as the executor lays steps out (each
layout's per-request table as wide as the widest it has had: ``graph_layout.LayoutBook``) and,
for comparison, with every step's table only as wide as its own rows need (``_exact`` columns).
numpy only, no GPU.

Requests arrive a Poisson number per step, each with one of a few shared documents and its own
tokens, prefill in the step they arrive and then decode until their output length; a step
without arrivals is a pure decode step, planned (``CascadePlanner``) and keyed as the executor
keys it (``graph_layout.graph_shape`` at vLLM's padded size, plus the addresses of the scratch
buffers, which move when they grow: ``graph_layout.buffer_elements``, as ``Scratch.take``
allocates them: each at once for vLLM's largest capture size, as the FA3 executor does).

    PYTHONPATH=src python3 -m benchmarks.graphs.layout_count [--out benchmarks/results/cpu]
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

from benchmarks.common import commit
from vllm_cascade_plugin.planning import graph_layout
from vllm_cascade_plugin.planning.planner import CascadePlanner

PAGE = 16
# vLLM 0.26's CUDA-graph capture sizes for max_num_seqs 512: 1, 2, 4, then every 8.
CAPTURE_SIZES = [1, 2, 4, *range(8, 1025, 8)]
MAX_LEVELS = 3  # CASCADE_MAX_LEVELS's default
MAX_GRAPHS = 64  # whole-step graphs a runner holds (graphs.fullgraph.MAX_GRAPHS; a test checks)


@dataclass(frozen=True)
class Run:
    name: str
    requests: int
    documents: int
    document_pages: int
    own_tokens: int
    output_tokens: tuple[int, int]  # drawn uniformly from [low, high)
    arrivals_per_step: float = 2.0
    # A load that changes: the arrivals per step cycle through these, each for phase_steps.
    phases: tuple[float, ...] = ()
    phase_steps: int = 0

    def arrivals(self, step: int) -> float:
        if not self.phases:
            return self.arrivals_per_step
        return self.phases[step // self.phase_steps % len(self.phases)]


RUNS = (
    # tests/gpu/serving_driver.py's mix: four 1K-token prefixes, 8-48 output tokens.
    Run("serving test (4 x 1K prefixes)", 1000, 4, 64, 16, (8, 49)),
    Run("4 x 8K documents", 1000, 4, 512, 64, (64, 256)),
    Run("1 x 32K document", 400, 1, 2048, 64, (64, 256), arrivals_per_step=1.0),
    # A service whose load rises and falls: 16 documents of 2K tokens, answers of 64-511
    # tokens, the arrivals per step changing every 2,000 steps (about 20 s of decoding).
    Run("16 x 2K documents, load varying", 8000, 16, 128, 64, (64, 512),
        phases=(0.3, 1.0, 0.6, 0.15, 0.8), phase_steps=2000),
)


def captures(keys: list[object], held: int = MAX_GRAPHS) -> int:
    """Graphs captured over a run's steps of ``keys`` (in order) by a cache of ``held`` graphs
    that captures a key the first time it comes and evicts the least recently replayed."""
    cache: dict[object, None] = {}
    count = 0
    for key in keys:
        if key in cache:
            del cache[key]  # re-inserted last: the most recently replayed
        else:
            count += 1
            if len(cache) >= held:
                del cache[next(iter(cache))]
        cache[key] = None
    return count


def count(run: Run, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    arrivals: list[tuple[int, int, int]] = []
    step = 0
    while len(arrivals) < run.requests:
        arrivals += [(step, int(rng.integers(run.documents)), int(rng.integers(*run.output_tokens)))
                     for _ in range(int(rng.poisson(run.arrivals(step))))]
        step += 1
    arrivals = arrivals[: run.requests]
    planner, next_page = CascadePlanner(), 1 + run.documents * run.document_pages
    live: list[list] = []  # [pages, sequence length, tokens still to decode]
    largest = CAPTURE_SIZES[-1]  # FA3 executor: buffers sized for it at once (graph_rows)
    reserve = {"rows": largest, "static32": graph_layout.STATIC32_RESERVE,
               "static64": largest * MAX_LEVELS}
    # As the executor lays steps out (a book of widths of its own) and with exact widths.
    books = {"": graph_layout.LayoutBook(), "_exact": None}
    sizes: dict[str, dict[str, int]] = {v: {} for v in books}  # scratch buffer -> elements
    shapes: dict[str, set] = {v: set() for v in books}
    keys: dict[str, list] = {v: [] for v in books}
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
                for variant, book in books.items():
                    levels = graph_layout.layout(plan, padded, book=book)
                    want = {"rows": max(level.rows for level in levels[:-1]),
                            "static32": sum(level.cu_q.size + level.kv_lens.size
                                            + level.table.size for level in levels),
                            "static64": sum(0 if level.index is None else level.index.size
                                            for level in levels)}
                    held = sizes[variant]
                    for name, numel in want.items():
                        if numel > held.get(name, 0):
                            held[name] = max(graph_layout.buffer_elements(numel), reserve[name])
                    shape = tuple(level.key for level in levels)
                    shapes[variant].add(shape)
                    keys[variant].append((shape, tuple(sorted(held.items()))))
        for r in live:  # every running request decodes one token
            r[1] += 1
            r[2] -= 1
            if r[1] > len(r[0]) * PAGE:
                r[0].append(next_page)
                next_page += 1
        live = [r for r in live if r[2] > 0] + [r for r in new if r[2] > 0]
        step += 1
    out: dict[str, float] = {"steps": step, "decode_steps": decode_steps,
                             "padded_sizes": len(padded_sizes)}
    for variant in books:
        layouts, captured = len(set(keys[variant])), captures(keys[variant])
        out |= {f"shapes{variant}": len(shapes[variant]), f"layouts{variant}": layouts,
                f"replayable_at_most{variant}": round(1 - layouts / max(decode_steps, 1), 3),
                f"captures{variant}": captured,
                f"captures_second_half{variant}": captured
                - captures(keys[variant][: len(keys[variant]) // 2])}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write graph_layouts.json here")
    args = parser.parse_args()
    rows = [{**asdict(run), **count(run)} for run in RUNS]
    for row in rows:
        print(f"{row['name']:32s} decode steps {row['decode_steps']:5d}  padded sizes "
              f"{row['padded_sizes']:3d}  shapes {row['shapes']:3d}  layouts {row['layouts']:3d}"
              f" (exact widths {row['layouts_exact']:3d})  replayable at most "
              f"{row['replayable_at_most']:.1%}  captures holding {MAX_GRAPHS}: "
              f"{row['captures']} ({row['captures_exact']}), in the second half "
              f"{row['captures_second_half']} ({row['captures_second_half_exact']})")
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
