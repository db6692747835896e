"""What the plugin counts in one process (:class:`Counters`), and the reasons a planned step ran
flat (:data:`FLAT_REASONS`). Standard library only.

Every planned step ends as exactly one of: a cascade step (``steps_cascade``) or a flat step
with one reason (``flat_reasons``), so ``steps_planned == steps_cascade + sum(flat_reasons)``
once the last step has ended (and the same for decode steps). ``fallbacks`` counts something
else: every fallback to flat attention, per layer call or builder, several in one step possible.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .histogram import BOUNDS_S

# The reasons a planned step runs flat that the step session decides (``step``). A step that
# falls back runs flat for the reason of its first fallback (``record_fallback``), e.g.
# "planner error", "kernel planning error", "plan does not match the batch".
NO_SHARED = "no shared level"  # no two rows share a page (min_shared_pages of them)
SINGLE = "single request"  # a step of one row: nothing to share with
COST_MODEL = "cost model"  # a decode step the cost model predicts no faster as cascade
NOT_CAPTURED = "graph layout not yet captured"  # ... at the eager cost of a layout seen first
MIXED = "mixed prefill+decode step"  # rows of one and of several query tokens (eager cost)
MULTI_TOKEN = "multi-token step"  # every row several query tokens: prefill, spec. verification
UNUSED = "cascade plan not run"  # cascade chosen, but no builder ran it and nothing fell back
FLAT_REASONS = (NO_SHARED, SINGLE, COST_MODEL, NOT_CAPTURED, MIXED, MULTI_TOKEN, UNUSED)
# The reasons decided by the cost model: their steps carry the cascade/flat time it predicted.
COST_REASONS = (COST_MODEL, NOT_CAPTURED, MIXED, MULTI_TOKEN)
# How a planned step's planning went (its path): stopped by a pre-check of the runner hooks
# (the rows' first block ids share nothing; the cost model's floor cannot beat flat), or planned
# by the planner (``planning.planner.CascadePlanner.last_path``): the last step's decode rows
# continued, the rows followed in the last step's prefix trie, or a trie built from scratch;
# the last step's decode rows continued and kept flat as it was, without a plan
# (``StepSession.continued_flat``); "other": none of these (a step the hooks ran flat before
# planning, or one that failed).
PATH_UNSHARED, PATH_COST_FLOOR = "pre-check: nothing shared", "pre-check: cost floor"
PATH_CONTINUED, PATH_FOLLOWED, PATH_SCRATCH = "continued", "followed", "from scratch"
PATH_KEPT_FLAT = "continued, kept flat"
PATH_HELD = "held flat"
PATH_OTHER = "other"
PLAN_PATHS = (PATH_UNSHARED, PATH_COST_FLOOR, PATH_CONTINUED, PATH_KEPT_FLAT, PATH_HELD,
              PATH_FOLLOWED, PATH_SCRATCH, PATH_OTHER)


@dataclass
class Counters:
    steps_planned: int = 0  # real engine steps the planner looked at
    steps_cascade: int = 0  # of those, steps whose attention ran as cascade
    decode_steps_planned: int = 0  # of those planned: pure-decode steps (one token per row)
    decode_steps_cascade: int = 0  # of those run as cascade: pure-decode steps
    decode_steps_graphed: int = 0  # of those: replayed from a CUDA graph (whole step or layers)
    graph_capture_failures: int = 0  # CUDA-graph captures that failed (each turns graphs off)
    graph_captures: int = 0  # CUDA graphs the plugin captured (whole steps or single layers)
    graph_capture_s: float = 0.0  # host time those captures took: the steps they delayed
    planning_s: float = 0.0  # host time planning the planned steps took (see the ``step`` package)
    # Of that, the time the planning thread ran on a CPU: the rest it waited (for the GIL,
    # which vLLM's other threads in the process hold meanwhile, or for the CPU itself).
    planning_cpu_s: float = 0.0
    builder_s: float = 0.0  # host time the metadata builders took planning cascade executors
    # Of that, staging the plans for the device: pinned host copies and the uploads' launches
    # (CUDA calls, which may wait on the driver), the rest being Python and numpy.
    builder_staging_s: float = 0.0
    # Of the staging, the launches: copy calls and the events that guard the pinned buffers.
    builder_launch_s: float = 0.0
    # And the time the builders' thread ran on a CPU: the rest it waited, e.g. for the GIL,
    # which a torch call releases and another thread may then hold for a switch interval.
    builder_cpu_s: float = 0.0
    graph_pool_bytes: int = 0  # GPU memory the plugin's CUDA-graph pools hold now (a level)
    pages_flat: int = 0  # KV pages flat attention would have read, over cascade steps
    pages_cascade: int = 0  # KV pages the cascade read instead, over cascade steps
    fallbacks: Counter[str] = field(default_factory=Counter)  # fallbacks to flat, by reason
    flat_reasons: Counter[str] = field(default_factory=Counter)  # flat steps, one reason each
    decode_flat_reasons: Counter[str] = field(default_factory=Counter)  # of those, decode
    # Whole-step CUDA graphs captured, by what was new in their key (graphs.fullgraph).
    full_graph_capture_causes: Counter[str] = field(default_factory=Counter)
    # Over the flat steps of each reason in COST_REASONS: the predicted cascade/flat time, summed
    # (divided by flat_reasons[reason], its mean; the cost model wants below 1 / (1 + margin)).
    flat_cost_ratio: dict[str, float] = field(default_factory=dict)
    # Ended planned steps by their planning time, in the buckets of histogram.BOUNDS_S.
    planning_buckets: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS_S) + 1))
    # Ended planned steps by their planning path (PLAN_PATHS), and their planning seconds.
    planning_paths: Counter[str] = field(default_factory=Counter)
    planning_path_s: dict[str, float] = field(default_factory=dict)

    @property
    def host_s(self) -> float:
        """The plugin's host time on its steps: planning, the builders' executor planning and
        CUDA-graph captures (not the per-layer Python of cascade layers)."""
        return self.planning_s + self.builder_s + self.graph_capture_s


def plain(counters: Counters) -> dict[str, Any]:
    """The counters as builtin types only (dict, list, int, float, str): what a function run in
    vLLM's engine process through ``collective_rpc`` may return. vLLM's serializer records each
    value's exact type and rebuilds it with msgspec, which cannot rebuild a ``Counter``; the
    client's output handler then dies and every request in flight hangs."""
    out: dict[str, Any] = {}
    for f in fields(counters):
        value = getattr(counters, f.name)
        out[f.name] = dict(value) if isinstance(value, dict) else (
            list(value) if isinstance(value, list) else value)
    return out


