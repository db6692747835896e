"""What one worker process knows between the runner's step hook and the metadata builder.

The runner hook (see :mod:`vllm_cascade_plugin.hooks`) plans each real engine step *before* vLLM
picks the step's CUDA-graph mode, because a step that runs cascade must not replay a FULL graph of
flat attention. The builder's ``build()`` runs later in the same step and takes the plan only if
it describes exactly the batch it is given. numpy only: no vLLM import here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from . import stats
from .config import CascadeConfig
from .cost import AttentionShape, CostModel, Decision, decide
from .planner import CascadePlan, CascadePlanner, nothing_shared, plan_violations


@dataclass(frozen=True, eq=False)
class StepPlan:
    plan: CascadePlan
    decision: Decision
    query_start_loc: np.ndarray  # int32 [num_reqs + 1], the batch this plan is for
    decode: bool  # every row has one query token

    @property
    def num_reqs(self) -> int:
        return len(self.query_start_loc) - 1

    def matches(self, query_start_loc: np.ndarray, num_actual_tokens: int) -> bool:
        """Same rows and tokens (rows past ours may only be padding with no tokens)."""
        n = self.num_reqs
        qsl = np.asarray(query_start_loc)
        total = int(self.query_start_loc[-1])
        return (len(qsl) >= n + 1 and num_actual_tokens == total
                and np.array_equal(qsl[: n + 1], self.query_start_loc)
                and bool(np.all(qsl[n + 1:] == total)))


# Consecutive decode steps of one shape after which the executor's per-layer CUDA graphs are
# expected to run them (it captures a shape's layers on the 3rd cascade step of that shape).
STEADY_AFTER = 2


def decode_shape(plan: CascadePlan) -> tuple[object, ...]:
    """What a decode step's CUDA graphs depend on, from the plan: rows, and each shared level's
    groups, rows, row order and pages (the per-request level's pages change every step)."""
    return (int(plan.levels[-1].qo_indptr[-1]), *(
        (level.num_groups, int(level.qo_indptr[-1]), level.q_is_identity,
         int(level.kv_page_indptr[-1])) for level in plan.levels[:-1]))


class StepSession:
    """Per-process planning state: limits, the attention shape, and the current step's plan."""

    def __init__(self) -> None:
        self.config: CascadeConfig | None = None
        self.shape: AttentionShape | None = None
        self.page_size = 0
        self.disabled_reason: str | None = "no FlashInfer cascade builder yet"
        self.cost_model = CostModel()
        self.steady_cost_model: CostModel | None = None
        self.current: StepPlan | None = None
        self._planner: CascadePlanner | None = None
        self._shape_seen: tuple[object, ...] | None = None
        self._shape_streak = 0

    def configure(self, config: CascadeConfig, shape: AttentionShape, page_size: int,
                  disabled_reason: str | None, cost_model: CostModel | None = None,
                  steady_cost_model: CostModel | None = None) -> None:
        """Called by each new builder: what the model's attention looks like, or why it can't.

        ``cost_model``: the calibration of the executor the builder will run (default:
        FlashInfer's). ``steady_cost_model``: the same executor on a decode step whose shape the
        previous :data:`STEADY_AFTER` planned decode steps had, which its CUDA graphs replay
        (None: ``cost_model`` for every step).
        """
        self.config, self.shape, self.page_size = config, shape, page_size
        self.cost_model = cost_model or CostModel()
        self.steady_cost_model = steady_cost_model
        self._shape_seen, self._shape_streak = None, 0
        self.disabled_reason = disabled_reason
        self._planner = CascadePlanner(max_levels=config.max_levels,
                                       min_shared_pages=config.min_shared_pages)
        if disabled_reason is not None:
            stats.log_once(f"disabled:{disabled_reason}",
                           "vllm-cascade-plugin: cascade attention is off for this model: %s; "
                           "every step runs vLLM's flat FlashInfer attention.", disabled_reason)

    @property
    def active(self) -> bool:
        return self.disabled_reason is None and self._planner is not None

    def skip_unshared(self, first_pages: np.ndarray, seq_lens: np.ndarray,
                      query_lens: np.ndarray) -> bool:
        """Count a real step that provably shares no page as planned and flat; True if so.

        The runner hooks ask this first, from each row's first block id, and call
        :meth:`plan_step` (which needs the whole block table) only when it answers False.
        With ``CASCADE_DEBUG=1`` the planner runs anyway and must agree (see :meth:`plan_step`).
        """
        self.current = None
        if not self.active or (self.config is not None and self.config.debug):
            return False
        try:
            if not nothing_shared(first_pages, seq_lens, query_lens, self.page_size):
                return False
        except Exception as exc:  # the full planner decides instead
            stats.record_fallback("planner error", f"{type(exc).__name__}: {exc}")
            return False
        stats.record_planned(bool(np.all(np.asarray(query_lens) == 1)))
        return True

    def plan_step(self, block_table: np.ndarray, seq_lens: np.ndarray,
                  query_lens: np.ndarray) -> StepPlan | None:
        """Plan a real engine step (rows in the builder's order); None: run it flat.

        A failure here never escapes into vLLM: the step runs flat and the reason is counted.
        """
        self.current = None
        if not self.active:
            return None
        assert self._planner is not None and self.config is not None and self.shape is not None
        decode = bool(np.all(query_lens == 1))
        stats.record_planned(decode)
        try:
            plan = self._planner.plan(block_table, seq_lens, query_lens, self.page_size)
            if self.config.debug:
                broken = plan_violations(plan, block_table, seq_lens, query_lens)
                if (plan.num_levels > 1 and block_table.shape[1] > 0
                        and nothing_shared(block_table[:, 0], seq_lens, query_lens,
                                           self.page_size)):
                    broken.append("nothing_shared() would have skipped a step with sharing")
                if broken:
                    stats.record_fallback("plan invariant violated", "; ".join(broken[:3]))
                    return None
            steady = self._steady(plan, decode)
            if plan.num_levels < 2:
                decision = Decision(False, 0.0, 0.0, "no shared pages")
            elif self.config.policy == "always":
                decision = Decision(True, 0.0, 0.0, "CASCADE_POLICY=always")
            else:
                model = self.steady_cost_model if steady and self.steady_cost_model else None
                decision = decide(plan, self.shape, model or self.cost_model)
        except Exception as exc:  # the engine must never fail because of the planner
            stats.record_fallback("planner error", f"{type(exc).__name__}: {exc}")
            return None
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        self.current = StepPlan(plan, decision, qsl, decode)
        if stats.logger.isEnabledFor(logging.DEBUG):
            stats.logger.debug(
                "cascade step: %s (%s); %d levels, groups %s, pages %d flat -> %d; totals %s",
                "cascade" if decision.use_cascade else "flat", decision.reason, plan.num_levels,
                plan.stats.group_sizes, plan.stats.pages_flat, plan.stats.pages_cascade,
                stats.snapshot())
        return self.current

    def _steady(self, plan: CascadePlan, decode: bool) -> bool:
        """Count consecutive planned decode steps of one :func:`decode_shape`; True once the
        previous :data:`STEADY_AFTER` had this step's shape (flat or cascade alike, so a run of
        flat steps can reach it)."""
        shape = decode_shape(plan) if decode and plan.num_levels > 1 else None
        if shape is None or shape != self._shape_seen:
            self._shape_seen, self._shape_streak = shape, 0
            return False
        self._shape_streak += 1
        return self._shape_streak >= STEADY_AFTER

    def step_for(self, query_start_loc: np.ndarray, num_actual_tokens: int) -> StepPlan | None:
        """The current plan if it is for this batch and chose cascade, else None."""
        step = self.current
        if step is None or not step.decision.use_cascade:
            return None
        if not step.matches(query_start_loc, num_actual_tokens):
            stats.record_fallback("plan does not match the batch", level=logging.DEBUG)
            return None
        return step

    def end_step(self) -> None:
        self.current = None


session = StepSession()
