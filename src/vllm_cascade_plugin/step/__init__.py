"""What one worker process knows between the runner's step hook and the metadata builders.

The runner hook (see :mod:`.integration.hooks`) plans each real engine step *before* vLLM
picks the step's CUDA-graph mode, because a step that runs cascade must not replay a FULL graph of
flat attention. It plans once per step, from the one block table of the step's KV-cache group.
That group can hold several attention groups, each with a metadata builder of its own (vLLM
splits a group's layers by KV-cache spec and head count: sliding-window layers next to
full-attention ones, say). Each builder registers its own :class:`BuilderSettings`; the session
plans with the first builder's that can run cascade, and each builder's ``build()``, later in the
same step, takes the plan only if its own layers can run cascade, the plan was made for their
page size and shape, and it describes exactly the batch it is given (rows, tokens and sequence
lengths). Any other builder builds vLLM's flat metadata. A mixed prefill+decode step is planned
for its decode rows alone where the executor splits such steps (``split_cost_model``: the decode
rows run as cascade, the others flat). numpy only: no vLLM import here.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from .. import stats
from ..config import CascadeConfig
from ..planning.compiled import compile_once
from ..planning.cost import AttentionShape, CostModel, Decision, decide
from ..planning.invariants import plan_violations
from ..planning.plan import CascadePlan
from ..planning.planner import CascadePlanner, nothing_shared
from ..stats.counters import COST_MODEL, MIXED, NOT_CAPTURED
from .layouts import STEADY, GraphLayouts
from .plan import BuilderSettings, StepPlan, flat_attention, flat_reason, unshared_reason
from .prechecks import PreChecks

__all__ = ["BuilderSettings", "StepPlan", "StepSession", "session"]


class StepSession(PreChecks, GraphLayouts):
    """Per-process planning state: every builder's settings, the settings steps are planned
    with, and the current step's plan."""

    def __init__(self) -> None:
        # Every live builder's settings by its layer names, in the order the builders came.
        self._builders: dict[tuple[str, ...], BuilderSettings] = {}
        # The settings steps are planned with (see register()).
        self.config: CascadeConfig | None = None
        self.shape: AttentionShape | None = None
        self.page_size = 0
        self.disabled_reason: str | None = "no cascade metadata builder yet"
        self.cost_model = CostModel()
        self.steady_cost_model: CostModel | None = None
        self.split_cost_model: CostModel | None = None
        self.current: StepPlan | None = None
        # vLLM's padded token count of the current step (its CUDA-graph capture size), set by
        # the runner hooks once vLLM has dispatched the step; 0: not known.
        self.padded_tokens = 0
        self._capture_sizes: tuple[int, ...] = ()
        self._planner: CascadePlanner | None = None
        # The layers of the builder steps are planned with: their KV-cache group's block table
        # is the one planned, where the engine has several (see the runner hooks).
        self.planning_layers: frozenset[str] = frozenset()
        self._layer_graphs_cost_model: CostModel | None = None
        # The last planned step's flat verdict while the next decode step keeps it
        # (:meth:`~.prechecks.PreChecks.continued_flat`): (cost model, cascade estimate (µs),
        # pages flat decode reads again past the L2 window, reason); None: none to keep.
        self._flat_held: tuple[CostModel, float, int, str] | None = None
        self._hold_ratio: float | None = None  # _decide's COST_MODEL verdict's, for hold_verdict
        self._hold: tuple[int, int, float] | None = None
        self.init_layouts()

    def register(self, layers: Sequence[str], settings: BuilderSettings) -> None:
        """A new metadata builder for ``layers`` and its settings.

        It replaces the builder of any of those layers (vLLM makes its builders again after
        profiling). Steps are then planned with the settings of the first builder, in the order
        they came, that can run cascade; with none, the session is off. Why a builder cannot is
        logged once per builder's layers (vLLM makes its builders again after profiling; a model
        under the hybrid KV-cache manager has a builder per group, Gemma 3 several sliding-window
        ones): its layers run flat whatever the others do.
        """
        names = tuple(layers)
        # A new dict, not one changed in place: tests restore the session from a shallow copy.
        builders = {key: value for key, value in self._builders.items()
                    if not set(key) & set(names)}
        builders[names] = settings
        self._builders = builders
        if settings.unsupported is not None:
            stats.log_once(f"disabled:{settings.unsupported}:{names}",
                           "vllm-cascade-plugin: cascade attention is off for %d attention "
                           "layer(s) (%s): %s; they run %s.",
                           len(names), ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
                           settings.unsupported, flat_attention(settings.backend))
        planning = next((b for b in builders.values() if b.unsupported is None),
                        next(iter(builders.values())))
        self._apply(planning)
        # The layers a cascade step serves: every builder the plan is for.
        stats.set_page_bytes(sum(
            b.page_bytes for b in builders.values()
            if b.unsupported is None and (b.page_size, b.shape) == (planning.page_size,
                                                                    planning.shape)))

    def configure(self, config: CascadeConfig, shape: AttentionShape, page_size: int,
                  disabled_reason: str | None, cost_model: CostModel | None = None,
                  steady_cost_model: CostModel | None = None,
                  capture_sizes: Sequence[int] = (),
                  split_cost_model: CostModel | None = None) -> None:
        """Plan steps for attention of this shape and page size, or not at all (a reason).

        What :meth:`register` does with a builder's settings; for a session without builders
        (tests, benchmarks). ``cost_model``: the calibration of the executor the builder will
        run (default: FlashInfer's). ``steady_cost_model``: the same executor on a decode step
        its CUDA graphs replay, charged to a decode step whose graph layout
        (:func:`~vllm_cascade_plugin.planning.graph_layout.graph_shape`, the key of the executor's
        graphs) an earlier planned step had: the executor captures a layout's graphs the first
        time it runs one (None: ``cost_model`` for every step). ``capture_sizes``: vLLM's
        CUDA-graph capture sizes, to which it pads a step's tokens. ``split_cost_model``: the
        executor's cost of a mixed step run split (None: it does not split them).
        """
        self._apply(BuilderSettings(config, shape, page_size, disabled_reason,
                                    cost_model or CostModel(), steady_cost_model,
                                    tuple(capture_sizes), split_cost_model=split_cost_model))
        if disabled_reason is not None:
            stats.log_once(f"disabled:{disabled_reason}",
                           "vllm-cascade-plugin: cascade attention is off for this model: %s; "
                           "every step runs vLLM's flat attention.", disabled_reason)

    def _apply(self, settings: BuilderSettings) -> None:
        """Plan steps with ``settings`` from now on."""
        config = settings.config
        self.config, self.shape, self.page_size = config, settings.shape, settings.page_size
        self.cost_model = settings.cost_model
        self.steady_cost_model = settings.steady_cost_model
        self.split_cost_model = settings.split_cost_model
        self.planning_layers = settings.layers
        self._layer_graphs_cost_model = settings.layer_graphs_cost_model
        self._capture_sizes = tuple(sorted(settings.capture_sizes))
        self._layouts_owed = {}
        self._hold = None
        self.disabled_reason = settings.unsupported
        self._planner = CascadePlanner(max_levels=config.max_levels,
                                       min_shared_pages=config.min_shared_pages)
        if settings.unsupported is None:
            done, seconds, why = compile_once()
            if done:
                stats.log_once("compiled", "vllm-cascade-plugin: the step pre-checks are "
                               "compiled (numba, %.2f s; cached on disk for the next start).",
                               seconds)
            else:
                stats.log_once("compiled", "vllm-cascade-plugin: numba did not compile the step "
                               "pre-checks (%s); they run in numpy, a little slower.", why,
                               level=logging.WARNING)

    @property
    def active(self) -> bool:
        return self.disabled_reason is None and self._planner is not None

    def continues(self, seq_lens: np.ndarray, query_lens: np.ndarray,
                  row_keys: np.ndarray | Callable[[], np.ndarray | None] | None,
                  row_index: np.ndarray | None) -> bool:
        """Whether the step is the last planned step's decode rows one token longer, which
        shared (:meth:`~.planning.planner.CascadePlanner.continues`; ``row_keys`` may be a
        function that reads them): :meth:`skip_unshared` and :meth:`cannot_win` would both
        answer False, and are not asked."""
        return (self.active and row_keys is not None and self._planner is not None
                and self._planner.continues(seq_lens, query_lens, row_keys, row_index))

    def flat_step(self, reason: str, query_lens: np.ndarray) -> None:
        """Count a real step the runner hooks cannot plan (``reason``, counted as a fallback)
        as planned and flat."""
        self.end_step()
        stats.record_planned(bool(np.all(np.asarray(query_lens) == 1)))
        stats.record_fallback(reason)

    def plan_step(self, block_table: np.ndarray,
                  seq_lens: np.ndarray, query_lens: np.ndarray,
                  row_keys: np.ndarray | None = None,
                  row_index: np.ndarray | None = None,
                  group_layers: frozenset[str] | None = None) -> StepPlan | None:
        """Plan a real engine step (rows in the builder's order); None: run it flat.

        ``block_table``: the rows' block ids; with ``row_index``, row ``r``'s are
        ``block_table[row_index[r]]``.
        ``group_layers``: the layers of the KV-cache group ``block_table`` is, where the engine
        has several (only their builders may run the plan); None: one group.
        ``row_keys``: which rows changed since the last step planned with them
        (:meth:`~.planning.planner.CascadePlanner.plan`), or None to compare the block ids.
        A failure here never escapes into vLLM: the step runs flat and the reason is counted.
        Why a step runs flat goes to the step's counters (``stats.flat_decision``).
        """
        self.current = None
        self._flat_held = None
        if not self.active:
            return None
        assert self._planner is not None and self.config is not None and self.shape is not None
        with stats.planning():
            decode = bool(np.all(query_lens == 1))
            stats.record_planned(decode)
            try:
                table = block_table
                split = self._split_lens(query_lens)  # a mixed step: its decode rows alone
                planned = query_lens if split is None else split
                plan = self._planner.plan(table, seq_lens, planned, self.page_size,
                                          row_keys, row_index)
                stats.plan_path(self._planner.last_path)
                if self.config.debug:
                    if row_index is not None:
                        table = table[row_index]
                    broken = plan_violations(plan, table, seq_lens, planned)
                    if (plan.num_levels > 1 and table.shape[1] > 0
                            and nothing_shared(table[:, 0], seq_lens, planned,
                                               self.page_size)):
                        broken.append("nothing_shared() would have skipped a step with sharing")
                    if broken:
                        stats.record_fallback("plan invariant violated", "; ".join(broken[:3]))
                        return None
                decision = self._decide(plan, query_lens, decode, split is not None)
                if decision.use_cascade:  # a mixed step too: sharing pays, hold nothing
                    self._hold = None
                self.hold_verdict(decode, len(query_lens), self._hold_ratio)
            except Exception as exc:  # the engine must never fail because of the planner
                stats.record_fallback("planner error", f"{type(exc).__name__}: {exc}")
                return None
            qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
            np.cumsum(query_lens, out=qsl[1:])
            self.current = StepPlan(plan, decision, qsl, decode,
                                    np.array(seq_lens, dtype=np.int32), self.page_size,
                                    self.shape, None if split is None else split.astype(bool),
                                    group_layers)
        if stats.logger.isEnabledFor(logging.DEBUG):
            stats.logger.debug(
                "cascade step: %s (%s); %d levels, groups %s, pages %d flat -> %d; totals %s",
                "cascade" if decision.use_cascade else "flat", decision.reason, plan.num_levels,
                plan.stats.group_sizes, plan.stats.pages_flat, plan.stats.pages_cascade,
                stats.snapshot())
        return self.current

    def _decide(self, plan: CascadePlan, query_lens: np.ndarray, decode: bool,
                split: bool = False) -> Decision:
        """Cascade or flat for ``plan``; a flat step's reason (and the cascade/flat time the
        cost model predicted) goes to the step's counters. ``split``: ``plan`` is a mixed
        step's decode rows alone, charged the split cost (``split_cost_model``).

        A decode step that could run from graphs is first charged the graphed cost, the least
        it can cost: flat even then, it is flat without its graph layout being worked out (most
        flat steps of a serving run). Only a step that wins with graphs looks its layout up,
        and pays the eager cost until its layout's graphs are worth capturing
        (:meth:`~.layouts.GraphLayouts.graph_state`)."""
        assert self.config is not None and self.shape is not None
        self._hold_ratio = None
        if plan.num_levels < 2:
            stats.flat_decision(unshared_reason(len(query_lens)))
            return Decision(False, 0.0, 0.0, "no shared pages")
        if self.config.policy == "always":
            return Decision(True, 0.0, 0.0, "CASCADE_POLICY=always")
        steady = self.steady_cost_model
        graphable = (decode and steady is not None
                     and self.graphable(plan.stats.num_tokens))
        if split:
            assert self.split_cost_model is not None
            decision = decide(plan, self.shape, self.split_cost_model)
            if decision.use_cascade and self.graph_state(plan, decision, split=True) == STEADY:
                return decision
            reason = MIXED
            if decision.use_cascade:  # a new layout of decode rows: its graphs not captured
                reason = NOT_CAPTURED
                decision = replace(decision, use_cascade=False,
                                   reason=f"{decision.reason}; a new split layout")
        elif graphable:
            assert steady is not None
            decision = decide(plan, self.shape, steady)
            if decision.use_cascade and self.graph_state(plan, decision) == STEADY:
                return decision
            if decision.use_cascade:  # a layout not worth its capture yet
                decision = decide(plan, self.shape, self.cost_model)
                if decision.use_cascade:  # wins even eagerly: runs (its graphs captured then)
                    self.steady_layout(plan)
                    return decision
                reason = NOT_CAPTURED
            else:
                reason = COST_MODEL
                self._flat_held = (steady, decision.cascade_us, decision.missed_pages, reason)
        else:
            decision = decide(plan, self.shape, self.cost_model)
            if decision.use_cascade:
                return decision
            # such steps never replay the plugin's graphs: always the eager cost
            reason = flat_reason(decode, query_lens)
            if decode:  # kept for the steps that continue it (continued_flat)
                self._flat_held = (self.cost_model, decision.cascade_us, decision.missed_pages,
                                   reason)
        ratio = decision.cascade_us / decision.flat_us if decision.flat_us > 0 else None
        stats.flat_decision(reason, ratio)
        if reason == COST_MODEL:
            self._hold_ratio = ratio
        return decision

    def padded(self, num_tokens: int) -> int:
        """The token count vLLM pads a step of ``num_tokens`` to: the smallest capture size
        that holds it (none beyond the largest, or without CUDA graphs)."""
        at = bisect.bisect_left(self._capture_sizes, num_tokens)
        return self._capture_sizes[at] if at < len(self._capture_sizes) else num_tokens

    def largest_graph_rows(self) -> int:
        """The most rows a step run from CUDA graphs can have: vLLM's largest capture size
        (0 where it is not known)."""
        return self._capture_sizes[-1] if self._capture_sizes else 0

    def graphable(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` may run from the plugin's CUDA graphs (per layer or
        whole step): vLLM pads it to one of its capture sizes. Above the largest, vLLM neither
        pads it nor runs its own graphs, and neither does the plugin: graphs keyed by the exact
        row count would be captured anew nearly every step while a batch shrinks a few rows at
        a time. Without known capture sizes (vLLM without CUDA graphs, where the executors have
        none either; tests) every size is."""
        return not self._capture_sizes or num_tokens <= self._capture_sizes[-1]

    def stand_down(self, reason: str) -> None:
        """Every later step runs flat for ``reason``, which holds for the engine's life (its
        KV-cache layout, its configuration): the session goes inactive, so the runner hooks
        neither plan nor count those steps. A builder registered later (vLLM makes them again)
        makes it active until a step meets the reason again."""
        self.disabled_reason = reason

    def whole_step_graphs_off(self) -> None:
        """The executor's whole-step graphs are not used in this engine (several KV-cache
        groups): charge a graphed decode step what per-layer graphs cost."""
        if self.steady_cost_model is not None and self._layer_graphs_cost_model is not None:
            self.steady_cost_model = self._layer_graphs_cost_model

    def graphs_lost(self) -> None:
        """The executor's graphs are off from now on (a capture failed): charge every step
        the eager cost, and split no mixed step (its decode rows would launch eagerly)."""
        self.steady_cost_model = None
        self.split_cost_model = None

    def step_for(self, settings: BuilderSettings, query_start_loc: np.ndarray,
                 num_actual_tokens: int, seq_lens: np.ndarray | None) -> StepPlan | None:
        """The current plan if it chose cascade and a builder with ``settings`` may run it on
        this batch (``seq_lens``: the batch's sequence lengths from host memory, None where
        vLLM gave none), else None: that builder builds vLLM's flat metadata."""
        step = self.current
        if step is None or not step.decision.use_cascade or settings.unsupported is not None:
            return None  # these layers' reason was logged when their builder came
        if not step.planned_for(settings):
            stats.log_once(f"not planned for:{settings.page_size}:{settings.shape}",
                           "vllm-cascade-plugin: attention layers of shape %s (page size %d) "
                           "run %s: steps are planned for other layers (%s, page size %d).",
                           settings.shape, settings.page_size, flat_attention(settings.backend),
                           step.shape, step.page_size)
            return None
        if seq_lens is None:  # nothing to check the plan's sequence lengths against
            stats.record_fallback("batch sequence lengths unknown")
            return None
        if not step.matches(query_start_loc, num_actual_tokens, seq_lens):
            stats.record_fallback("plan does not match the batch", level=logging.DEBUG)
            return None
        return step

    def end_step(self) -> None:
        """The step ends (the runner hooks, when ``execute_model`` returns): its plan is
        forgotten and its outcome counted (``stats.end_step``)."""
        self.current = None
        self.padded_tokens = 0
        self.note_captures()
        stats.end_step()


session = StepSession()