def copy(counters: Counters) -> Counters:
    return replace(counters, fallbacks=Counter(counters.fallbacks),
                   flat_reasons=Counter(counters.flat_reasons),
                   decode_flat_reasons=Counter(counters.decode_flat_reasons),
                   full_graph_capture_causes=Counter(counters.full_graph_capture_causes),
                   flat_cost_ratio=dict(counters.flat_cost_ratio),
                   planning_buckets=list(counters.planning_buckets),
                   planning_paths=Counter(counters.planning_paths),
                   planning_path_s=dict(counters.planning_path_s))


def difference(now: Counters, before: Counters) -> Counters:
    """What was counted between ``before`` and ``now`` (levels: ``now``'s)."""
    return Counters(
        steps_planned=now.steps_planned - before.steps_planned,
        steps_cascade=now.steps_cascade - before.steps_cascade,
        decode_steps_planned=now.decode_steps_planned - before.decode_steps_planned,
        decode_steps_cascade=now.decode_steps_cascade - before.decode_steps_cascade,
        decode_steps_graphed=now.decode_steps_graphed - before.decode_steps_graphed,
        graph_capture_failures=now.graph_capture_failures - before.graph_capture_failures,
        graph_captures=now.graph_captures - before.graph_captures,
        graph_capture_s=now.graph_capture_s - before.graph_capture_s,
        planning_s=now.planning_s - before.planning_s,
        planning_cpu_s=now.planning_cpu_s - before.planning_cpu_s,
        builder_s=now.builder_s - before.builder_s,
        builder_staging_s=now.builder_staging_s - before.builder_staging_s,
        builder_launch_s=now.builder_launch_s - before.builder_launch_s,
        builder_cpu_s=now.builder_cpu_s - before.builder_cpu_s,
        graph_pool_bytes=now.graph_pool_bytes,  # a level, not a count
        pages_flat=now.pages_flat - before.pages_flat,
        pages_cascade=now.pages_cascade - before.pages_cascade,
        fallbacks=now.fallbacks - before.fallbacks,
        flat_reasons=now.flat_reasons - before.flat_reasons,
        decode_flat_reasons=now.decode_flat_reasons - before.decode_flat_reasons,
        full_graph_capture_causes=(now.full_graph_capture_causes
                                   - before.full_graph_capture_causes),
        flat_cost_ratio={reason: total - before.flat_cost_ratio.get(reason, 0.0)
                         for reason, total in now.flat_cost_ratio.items()
                         if total != before.flat_cost_ratio.get(reason, 0.0)},
        planning_buckets=[a - b for a, b in zip(now.planning_buckets, before.planning_buckets,
                                                strict=True)],
        planning_paths=now.planning_paths - before.planning_paths,
        planning_path_s={path: total - before.planning_path_s.get(path, 0.0)
                         for path, total in now.planning_path_s.items()
                         if total != before.planning_path_s.get(path, 0.0)},
    )
