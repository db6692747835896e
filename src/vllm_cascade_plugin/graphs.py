"""CUDA graphs of the plugin's own: capture on a side stream into a private pool, and a cache
that captures a key's graph the ``capture_after``-th time it comes. Used for each layer's cascade
kernels (``kernels._Graphs``, ``CASCADE_CUDA_GRAPHS``) and for whole cascade decode steps
(``fullgraph.StepGraphs``, ``CASCADE_FULL_GRAPHS``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GraphCache", "capture_cuda"]


def capture_cuda(fn: Callable[[], Any], pool: Any,
                 stream: torch.cuda.Stream) -> tuple[Callable[[], Any], Any]:
    """``fn``'s kernels captured in a CUDA graph, then replayed once (the capture itself runs
    nothing). Returns the replay and ``fn``'s result, tensors the replays rewrite in place."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):  # CUDA cannot capture the legacy default stream
        # thread_local: vLLM's other threads keep working while this one captures.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            result = fn()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    graph.replay()

    def replay() -> Any:
        graph.replay()
        return result

    return replay, result


class GraphCache:
    """CUDA graphs by key, each captured the ``capture_after``-th time its key comes, at most
    ``max_graphs`` of them (beyond that every graph is dropped at once), in one private memory
    pool on a side stream: the bookkeeping of ``kernels._Graphs`` (per layer) and
    ``fullgraph.StepGraphs`` (whole steps). ``capture`` is :func:`capture_cuda` on a GPU; tests
    pass a stand-in ``capture(fn) -> (replay, result)``."""

    def __init__(self, capture: Callable[..., Any] | None, capture_after: int, max_graphs: int,
                 max_sightings: int) -> None:
        self.capture = capture
        self.capture_after = capture_after
        self.max_graphs = max_graphs
        self.max_sightings = max_sightings
        self.captures = 0
        self.replays = 0
        self._graphs: dict[tuple[Any, ...], Callable[[], Any]] = {}
        self._seen: dict[tuple[Any, ...], int] = {}
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph and sighting. No wait for the GPU: CUDA frees a graph that is still
        running when it completes, and a graph captured later into the same pool runs after it
        on the same stream."""
        self._graphs.clear()
        self._seen.clear()

    def _due(self, key: tuple[Any, ...]) -> bool:
        """Count a sighting of ``key`` (which has no graph); True when it is time to capture it,
        with room made for its graph."""
        seen = self._seen.get(key, 0) + 1
        if seen < self.capture_after:
            if len(self._seen) >= self.max_sightings:
                self._seen.clear()
            self._seen[key] = seen
            return False
        self._seen.pop(key, None)
        if len(self._graphs) >= self.max_graphs:
            self.clear()
        return True

    def _capture_with(self, fn: Callable[[], Any]) -> tuple[Callable[[], Any], Any]:
        if self.capture is not None:
            return self.capture(fn)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
            self._pool = torch.cuda.graph_pool_handle()
        return capture_cuda(fn, self._pool, self._stream)
