"""Time the cascade planner on decode batches shaped like real shared-prefix workloads.

Cold: a fresh planner on a new block table (new random block ids). Steady: one planner over
the following decode steps: every row one token longer, and a row entering a new page gets a
fresh block; rows have random own lengths, so each crosses a page every 16th step but some row
crosses on every step. The block table is updated in place, as vLLM does. Pre-check: what the
runner hooks do first every step, ``nothing_shared`` on the rows' first block ids; on a batch
without sharing (the "no sharing" case: every request its own 2K-token prompt) it is all they do.
Churn: online serving, where every step one request finishes and a new one arrives (with one of
the case's prefixes, or a prefix of its own where no two requests share one) and prefills its own
prompt tokens, while the others decode. The new request takes the freed slot on even steps; on odd
steps the batch condenses as vLLM's V1 input batch does (the last row moves into the freed slot)
and the new request is appended. Freed blocks go back to a pool, so their ids reappear.
Steady and churn are timed for two planners in lockstep over the same steps: one comparing the
block table with the last step's (``row_keys`` not given), one told by row keys which rows
changed, as the runner hooks tell it under ``CASCADE_PLAN_FROM_CHANGES`` (a new or moved row
gets a new key). Three rounds; each figure is the rounds' median of the round medians, and the
speedup (comparing over told) is given as the rounds' min, median and max.

    PYTHONPATH=src python3 -m benchmarks.host.planner [--quick] [--out benchmarks/results/cpu]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.common import RESULTS
from vllm_cascade_plugin.planning.planner import CascadePlanner, nothing_shared

PAGE_SIZE = 16


@dataclass(frozen=True)
class Case:
    name: str
    requests: int
    groups: int
    shared_pages: int
    own_tokens: tuple[int, int]  # private tokens per row, drawn uniformly from this range


CASES = (
    Case("1x32K", requests=256, groups=1, shared_pages=2048, own_tokens=(64, 256)),
    Case("8 groups", requests=256, groups=8, shared_pages=2048, own_tokens=(64, 256)),
    Case("16 groups", requests=1024, groups=16, shared_pages=240, own_tokens=(64, 256)),
    Case("no sharing", requests=256, groups=256, shared_pages=128, own_tokens=(64, 256)),
    Case("4x8K", requests=256, groups=4, shared_pages=512, own_tokens=(64, 256)),
    Case("4x8K, 64 rows", requests=64, groups=4, shared_pages=512, own_tokens=(64, 256)),
)


class DecodeBatch:
    """A block table for ``case`` (groups interleaved in batch order) that decodes in place."""

    def __init__(self, case: Case, rng: np.random.Generator) -> None:
        own = rng.integers(*case.own_tokens, size=case.requests)
        self.seq_lens = case.shared_pages * PAGE_SIZE + own
        self.query_lens = np.ones(case.requests, np.int32)
        width = case.shared_pages + -(-case.own_tokens[1] // PAGE_SIZE) + 64
        # Random distinct ids, as a block pool hands them out after a while.
        ids = rng.permutation(case.requests * width + case.groups * case.shared_pages) + 1
        self.block_table = ids[: case.requests * width].reshape(case.requests, width)
        self.block_table = self.block_table.astype(np.int32)
        prefixes = ids[case.requests * width :].reshape(case.groups, case.shared_pages)
        self.block_table[:, : case.shared_pages] = prefixes[np.arange(case.requests) % case.groups]
        self._next_id = int(ids.max()) + 1
        self.keys = np.arange(case.requests, dtype=np.int64)  # a new key: a changed row
        self._next_key = case.requests

    def step(self) -> None:
        """One decode step: a row whose last page is full gets a fresh block for its new token."""
        self._decode(np.ones(len(self.seq_lens), bool))

    def _decode(self, rows: np.ndarray) -> None:
        """``rows`` (a mask) decode one token; a row whose last page is full gets a new block."""
        entering = np.flatnonzero(rows & (self.seq_lens % PAGE_SIZE == 0))
        self.block_table[entering, self.seq_lens[entering] // PAGE_SIZE] = self._take(entering.size)
        self.seq_lens[rows] += 1
        self.query_lens[rows] = 1

    def _take(self, count: int) -> np.ndarray:
        """``count`` fresh block ids."""
        ids = np.arange(self._next_id, self._next_id + count, dtype=np.int32)
        self._next_id += count
        return ids

    def precheck(self) -> tuple[bool, int]:
        """The hooks' pre-check on this step: (nothing shared?, nanoseconds it took)."""
        start = time.perf_counter_ns()
        skip = nothing_shared(self.block_table[:, 0], self.seq_lens, self.query_lens, PAGE_SIZE)
        return skip, time.perf_counter_ns() - start

    def new_key(self) -> int:
        self._next_key += 1
        return self._next_key

    def plan(self, planner: CascadePlanner, keyed: bool = False) -> int:
        """Plan this step with ``planner`` (told the row keys when ``keyed``); returns the
        nanoseconds it took."""
        start = time.perf_counter_ns()
        planner.plan(self.block_table, self.seq_lens, self.query_lens, PAGE_SIZE,
                     row_keys=self.keys if keyed else None)
        return time.perf_counter_ns() - start


