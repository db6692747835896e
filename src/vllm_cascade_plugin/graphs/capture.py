"""CUDA graphs of the plugin's own: capture on a side stream into a private pool, and a cache of
graphs by key. Used for each layer's cascade kernels (:class:`LayerGraphs`,
``CASCADE_CUDA_GRAPHS``) and for whole cascade decode steps (``fullgraph.StepGraphs``,
``CASCADE_FULL_GRAPHS``).

A pool lives while some graph uses it: once every graph captured into it is destroyed, PyTorch
releases the pool (its device side and, since torch 2.10, its pinned-host side) but keeps it
until its memory is freed, and the next capture into the same pool id fails inside PyTorch
(``it->second->use_count > 0 INTERNAL ASSERT FAILED``). That is what happened under
``vllm serve``: many step layouts filled the cache, which dropped every graph and captured again.
So each cache keeps an *anchor*, a one-kernel graph captured into its pool first and never
destroyed, and when full it destroys only the graph replayed longest ago.

vLLM sizes its KV cache without the plugin's graphs, so their pools grow into the memory left
beside it. A capture is skipped (that step runs eagerly, as before its graph existed) while the
GPU has less than ``MIN_FREE_BYTES`` free, so the pools stop growing before they crowd out
vLLM's own allocations; one warning says so.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GraphCache", "LayerGraphs", "capture_cuda", "new_pool"]

_log = logging.getLogger("vllm.cascade_plugin")
_CACHES: weakref.WeakSet[GraphCache] = weakref.WeakSet()  # every cache of this process

MIN_FREE_BYTES = 1 << 30  # below this much free GPU memory no graph is captured
LOW_MEMORY_RECHECK_S = 10.0  # once low, free memory is read again after this long
_warned_low_memory = False


def cuda_free_bytes() -> int:
    """Free memory of the current CUDA device (``cudaMemGetInfo``; it waits for no kernel)."""
    return int(torch.cuda.mem_get_info()[0])


def new_pool(stream: torch.cuda.Stream) -> tuple[Any, Any]:
    """A private memory pool for CUDA-graph captures and its anchor: a graph that holds the
    pool for as long as the anchor is referenced (see the module docstring)."""
    pool = torch.cuda.graph_pool_handle()
    anchor, _ = capture_cuda(lambda: torch.zeros(1, device="cuda"), pool, stream)
    return pool, anchor


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
    """CUDA graphs by key, at most ``max_graphs`` (the least recently replayed one is destroyed
    to make room), in one private pool on a side stream.

    A key's graph is captured the ``capture_after``-th time the key comes (1: at once). The very
    first graph of a cache is captured only after one eager run of any key, so that whatever
    its kernels initialise lazily (workspaces, autotuning) happens outside a capture.
    ``capture`` is :func:`capture_cuda` on a GPU; tests pass a stand-in
    ``capture(fn) -> (replay, result)``. ``free_memory``: how many bytes the GPU has free
    (:func:`cuda_free_bytes` on a GPU, None with a stand-in: not checked); a capture due while
    that is below ``MIN_FREE_BYTES`` is skipped (counted in ``skipped``).
    """

    def __init__(self, capture: Callable[..., Any] | None, capture_after: int, max_graphs: int,
                 max_sightings: int) -> None:
        self.capture = capture
        self.capture_after = capture_after
        self.max_graphs = max_graphs
        self.max_sightings = max_sightings
        self.captures = 0
        self.replays = 0
        self.evictions = 0
        self.skipped = 0  # captures due but skipped for want of free GPU memory
        self.free_memory: Callable[[], int] | None = cuda_free_bytes if capture is None else None
        self._low_memory_until = 0.0
        self._graphs: OrderedDict[tuple[Any, ...], Callable[[], Any]] = OrderedDict()
        self._seen: dict[tuple[Any, ...], int] = {}
        self._warm = False
        self._pool: Any = None
        self._anchor: Any = None  # keeps the pool alive (module docstring)
        self._stream: torch.cuda.Stream | None = None
        _CACHES.add(self)

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph and sighting (the pool stays). No wait for the GPU: CUDA frees a
        graph that is still running when it completes, and a graph captured later into the
        same pool runs after it on the same stream."""
        self._graphs.clear()
        self._seen.clear()

    def _replay(self, key: tuple[Any, ...]) -> Callable[[], Any] | None:
        replay = self._graphs.get(key)
        if replay is not None:
            self._graphs.move_to_end(key)
            self.replays += 1
        return replay

    def _due(self, key: tuple[Any, ...]) -> bool:
        """Count a sighting of ``key`` (which has no graph); True when it is time to capture it,
        with room made for its graph."""
        seen = self._seen.get(key, 0) + 1
        if seen < self.capture_after or not self._warm:
            self._warm = True
            if len(self._seen) >= self.max_sightings:
                self._seen.clear()
            self._seen[key] = seen
            return False
        if not self._memory_allows():
            return False
        self._seen.pop(key, None)
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
            self.evictions += 1
        return True

    def _memory_allows(self) -> bool:
        """Whether the GPU has ``MIN_FREE_BYTES`` free for a capture; once it has not, it is
        read again only after ``LOW_MEMORY_RECHECK_S`` (until then every capture is skipped)."""
        global _warned_low_memory
        if self.free_memory is None:
            return True
        now = time.monotonic()
        if now >= self._low_memory_until:
            try:
                free = self.free_memory()
            except Exception:  # cannot tell: capture as without the check
                return True
            if free >= MIN_FREE_BYTES:
                return True
            self._low_memory_until = now + LOW_MEMORY_RECHECK_S
            if not _warned_low_memory:
                _warned_low_memory = True
                _log.warning(
                    "vllm-cascade-plugin: %.2f GiB of GPU memory free, less than the %.0f GiB a "
                    "CUDA graph capture needs left; cascade steps without a graph run eagerly "
                    "until memory frees up (lower --gpu-memory-utilization to leave room for the "
                    "plugin's graphs).", free / 2**30, MIN_FREE_BYTES / 2**30)
        self.skipped += 1
        return False

    def _keep(self, key: tuple[Any, ...], replay: Callable[[], Any]) -> None:
        self._graphs[key] = replay
        self.captures += 1

    def _capture_with(self, fn: Callable[[], Any]) -> tuple[Callable[[], Any], Any]:
        """``fn`` captured (and replayed once); its host time is counted (``stats``)."""
        from .. import stats

        start = time.perf_counter()
        if self.capture is not None:
            captured = self.capture(fn)
        else:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
                self._pool, self._anchor = new_pool(self._stream)
            captured = capture_cuda(fn, self._pool, self._stream)
        stats.record_capture(time.perf_counter() - start)
        stats.set_graph_pool_bytes(sum(cache.pool_bytes() for cache in list(_CACHES)))
        return captured

    def pool_bytes(self) -> int:
        """GPU memory the cache's pool holds (0 before its first capture or where this torch
        cannot say)."""
        if self._pool is None:
            return 0
        try:
            return sum(int(segment.get("total_size", 0)) for segment in
                       torch.cuda.memory_snapshot(self._pool, include_traces=False))
        except Exception:  # a torch whose memory snapshot differs: unknown, not fatal
            return 0


