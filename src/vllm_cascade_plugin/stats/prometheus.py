"""The plugin's counters as Prometheus metrics, in the worker processes that count them.

vLLM serves ``/metrics`` from its API server process, while the plugin counts in the processes
that run the model (the engine core, or one worker per GPU). ``prometheus_client`` joins processes
only in its multiprocess mode: when ``PROMETHEUS_MULTIPROC_DIR`` names a folder in the environment
vLLM starts in, every process writes its metrics there and ``/metrics`` adds them up. vLLM sets it
itself for ``--api-server-count`` > 1; otherwise set it to an empty folder before ``vllm serve``.
Without it these counters stay in the worker's own registry and ``/metrics`` never shows them.

Every series carries ``tp_rank``: tensor-parallel workers plan the same steps, so count steps on
``tp_rank="0"`` and sum bytes over all ranks (each rank reads its own share of the KV heads).
Flat steps carry their ``reason`` (one of a few fixed strings: ``counters.FLAT_REASONS`` and the
fallbacks' reasons); per-step planning time is a histogram in fixed buckets
(``histogram.BOUNDS_S``), whose percentiles ``histogram.quantile`` reads.

The worker counts in plain Python (:mod:`vllm_cascade_plugin.stats`) and publishes what it counted
here in batches (:meth:`PrometheusCounters.publish`): in multiprocess mode every ``inc`` is a
locked write to a memory-mapped file, about ten of them per step.
"""

from __future__ import annotations

import sys
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from .counters import Counters
from .histogram import BOUNDS_S

PREFIX = "vllm_cascade_"


def _tp_rank() -> str:
    # A vLLM worker has imported (and initialised) vLLM's parallel state before its first step;
    # anywhere else there is a single worker and nothing to import.
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    try:
        return str(parallel_state.get_tensor_model_parallel_rank()) if parallel_state else "0"
    except Exception:  # imported but not initialised: not a worker
        return "0"


