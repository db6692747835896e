"""Time the check a metadata builder makes before it takes a cascade step's plan
(``hooks_step.runs_as_planned``): the batch's rows are the planned rows by identity, and vLLM
dispatched the step to no FULL CUDA graph. Per builder call on a cascade step, back to back
(hot caches: inside ``vllm serve`` a step's host work runs from cold caches, several times
slower: ``host/step.py --cold``), best of ``--repeat`` runs of ``--number`` calls.

Variants, by where the batch's rows come from:
- ``v2_req_idx``: Model Runner V2 on vLLM 0.30+ (``CommonAttentionMetadata.req_idx``, vLLM's
  ``idx_mapping``): one array comparison.
- ``v2_decode_order`` / ``v2_mixed_order``: V2 on 0.26-0.29, whose builders get no ``req_idx``:
  the request slots of vLLM's own batch order (a decode step keeps the scheduler's order; a mixed
  step, every fourth row a 200-token prefill chunk, through vLLM's ``sort_batch_req_ids``).
- ``v1``: Model Runner V1: the input batch's request ids.

    PYTHONPATH=src python3 -m benchmarks.host.row_identity [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import timeit
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from benchmarks.common import RESULTS
from vllm_cascade_plugin.integration import compat, hooks_step

ROWS = (8, 64, 256)


def steps(n: int) -> dict[str, tuple[Any, Any]]:
    """Each variant's (pending step, the batch's metadata as a builder gets it) for ``n`` rows,
    the planned rows equal to the batch's."""
    names = [f"req-{i}" for i in range(n)]
    slots = np.random.default_rng(n).permutation(4 * n)[:n].astype(np.int64)
    states = SimpleNamespace(req_id_to_index=dict(zip(names, slots.tolist(), strict=True)))
    v2 = SimpleNamespace(req_states=states, decode_query_len=1)
    out = {}
    for name, tokens, req_idx in (
            ("v2_req_idx", dict.fromkeys(names, 1), slots.astype(np.intp)),
            ("v2_decode_order", dict.fromkeys(names, 1), None),
            ("v2_mixed_order", {r: 200 if i % 4 == 0 else 1 for i, r in enumerate(names)}, None)):
        so = SimpleNamespace(num_scheduled_tokens=tokens, scheduled_spec_decode_tokens={})
        order = compat.v2_batch_order(v2, so)
        step = hooks_step.PendingStep(v2, so)
        step.rows = np.array([states.req_id_to_index[r] for r in order], dtype=np.int64)
        cm = SimpleNamespace() if req_idx is None else SimpleNamespace(req_idx=step.rows.copy())
        out[name] = step, cm
    v1 = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[*names, None, None]))
    step = hooks_step.PendingStep(v1, None)
    step.rows = list(names)
    out["v1"] = step, SimpleNamespace()
    return out


def time_check(step: Any, cm: Any, number: int, repeat: int) -> float:
    """Microseconds per call of the check, the step's vLLM order read anew each call (as each
    step does once)."""
    step.graph_mode = "PIECEWISE"
    hooks_step.pending = step

    def call() -> bool:
        step.vllm_order = None
        return hooks_step.runs_as_planned(cm)

    assert call(), "the planned rows are the batch's: the check must pass"
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few calls (smoke test)")
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu")
    args = parser.parse_args()
    number, repeat = (20, 1) if args.quick else (args.number, args.repeat)
    rows = []
    for n in ROWS:
        row: dict[str, Any] = {"rows": n}
        for name, (step, cm) in steps(n).items():
            row[f"{name}_us"] = round(time_check(step, cm, number, repeat), 2)
        hooks_step.pending = None
        rows.append(row)
        print(json.dumps(row))
    if args.quick:
        return
    import vllm

    result = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
              "cpus": __import__("os").cpu_count(), "numpy": np.__version__,
              "python": platform.python_version(), "vllm": vllm.__version__,
              "number": number, "repeat": repeat,
              "command": "PYTHONPATH=src python3 -m benchmarks.host.row_identity",
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "row_identity.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
