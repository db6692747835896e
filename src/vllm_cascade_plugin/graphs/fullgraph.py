"""Whole-step CUDA graphs of cascade decode steps (``CASCADE_FULL_GRAPHS``, on by default).

Design and reading of vLLM 0.26.0 behind it: ``docs/design/full_step_graphs.md``. On an H200
(``benchmarks/results/history/e2e_full_graphs_ab.json``) it took a 128 x 16K-prefix decode run
from 6.5K to 9.4K output tokens/s against per-layer graphs alone.

A cascade step runs vLLM's PIECEWISE path (its FULL graph would skip our attention), which
costs host time in every layer even when the FA3 executor replays a CUDA graph per layer.
Here the runner's model call of a cascade decode step is captured whole — every layer, our
attention included — the ``capture_after``-th time the same key comes, and replayed after:

- key: the runner, vLLM's batch descriptor (its padded token count), the rows the executor
  runs (the same padded count), the executor's ``graph_key`` (bucketed level sizes, static
  metadata buffers, scratch: :mod:`~vllm_cascade_plugin.planning.graph_layout`) and the addresses
  of the model inputs, the slot mappings and the first layer's KV cache: everything the graph
  reads is named by the key or lives in the graph's own pool, and the step's data behind those
  addresses (``prepare_inputs``, ``executor.plan``) is written on the same stream before the
  replay. No exact row, group or page count is in it, so one graph serves every step of a layout
  while requests come and go;
- eligible: a planned cascade decode step (``StepSession.current``), every layer's metadata the
  same planned FA3 executor with a graphed step, tensor/pipeline/data parallel size 1, plain
  token inputs, the plan's largest block id inside the cache; never with LoRA, vLLM's weight
  offloading or a KV connector (``hooks_graphs.full_graphs_reason`` checks those once per
  runner), nor above vLLM's largest capture size (the executor has no graphed step there:
  ``StepSession.graphable``);
- capture: vLLM's wrappers are told to run their code (forward context mode NONE, as vLLM's own
  FULL capture does), a side stream in ``thread_local`` mode, a private pool; the graph is kept
  only if every attention layer ran the executor (none fell back to flat attention, whose
  per-step metadata is not static; building that metadata during a capture may itself fail the
  capture, where it waits for the GPU); then replayed once (capturing runs nothing);
- any failure: the step runs the normal path; a failed capture turns the feature off for the
  process (one warning).

Each capture is counted with its cause (``stats`` ``full_graph_capture_causes``,
``vllm_cascade_full_graph_captures_total{cause}``): the
first graph of a padded size (vLLM's batch descriptor), a new layout of the executor's levels at
a size seen before, the same size and layout at other addresses (a scratch buffer or vLLM input
moved), or a graph captured before and evicted. A run whose graphs replay less than it should
says by these which part of the key kept changing.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from .. import stats
from ..step import session
from .capture import GraphCache

logger = logging.getLogger("vllm.cascade_plugin")

CAPTURE_AFTER = 1  # the first time a key comes (after one eager cascade decode step)
MAX_GRAPHS = 64  # per runner; beyond it the least recently replayed graph is destroyed
MAX_SIGHTINGS = 1024
MAX_REMEMBERED = 4096  # captured keys remembered for the causes (then forgotten all at once)
# Why a whole-step graph was captured (stats.record_capture_cause).
NEW_SIZE, NEW_LAYOUT, NEW_ADDRESSES, EVICTED = ("padded size", "level layout",
                                                "buffer addresses", "evicted before")

_ALL: weakref.WeakSet[StepGraphs] = weakref.WeakSet()


def graph_stats() -> dict[str, int]:
    """Whole-step graphs in this process: captured, replayed and evicted so far, held now,
    captures skipped for want of free GPU memory, and the bytes of their memory pools."""
    graphs = list(_ALL)
    return {"full_graph_captures": sum(g.captures for g in graphs),
            "full_graph_replays": sum(g.replays for g in graphs),
            "full_graph_evictions": sum(g.evictions for g in graphs),
            "full_graphs_held": sum(len(g) for g in graphs),
            "full_graph_captures_skipped": sum(g.skipped for g in graphs),
            "full_graph_pool_bytes": sum(g.pool_bytes() for g in graphs)}


def _ptr(value: Any) -> Any:
    """A tensor's (address, shape, stride); anything else as it is (None, ints)."""
    if hasattr(value, "data_ptr"):
        return (value.data_ptr(), tuple(value.shape), tuple(value.stride()))
    return value


