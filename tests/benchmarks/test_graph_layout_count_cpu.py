"""benchmarks/graph_layout_count.py: the layouts a decode run needs, counted as the executor
keys its graphs."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
glc = importlib.import_module("graph_layout_count")


def test_a_batch_that_only_decodes_needs_one_layout():
    """64 requests arrive at once on two documents and decode 15 tokens each: every decode step
    has the same rows, groups and (bucketed) widths, so one layout serves them all."""
    run = glc.Run("steady", requests=64, documents=2, document_pages=40, own_tokens=16,
                  output_tokens=(16, 17), arrivals_per_step=1000.0)
    counted = glc.count(run)
    assert counted["decode_steps"] == 15
    assert counted["padded_sizes"] == counted["shapes"] == counted["layouts"] == 1


def test_a_batch_that_shrinks_needs_a_layout_per_padded_size_at_least():
    run = glc.Run("draining", requests=64, documents=2, document_pages=40, own_tokens=16,
                  output_tokens=(2, 40), arrivals_per_step=1000.0)
    counted = glc.count(run)
    assert counted["layouts"] >= counted["shapes"] >= counted["padded_sizes"] > 1
    assert counted["replayable_at_most"] == round(
        1 - counted["layouts"] / counted["decode_steps"], 3)