CAPTURE_AFTER = 1  # captured the first time a key comes (after the cache's one eager run)
MAX_GRAPHS = 2048  # e.g. 64 step shapes x 32 layers; each holds a few KB of its own
MAX_SIGHTINGS = 4096  # keys seen but not captured yet, remembered (then forgotten all at once)


class LayerGraphs(GraphCache):
    """One CUDA graph per (layer, step layout) of graphed decode steps, replayed instead of
    launching the layer's kernels from Python.

    A key holds everything a replay bakes in: the step's ``graph_key`` (its bucketed level sizes,
    the static metadata buffers' and scratch views' addresses, the scale) and the layer's
    tensors' addresses and strides. A replay therefore computes exactly what the eager run
    would: the data behind those addresses (queries, KV cache, this step's metadata in the
    static buffers) is read when the graph runs. All graphs share one memory pool; that is safe
    because they run one after another on one stream and each leaves nothing in the pool that
    another reads (a graph's LSE, its only result there, stays referenced by its replay). Tests'
    stand-in ``capture`` keeps ``fn`` and its tensors, which is what a real replay does.
    """

    def __init__(self, capture: Callable[..., Any] | None = None,
                 capture_after: int = CAPTURE_AFTER, max_graphs: int = MAX_GRAPHS) -> None:
        super().__init__(capture, capture_after, max_graphs, MAX_SIGHTINGS)
        self.failed = False

    def usable(self, device: torch.device) -> bool:
        return not self.failed and (self.capture is not None or device.type == "cuda")

    def run(self, key: tuple[Any, ...], fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Replay ``key``'s graph, or run ``fn`` (capturing it when ``key`` has come often
        enough); returns ``fn``'s result either way."""
        if self._capturing():  # a graph launch into someone else's capture: not attempted
            return fn()
        replay = self._replay(key)
        if replay is not None:
            return replay()
        if self.failed or not self._due(key):
            return fn()
        try:
            replay, result = self._capture_with(fn)
        except Exception as exc:  # eager from now on; this layer runs eagerly right away
            from .. import stats
            from ..step import session

            self.failed = True
            self.clear()
            stats.record_capture_failure()
            session.graphs_lost()
            _log.warning("vllm-cascade-plugin: capturing a CUDA graph of a cascade decode step "
                         "failed (%s: %s); cascade decode steps launch their kernels eagerly "
                         "from now on (set CASCADE_CUDA_GRAPHS=0 to skip the attempt).",
                         type(exc).__name__, exc)
            return fn()
        self._keep(key, replay)
        return result

    def _capturing(self) -> bool:
        # Inside someone else's capture (vLLM's, or a whole-step graph), the kernels belong to
        # that graph: run them, neither replay nor capture a graph of our own.
        return self.capture is None and torch.cuda.is_current_stream_capturing()