class StepGraphs(GraphCache):
    """The whole-step graphs of one runner (the bookkeeping is :class:`~vllm_cascade_plugin.
    graphs.capture.GraphCache`'s).

    ``eager_mode``: the forward context's ``cudagraph_runtime_mode`` under which vLLM's wrappers
    run their own code (vLLM's ``CUDAGraphMode.NONE``), set while a step is captured.
    """

    def __init__(self, eager_mode: Any, capture: Callable[..., Any] | None = None,
                 capture_after: int = CAPTURE_AFTER, max_graphs: int = MAX_GRAPHS) -> None:
        super().__init__(capture, capture_after, max_graphs, MAX_SIGHTINGS)
        self.eager_mode = eager_mode
        self.failed = False
        self._captured: set[tuple[Any, ...]] = set()  # keys, (size, layout)s and sizes captured
        _ALL.add(self)

    def _count_cause(self, key: tuple[Any, ...], size: Any, layout: Any) -> None:
        if len(self._captured) > MAX_REMEMBERED:
            self._captured.clear()
        seen = self._captured
        cause = (EVICTED if ("key", key) in seen else NEW_SIZE if ("size", size) not in seen
                 else NEW_LAYOUT if ("layout", size, layout) not in seen else NEW_ADDRESSES)
        stats.record_capture_cause(cause)
        seen.update((("key", key), ("size", size), ("layout", size, layout)))

    def run(self, forward: Callable[[], Any], ctx: Any, inputs: dict[str, Any],
            parallel_sizes: tuple[int, ...], tag: Any) -> Any:
        """``forward()`` (the runner's model call), or its graph."""
        if self.failed:
            return forward()
        try:
            found = eligible(ctx, inputs, parallel_sizes)
        except Exception as exc:  # never the step's failure
            stats.record_fallback("full graph check error", f"{type(exc).__name__}: {exc}")
            found = None
        if found is None:
            return forward()
        executor, layers, key_parts = found
        key = (tag, *key_parts)
        replay = self._replay(key)
        if replay is not None:
            stats.record_graphed_step()
            return replay()
        if not self._due(key):
            return forward()
        runs_before = executor.runs
        fallbacks_before = sum(stats.snapshot().fallbacks.values())
        try:
            replay, output = self._capture(forward, ctx)
        except Exception as exc:
            self.failed = True
            self.clear()
            stats.record_capture_failure()
            session.graphs_lost()
            logger.warning("vllm-cascade-plugin: capturing a whole cascade decode step in a CUDA "
                           "graph failed (%s: %s); cascade steps run vLLM's piecewise path from "
                           "now on.", type(exc).__name__, exc)
            return forward()  # the capture ran nothing: this is the step's only run
        ran = executor.runs - runs_before
        fell_back = sum(stats.snapshot().fallbacks.values()) - fallbacks_before
        if ran != layers or fell_back:
            # A layer ran flat attention (per-step metadata) inside the graph: never replay it.
            stats.record_fallback("full graph discarded",
                                  f"{ran} of {layers} layers ran cascade, {fell_back} fallbacks")
            return output  # this step's result is right: the graph ran once, as captured
        self._keep(key, replay)
        self._count_cause(key, key_parts[0], getattr(executor._step, "layout_key", None))
        return output

    def _capture(self, forward: Callable[[], Any], ctx: Any) -> tuple[Callable[[], Any], Any]:
        saved = ctx.cudagraph_runtime_mode
        ctx.cudagraph_runtime_mode = self.eager_mode  # vLLM's wrappers run their code
        try:
            return self._capture_with(forward)
        finally:
            ctx.cudagraph_runtime_mode = saved


def eligible(ctx: Any, inputs: dict[str, Any],
             parallel_sizes: tuple[int, ...]) -> tuple[Any, int, tuple[Any, ...]] | None:
    """(executor, attention layers, key parts) when this step may run from a whole-step graph,
    else None. Host data only."""
    step = session.current
    if step is None or not step.decision.use_cascade or not step.decode:
        return None
    if any(size != 1 for size in parallel_sizes):
        return None
    if inputs.get("inputs_embeds") is not None or inputs.get("intermediate_tensors") is not None:
        return None
    if any(v is not None and not hasattr(v, "data_ptr") for v in inputs.values()):
        return None  # only tensors can be named by their addresses
    metadata = ctx.attn_metadata
    if not isinstance(metadata, dict) or not metadata:
        return None  # a list: microbatches
    executors = {id(getattr(md, "cascade", None)) for md in metadata.values()}
    first = next(iter(metadata.values()))
    executor = getattr(first, "cascade", None)
    if executor is None or len(executors) != 1:
        return None
    graph_key = getattr(getattr(executor, "_step", None), "graph_key", None)
    if graph_key is None or not hasattr(executor, "runs"):
        return None  # not a graphed FA3 decode step: its metadata is not static
    name = next(iter(metadata))
    layer = ctx.no_compile_layers.get(name)
    kv_cache = getattr(layer, "kv_cache", None)
    views = getattr(getattr(layer, "impl", None), "_cascade_kv_views", None)
    if kv_cache is None or views is None or first.cascade_max_page >= views[1].shape[0]:
        return None
    slots = ctx.slot_mapping
    slot_parts = tuple(sorted((k, _ptr(v)) for k, v in slots.items())) if isinstance(
        slots, dict) else _ptr(slots)
    key = (ctx.batch_descriptor, first.cascade_rows, graph_key,
           tuple(sorted((k, _ptr(v)) for k, v in inputs.items())), slot_parts, _ptr(kv_cache),
           len(metadata))
    return executor, len(metadata), key