class PrometheusCounters:
    """One set of counters per process, mirroring :class:`vllm_cascade_plugin.stats.Counters`."""

    def __init__(self, registry: CollectorRegistry = REGISTRY, tp_rank: str | None = None):
        rank = _tp_rank() if tp_rank is None else tp_rank

        def counter(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Any:
            made = Counter(PREFIX + name, documentation, ["tp_rank", *labels], registry=registry)
            return made if labels else made.labels(rank)

        self._rank = rank
        # Labelled series by (metric, label): prometheus_client's labels() takes a lock and
        # builds a key on every call, and a step counts several.
        self._children: dict[tuple[int, str], Any] = {}
        self.steps_planned = counter("steps_planned", "Engine steps the cascade planner saw.")
        self.steps_cascade = counter("steps_cascade", "Engine steps that ran cascade attention.")
        self.decode_steps_planned = counter(
            "decode_steps_planned", "Pure-decode engine steps the cascade planner saw.")
        self.decode_steps_cascade = counter(
            "decode_steps_cascade", "Pure-decode engine steps that ran cascade attention.")
        self.decode_steps_graphed = counter(
            "decode_steps_graphed",
            "Cascade decode steps whose attention replayed a CUDA graph (whole step or layers).")
        self.graph_capture_failures = counter(
            "graph_capture_failures", "CUDA-graph captures of cascade steps that failed.")
        self.graph_captures = counter(
            "graph_captures", "CUDA graphs of cascade steps captured (whole steps or layers).")
        self._full_graph_captures = counter(
            "full_graph_captures", "Whole-step CUDA graphs of cascade decode steps captured, by "
            "what was new in their key (padded size, level layout, buffer addresses, evicted "
            "before).", ("cause",))
        self.graph_capture_seconds = counter(
            "graph_capture_seconds", "Host seconds spent capturing those CUDA graphs.")
        self.planning_seconds = counter(
            "planning_seconds", "Host seconds planning the planned steps took (runner hooks, "
            "planner, cost model).")
        self.planning_cpu_seconds = counter(
            "planning_cpu_seconds", "Of planning_seconds, the time the planning thread ran on a "
            "CPU (the rest it waited: for the GIL or the CPU).")
        self.step_planning_seconds = Histogram(
            PREFIX + "step_planning_seconds", "Host seconds each planned step's planning took.",
            ["tp_rank"], buckets=BOUNDS_S, registry=registry).labels(rank)
        self.builder_seconds = counter(
            "builder_seconds", "Host seconds the metadata builders took planning cascade "
            "executors.")
        self.builder_staging_seconds = counter(
            "builder_staging_seconds", "Of builder_seconds, the time staging the plans for the "
            "device (pinned host copies, upload launches).")
        self.builder_launch_seconds = counter(
            "builder_launch_seconds", "Of builder_staging_seconds, the uploads' launches (CUDA "
            "calls: copies and the events that guard the pinned host buffers).")
        self.builder_cpu_seconds = counter(
            "builder_cpu_seconds", "Of builder_seconds, the time the builders' thread ran on a "
            "CPU (the rest it waited: for the GIL or the CPU).")
        self._flat_steps = counter(
            "flat_steps", "Planned steps that ran flat attention, by their one reason.",
            ("reason",))
        self._decode_flat_steps = counter(
            "decode_flat_steps", "Pure-decode planned steps that ran flat attention, by reason.",
            ("reason",))
        self._planning_path_steps = counter(
            "planning_path_steps", "Planned steps by how their planning went: stopped by a "
            "pre-check, or planned continuing the last step, following it, or from scratch.",
            ("path",))
        self._planning_path_seconds = counter(
            "planning_path_seconds", "Host seconds planning the planned steps took, by how "
            "their planning went (divided by planning_path_steps, the mean).", ("path",))
        self._flat_cost_ratio = counter(
            "flat_cost_ratio", "Over steps the cost model kept flat: the cascade/flat time it "
            "predicted, summed per reason (divided by flat_steps, the mean).", ("reason",))
        # A level per process; /metrics adds up the live processes (each GPU's worker).
        self.graph_pool_bytes = Gauge(
            PREFIX + "graph_pool_bytes", "GPU memory the plugin's CUDA-graph pools hold.",
            ["tp_rank"], registry=registry, multiprocess_mode="livesum").labels(rank)
        self._fallbacks = counter(
            "fallbacks", "Fallbacks to flat attention (a step's, a builder's or a layer call's), "
            "by reason.",
            ("reason",))
        self.kv_pages_flat = counter(
            "kv_pages_flat", "KV pages flat attention would have read on the cascade steps.")
        self.kv_pages_cascade = counter(
            "kv_pages_cascade", "KV pages cascade attention read on the cascade steps.")
        self.kv_bytes_saved = counter(
            "kv_bytes_saved",
            "KV-cache bytes cascade attention did not read, over all layers of this worker.")
        # Counters field -> metric, for publish().
        self._plain = (
            ("steps_planned", self.steps_planned), ("steps_cascade", self.steps_cascade),
            ("decode_steps_planned", self.decode_steps_planned),
            ("decode_steps_cascade", self.decode_steps_cascade),
            ("decode_steps_graphed", self.decode_steps_graphed),
            ("graph_capture_failures", self.graph_capture_failures),
            ("graph_captures", self.graph_captures),
            ("graph_capture_s", self.graph_capture_seconds),
            ("planning_s", self.planning_seconds), ("planning_cpu_s", self.planning_cpu_seconds),
            ("builder_s", self.builder_seconds),
            ("builder_staging_s", self.builder_staging_seconds),
            ("builder_launch_s", self.builder_launch_seconds),
            ("builder_cpu_s", self.builder_cpu_seconds),
            ("pages_flat", self.kv_pages_flat), ("pages_cascade", self.kv_pages_cascade))
        self._labelled = (
            ("flat_reasons", self._flat_steps), ("decode_flat_reasons", self._decode_flat_steps),
            ("planning_paths", self._planning_path_steps),
            ("planning_path_s", self._planning_path_seconds),
            ("flat_cost_ratio", self._flat_cost_ratio), ("fallbacks", self._fallbacks),
            ("full_graph_capture_causes", self._full_graph_captures))
        self._pool_bytes = 0
        self._bulk: bool | None = None  # whether _observe adds to the histogram's own counts

    def publish(self, d: Counters, page_bytes: int) -> None:
        """Add what was counted since the last publication (``d``, a :func:`~.counters.difference`;
        its levels: now's) to the metrics. ``page_bytes``: bytes of one KV page over every
        layer a plan serves (0: unknown, no bytes counted)."""
        for name, metric in self._plain:
            value = getattr(d, name)
            if value:
                metric.inc(value)
        saved = d.pages_flat - d.pages_cascade
        if page_bytes and saved > 0:
            self.kv_bytes_saved.inc(saved * page_bytes)
        for name, metric in self._labelled:
            for label, value in getattr(d, name).items():
                if value:
                    self._child(metric, label).inc(value)
        if any(d.planning_buckets):
            self._observe(d.planning_buckets, sum(d.planning_path_s.values()))
        if d.graph_pool_bytes != self._pool_bytes:
            self._pool_bytes = d.graph_pool_bytes
            self.graph_pool_bytes.set(d.graph_pool_bytes)

    def _observe(self, counts: list[int], seconds: float) -> None:
        """``counts[i]`` steps in bucket ``i`` of the planning histogram, ``seconds`` in all.
        prometheus_client's histogram stores a count per bucket and a sum, which are added to
        directly where they are as this code knows them (checked once); else one observation
        per step at its bucket's bound."""
        h = self.step_planning_seconds
        if self._bulk is None:
            buckets = getattr(h, "_buckets", None)
            self._bulk = (isinstance(buckets, list) and len(buckets) == len(counts)
                          and hasattr(h, "_sum") and list(getattr(h, "_upper_bounds", ()))
                          == [*BOUNDS_S, float("inf")])
        if self._bulk:
            for i, n in enumerate(counts):
                if n:
                    h._buckets[i].inc(n)
            h._sum.inc(seconds)
            return
        for bound, n in zip([*BOUNDS_S, BOUNDS_S[-1] * 2], counts, strict=True):
            for _ in range(n):
                h.observe(bound)

    def _child(self, metric: Any, label: str) -> Any:
        child = self._children.get((id(metric), label))
        if child is None:
            child = self._children[(id(metric), label)] = metric.labels(self._rank, label)
        return child
