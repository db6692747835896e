"""Benchmark only: the cost model's per-step term of a split mixed prefill+decode step, changed.

``serve/bench.py``'s ``cascade_flash_attn_split_off`` and ``cascade_flash_attn_split_free``
configs put this folder first on the server's ``PYTHONPATH``, so every process of that server
imports this module at start-up. With ``CASCADE_BENCH_SPLIT_STEP_US`` set, it sets that term
(``cost.FA3_SPLIT_STEP_FIXED_US``, read when the FLASH_ATTN builder builds its cost models) to
that many microseconds: ``split_off`` makes it so large that every mixed step runs flat (the
plugin without the split); ``split_free`` makes it 0, so a mixed step's decode rows run as
cascade wherever their kernels alone win. Beside the plugin as shipped, on one machine: what
splitting mixed steps gains online, and whether the shipped term is right. It shadows any other
``sitecustomize`` module on that server's path.
"""

from __future__ import annotations

import os

_SPLIT_US = os.environ.get("CASCADE_BENCH_SPLIT_STEP_US", "")

if _SPLIT_US:
    from vllm_cascade_plugin.planning import cost

    cost.FA3_SPLIT_STEP_FIXED_US = float(_SPLIT_US)
