"""The step session's book of CUDA-graph layouts (:class:`GraphLayouts`, a part of
:class:`~vllm_cascade_plugin.step.StepSession`): which layouts of graphed decode steps are worth
their capture, and what a capture costs this process. numpy only."""

from __future__ import annotations

from typing import Any

from .. import stats
from ..planning.cost import AttentionShape, Decision
from ..planning.graph_layout import graph_shape
from ..planning.plan import CascadePlan

MAX_LAYOUTS = 4096  # graph layouts remembered (then forgotten all at once)
# How a step's attention would run as cascade (GraphLayouts.graph_state).
STEADY, FIRST = "graphed", "first of its layout"
# What capturing a new layout's CUDA graphs is taken to cost a step (host time, during which
# the GPU runs out of queued work) until this process has measured one: a whole Llama-3-8B-shaped
# step (32 layers) took 35-41 ms to capture under `vllm serve` on an H100.
CAPTURE_COST_PRIOR_US = 30_000.0

__all__ = ["CAPTURE_COST_PRIOR_US", "FIRST", "STEADY", "GraphLayouts"]


class GraphLayouts:
    """The layout book; the session's state it reads is declared here."""

    shape: AttentionShape | None

    def padded(self, num_tokens: int) -> int:  # the session's
        raise NotImplementedError

    def init_layouts(self) -> None:
        # Graph layouts planned before: the graphed gain (µs) their steps have gone without so
        # far, or ``inf`` once they ran from graphs (see graph_state).
        self._layouts_owed: dict[tuple[Any, ...], float] = {}
        # What a step that captured graphs spent capturing (``capture_cost_us``: their mean
        # so far, the prior before any), and the capture seconds counted when the last step
        # ended (stats).
        self.capture_cost_us = CAPTURE_COST_PRIOR_US
        self._capture_steps = 0
        self._capture_total_us = 0.0
        self._captured_s = 0.0

    def layout_key(self, plan: CascadePlan, split: bool = False) -> tuple[Any, ...]:
        key: tuple[Any, ...] = graph_shape(plan, self.padded(plan.stats.num_tokens))
        return ("split", key) if split else key

    def graph_state(self, plan: CascadePlan, graphed: Decision, split: bool = False) -> str:
        """How a graphable decode step with a shared level, which wins at the graphed cost
        (``graphed``), runs as cascade: :data:`STEADY`, from its layout's graphs (captured now
        if they are not yet), or :data:`FIRST`, a layout whose graphs are not worth capturing
        yet: the step is charged the eager cost.

        Capturing a layout's graphs costs its step ``capture_cost_us`` of host time, and a
        layout may never come back (a batch growing past a padded size, say): so a layout is
        steady once an earlier step had it and the graphed gain its steps went without (one
        step's flat less cascade time, over every attention layer the plan serves, summed
        over its steps so far, this one included) reaches what the capture costs. A
        layout seen once never costs a capture, and one that comes back often is captured
        at most one capture's cost late (rent or buy). ``split``: the decode rows of a mixed
        step run split, whose per-layer graphs are their own."""
        key = self.layout_key(plan, split)
        layers = self.shape.num_layers if self.shape is not None else 1
        gain = max(graphed.flat_us - graphed.cascade_us, 0.0) * max(layers, 1)
        owed = self._layouts_owed.get(key)
        if owed is None:
            if len(self._layouts_owed) >= MAX_LAYOUTS:
                self._layouts_owed.clear()
            self._layouts_owed[key] = gain
            return FIRST
        owed += gain
        if owed >= self.capture_cost_us:
            self._layouts_owed[key] = float("inf")
            return STEADY
        self._layouts_owed[key] = owed
        return FIRST

    def steady_layout(self, plan: CascadePlan) -> None:
        """``plan``'s layout runs from graphs from now on (a step of it won even eagerly: its
        graphs are captured as it runs)."""
        self._layouts_owed[self.layout_key(plan)] = float("inf")

    def note_captures(self) -> None:
        """A step ends: what it spent capturing graphs, if it captured any (the graph caches
        count it: ``stats.record_capture``), joins ``capture_cost_us``'s mean."""
        captured = stats.capture_seconds()
        if captured != self._captured_s:  # this step captured graphs (or the counters reset)
            if captured > self._captured_s:
                self._capture_steps += 1
                self._capture_total_us += 1e6 * (captured - self._captured_s)
                self.capture_cost_us = self._capture_total_us / self._capture_steps
            self._captured_s = captured
