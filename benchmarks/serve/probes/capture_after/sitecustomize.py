"""Benchmark only: whether capturing a CUDA graph at a key's second sighting, not its first,
spares a burst the captures of layouts it meets once.

``serve/bench.py``'s ``cascade_flash_attn_capture_second`` config puts this folder first on the
server's ``PYTHONPATH``, so every process of that server imports this module at start-up. With
``CASCADE_BENCH_CAPTURE_AFTER`` set to N (at least 2), every graph cache the plugin makes (the
whole-step graphs of ``graphs.fullgraph`` and the per-layer graphs of ``graphs.capture``)
captures a key the N-th time it comes instead of the first: a decode step of a layout not seen
before runs eagerly (each layer's kernels launched from Python), the next step of that layout
captures it. While a burst's batch grows, it meets a new padded size every 8 requests and most
of those layouts once; each capture stalls the engine 24-43 ms on an H200, an eager step costs
a few ms of host time more than a replay. The step session still charges a layout's first step
the eager cost, which is what that step now runs. It shadows any other ``sitecustomize``
module on that server's path.
"""

from __future__ import annotations

import os

_AFTER = int(os.environ.get("CASCADE_BENCH_CAPTURE_AFTER", "0") or 0)

if _AFTER >= 2:
    from typing import Any

    from vllm_cascade_plugin.graphs import capture

    _init = capture.GraphCache.__init__

    def _capture_later(self: capture.GraphCache, capture_fn: Any, capture_after: int,
                       max_graphs: int, max_sightings: int) -> None:
        _init(self, capture_fn, max(capture_after, _AFTER), max_graphs, max_sightings)

    capture.GraphCache.__init__ = _capture_later  # type: ignore[method-assign]
