"""Benchmark only: whether the plugin's host time per step is on a served step's critical path.

``serve/bench.py``'s ``cascade_flash_attn_host_delay_1ms`` and ``_4ms`` configs put this folder
first on the server's ``PYTHONPATH``, so every process of that server imports this module at
start-up. With ``CASCADE_BENCH_HOST_DELAY_US`` set, it wraps the runner hooks' planning of a step
(``hooks_dispatch.plan_rows``) so that each call first keeps the CPU busy that many microseconds
(holding the GIL, as the planner's Python does). The delay is counted in the plugin's planning
time like the rest of the planning. If TPOT does not move with it, the plugin's host time is
hidden behind the GPU (vLLM's asynchronous scheduling prepares the next step while the GPU runs
the current one); if it moves by about the delay, every microsecond of planning counts. It
shadows any other ``sitecustomize`` module on that server's path.
"""

from __future__ import annotations

import os
import time

_DELAY_US = float(os.environ.get("CASCADE_BENCH_HOST_DELAY_US", "0") or 0)

if _DELAY_US > 0:
    from vllm_cascade_plugin.integration import hooks_dispatch

    _plan_rows = hooks_dispatch.plan_rows

    def _delayed_plan_rows(*args, **kwargs):  # type: ignore[no-untyped-def]
        until = time.perf_counter() + _DELAY_US / 1e6
        while time.perf_counter() < until:
            pass
        return _plan_rows(*args, **kwargs)

    hooks_dispatch.plan_rows = _delayed_plan_rows
