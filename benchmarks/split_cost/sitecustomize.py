"""Benchmark only: mixed prefill+decode steps split whenever their decode rows' cascade wins.

``serve_bench.py``'s ``cascade_flash_attn_split_free`` config puts this folder first on the
server's ``PYTHONPATH``, so every process of that server imports this module at start-up. With
``CASCADE_BENCH_SPLIT_STEP_US`` set, it sets the cost model's per-step term of a split mixed step
(``cost.FA3_SPLIT_STEP_FIXED_US``, read when the FLASH_ATTN builder builds its cost models) to
that many microseconds: at 0 the decode rows of a mixed step run as cascade wherever their
kernels alone win, so the server shows what splitting such steps gains or costs online, against
the plugin as shipped, whose term keeps most of them flat. It shadows any other
``sitecustomize`` module on that server's path.
"""

from __future__ import annotations

import os

_SPLIT_US = os.environ.get("CASCADE_BENCH_SPLIT_STEP_US", "")

if _SPLIT_US:
    from vllm_cascade_plugin.planning import cost

    cost.FA3_SPLIT_STEP_FIXED_US = float(_SPLIT_US)
