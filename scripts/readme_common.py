"""What every block of README.md's generated tables shares: where the result files are, how
they are read, and how a figure, a table and a file's setup are written (``readme_tables.py``
renders the blocks; standard library only)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GPU = RESULTS / "gpu"  # GPU runs: each file's meta, or each row, names its GPU
CPU = RESULTS / "cpu"
TIMES, DASH = "\u00d7", "\u2013"  # the README's multiplication sign and en dash


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _meta(path: Path) -> dict[str, Any]:
    meta = path.with_name(path.name.removesuffix(".json") + ".meta.json")
    return _load(meta) if meta.is_file() else {}


def served_rows(path: Path) -> list[dict[str, Any]]:
    """serve.json's rows but those of a run its meta marks ``left_out`` (a run that cannot
    resolve what it measured, e.g. its two flat servers far apart: the reason is that field's
    text); the rows stay in the file, the tables leave them out (the serve bench's
    ``results.rows_kept``, which takes no rate from them either)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.serve.results import rows_kept

    return rows_kept(path, _load(path))


def _int(x: float) -> str:
    return f"{x:,.0f}"


def _ratio(x: float) -> str:
    return f"{x:.2f}{TIMES}"


def _table(head: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    head = list(head)
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(row) + " |" for row in rows)]


def _source(*paths: Path) -> str:
    return ", ".join(f"`{p.relative_to(ROOT)}`" for p in paths)


def _versions(meta: dict[str, Any]) -> list[str]:
    return [f"{name} {meta[key]}" for key, name in (("vllm", "vLLM"), ("flashinfer", "FlashInfer"))
            if key in meta]


def _setup(meta: dict[str, Any]) -> str:
    parts = [meta.get("gpu", "GPU not recorded").split(" (")[0], *_versions(meta)]
    return ", ".join(parts) + (f", {meta['date']}" if "date" in meta else "")
