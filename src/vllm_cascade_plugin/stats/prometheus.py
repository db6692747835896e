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
"""

from __future__ import annotations

import sys
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from .counters import PATH_OTHER
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

    def planned(self, decode: bool) -> None:
        self.steps_planned.inc()
        if decode:
            self.decode_steps_planned.inc()

    def cascade(self, pages_flat: int, pages_cascade: int, decode: bool, page_bytes: int) -> None:
        self.steps_cascade.inc()
        if decode:
            self.decode_steps_cascade.inc()
        self.kv_pages_flat.inc(pages_flat)
        self.kv_pages_cascade.inc(pages_cascade)
        if page_bytes and pages_flat > pages_cascade:
            self.kv_bytes_saved.inc((pages_flat - pages_cascade) * page_bytes)

    def graphed(self) -> None:
        self.decode_steps_graphed.inc()

    def captured(self, seconds: float) -> None:
        self.graph_captures.inc()
        self.graph_capture_seconds.inc(seconds)

    def _child(self, metric: Any, label: str) -> Any:
        child = self._children.get((id(metric), label))
        if child is None:
            child = self._children[(id(metric), label)] = metric.labels(self._rank, label)
        return child

    def capture_cause(self, cause: str) -> None:
        self._child(self._full_graph_captures, cause).inc()

    def pool_bytes(self, total: int) -> None:
        self.graph_pool_bytes.set(total)

    def planning(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        self.planning_seconds.inc(seconds)
        self.planning_cpu_seconds.inc(cpu_seconds)

    def builder(self, seconds: float, staging_seconds: float = 0.0,
                cpu_seconds: float = 0.0, launch_seconds: float = 0.0) -> None:
        self.builder_seconds.inc(seconds)
        self.builder_staging_seconds.inc(staging_seconds)
        self.builder_launch_seconds.inc(launch_seconds)
        self.builder_cpu_seconds.inc(cpu_seconds)

    def ended(self, planning_s: float, flat_reason: str | None, decode: bool,
              ratio: float | None, path: str = PATH_OTHER) -> None:
        """A planned step ended: its planning time and path; flat (with its reason) or cascade
        (None)."""
        self.step_planning_seconds.observe(planning_s)
        self._child(self._planning_path_steps, path).inc()
        self._child(self._planning_path_seconds, path).inc(planning_s)
        if flat_reason is None:
            return
        self._child(self._flat_steps, flat_reason).inc()
        if decode:
            self._child(self._decode_flat_steps, flat_reason).inc()
        if ratio is not None:
            self._child(self._flat_cost_ratio, flat_reason).inc(ratio)

    def capture_failure(self) -> None:
        self.graph_capture_failures.inc()

    def fallback(self, reason: str) -> None:
        self._child(self._fallbacks, reason).inc()