class ChurnBatch(DecodeBatch):
    """A :class:`DecodeBatch` where every step one request finishes and a new one arrives."""

    def __init__(self, case: Case, rng: np.random.Generator) -> None:
        super().__init__(case, rng)
        self.case = case
        self.rng = rng
        # Rows 0..groups-1 hold the prefixes 0..groups-1 (the groups are interleaved).
        self.prefixes = self.block_table[: case.groups, : case.shared_pages].copy()
        self._free: list[int] = []  # ids of finished requests' blocks, handed out first
        self._steps = 0

    def _take(self, count: int) -> np.ndarray:
        reused = [self._free.pop() for _ in range(min(count, len(self._free)))]
        return np.concatenate((np.array(reused, np.int32), super()._take(count - len(reused))))

    def step(self) -> None:
        case, rows = self.case, len(self.seq_lens)
        done = int(self.rng.integers(rows))
        pages = -(-int(self.seq_lens[done]) // PAGE_SIZE)
        self._free.extend(self.block_table[done, case.shared_pages : pages].tolist())
        slot = done
        if self._steps % 2:  # condense: the last row moves into the hole, the new one appends
            slot, last = rows - 1, rows - 1
            if done != last:
                pages = -(-int(self.seq_lens[last]) // PAGE_SIZE)
                self.block_table[done, :pages] = self.block_table[last, :pages]
                self.seq_lens[done] = self.seq_lens[last]
                self.query_lens[done] = self.query_lens[last]
                self.keys[done] = self.keys[last]  # a key row `done` never had
        self._steps += 1
        others = np.ones(rows, bool)
        others[slot] = False
        self._decode(others)
        own = int(self.rng.integers(*case.own_tokens))
        if case.groups < case.requests:
            prefix = self.prefixes[self.rng.integers(case.groups)]
        else:  # no two requests share a prefix: the new one brings its own
            prefix = super()._take(case.shared_pages)
        ids = np.concatenate((prefix, self._take(-(-own // PAGE_SIZE))))
        self.block_table[slot, : ids.size] = ids  # the rest of the row keeps stale ids
        self.keys[slot] = self.new_key()
        self.seq_lens[slot] = case.shared_pages * PAGE_SIZE + own
        self.query_lens[slot] = own  # its prefix is cached: it prefills its own tokens


def lockstep(case: Case, batch: DecodeBatch, steps: int, precheck: list[int] | None = None,
             skipped: set[bool] | None = None) -> tuple[list[int], list[int]]:
    """Nanoseconds per step of two planners on the same ``steps`` steps of ``batch``: one
    comparing block ids, one told the row keys; each step they take turns going first, so that
    what the machine does meanwhile weighs on both alike. The hooks' pre-check is timed too when
    ``precheck`` is given."""
    plain, keyed = CascadePlanner(), CascadePlanner()
    batch.plan(plain)
    batch.plan(keyed, keyed=True)
    times: tuple[list[int], list[int]] = ([], [])
    for step in tqdm(range(steps), desc=case.name, leave=False, disable=None):
        batch.step()
        if precheck is not None and skipped is not None:
            skip, ns = batch.precheck()
            precheck.append(ns)
            skipped.add(skip)
        for told in ((False, True) if step % 2 else (True, False)):
            times[told].append(batch.plan(keyed if told else plain, keyed=told))
    return times


def measure(case: Case, cold_runs: int, steady_steps: int, rounds: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    cold = []
    # Progress on stderr, and only on a terminal (disable=None): logs and CI stay clean.
    for _ in tqdm(range(cold_runs), desc=f"{case.name}: cold", leave=False, disable=None):
        cold.append(DecodeBatch(case, rng).plan(CascadePlanner()))
    medians: dict[str, list[float]] = {}
    precheck: list[int] = []
    skipped: set[bool] = set()
    pages = 0
    for _ in range(rounds):  # each round the same steps (the same seeds)
        steady = DecodeBatch(case, np.random.default_rng(1))
        runs = {"steady": lockstep(case, steady, steady_steps, precheck, skipped),
                "churn": lockstep(case, ChurnBatch(case, np.random.default_rng(2)),
                                  steady_steps)}
        pages = int(-(-steady.seq_lens.max() // PAGE_SIZE))  # the longest row's
        for name, (plain, keyed) in runs.items():
            for key, spent in ((name, plain), (f"{name}_keyed", keyed)):
                medians.setdefault(key, []).append(statistics.median(spent) / 1e3)
            medians.setdefault(f"{name}_keyed_p99", []).append(np.percentile(keyed, 99) / 1e3)

    def median(key: str) -> float:
        return round(statistics.median(medians[key]), 1)

    def speedup(name: str) -> list[float]:
        """Each round's median comparing over its median told the rows: min, median, max."""
        ratios = sorted(a / b for a, b in zip(medians[name], medians[f"{name}_keyed"],
                                              strict=True))
        return [round(ratios[0], 2), round(statistics.median(ratios), 2), round(ratios[-1], 2)]

    return {
        "case": case.name,
        "requests": case.requests,
        "pages": pages,
        "steady_median_us": median("steady"),
        "steady_keyed_median_us": median("steady_keyed"),
        "steady_keyed_speedup": speedup("steady"),
        "cold_median_us": round(statistics.median(cold) / 1e3, 1),
        "churn_median_us": median("churn"),
        "churn_keyed_median_us": median("churn_keyed"),
        "churn_keyed_p99_us": median("churn_keyed_p99"),
        "churn_keyed_speedup": speedup("churn"),
        "precheck_median_us": round(statistics.median(precheck) / 1e3, 1),
        # What the hooks skip the planner on: the pre-check must say so on every step, or never.
        "planner_skipped": skipped.pop() if len(skipped) == 1 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few runs only (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu")
    args = parser.parse_args()
    cold_runs, steady_steps, rounds = (2, 5, 1) if args.quick else (30, 400, 3)
    rows = [measure(case, cold_runs, steady_steps, rounds) for case in CASES]
    print(f"{'case':<14} {'requests':>8} {'pages':>6} {'steady µs':>10} {'keyed':>6} "
          f"{'churn µs':>9} {'keyed':>6} {'keyed p99':>9} {'cold µs':>9} {'pre-check µs':>12} "
          f"{'skips planner':>13}  speedup steady, churn (rounds: min median max)")
    for row in rows:
        print(
            f"{row['case']:<14} {row['requests']:>8} {row['pages']:>6} "
            f"{row['steady_median_us']:>10} {row['steady_keyed_median_us']:>6} "
            f"{row['churn_median_us']:>9} {row['churn_keyed_median_us']:>6} "
            f"{row['churn_keyed_p99_us']:>9} {row['cold_median_us']:>9} "
            f"{row['precheck_median_us']:>12} {row['planner_skipped']!s:>13}  "
            f"{row['steady_keyed_speedup']} {row['churn_keyed_speedup']}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner.json").write_text(json.dumps(rows, indent=2) + "\n")
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}/{os.cpu_count()}",
        "numpy": np.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python", *sys.argv]),
        "cold_runs": cold_runs,
        "steady_steps": steady_steps,  # and as many churn steps, in each round
        "rounds": rounds,  # medians: the rounds' median of each round's median
        "page_size": PAGE_SIZE,
    }
    (args.out / "planner.meta.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
