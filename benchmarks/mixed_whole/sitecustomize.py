"""Benchmark only: mixed prefill+decode steps planned whole, as one cascade step.

``serve_bench.py``'s ``cascade_flash_attn_mixed_whole`` config puts this folder first on the
server's ``PYTHONPATH``, so every process of that server imports this module at start-up. With
``CASCADE_BENCH_MIXED_WHOLE=1`` the step session plans a mixed step with all its rows, the
prefill rows' queries included, and charges it the executor's eager cost (``cost_model``), as it
plans every mixed step on an executor without the split (``StepSession._split_lens`` answers
None): the step runs as cascade where that cost model says it wins, else flat. With vLLM's
``FLASH_ATTN`` backend the plugin otherwise keeps every mixed step flat (or, with
``CASCADE_SPLIT_MIXED=1``, splits off its decode rows). Behind one 32K-token document a quarter
of a burst's steps are mixed, and each one run flat reads the document once per decode row:
whether running them whole beats both. It shadows any other ``sitecustomize`` module on that
server's path.
"""

from __future__ import annotations

import os

if os.environ.get("CASCADE_BENCH_MIXED_WHOLE", "") == "1":
    from vllm_cascade_plugin.step import session

    def _planned_whole(query_lens: object) -> None:
        return None

    session._split_lens = _planned_whole  # type: ignore[method-assign]
