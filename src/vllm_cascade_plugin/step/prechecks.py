"""The step session's pre-checks: what the runner hooks ask of a step's rows before the
planner reads its block table (:class:`PreChecks`, a part of
:class:`~vllm_cascade_plugin.step.StepSession`). Most steps of a serving run stop here: one
compiled pass over the rows (:mod:`~vllm_cascade_plugin.planning.compiled`) answers both."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import stats
from ..planning.compiled import RowFacts, row_facts
from ..planning.cost import (
    AttentionShape,
    CostModel,
    decode_flat_us,
    flat_floor,
    flat_floor_from_facts,
)
from ..planning.planner import CascadePlanner, nothing_shared
from ..stats.counters import COST_MODEL, PATH_COST_FLOOR, PATH_HELD, PATH_KEPT_FLAT, PATH_UNSHARED
from .plan import flat_reason, unshared_reason

if TYPE_CHECKING:
    from ..config import CascadeConfig

# A decode step the cost model keeps flat holds the verdict for up to HOLD_STEPS decode steps
# (held_flat).
HOLD_STEPS = 16


class PreChecks:
    """The pre-checks; the session's state they read is declared here."""

    config: CascadeConfig | None
    shape: AttentionShape | None
    page_size: int
    cost_model: CostModel
    steady_cost_model: CostModel | None
    split_cost_model: CostModel | None
    current: Any
    _planner: CascadePlanner | None
    _flat_held: tuple[CostModel, float, int, str] | None
    unshared = False  # whether skip_unshared's last True: its step provably shares no page
    # A decode step's flat verdict, held (held_flat): (the most rows it holds for, steps it may
    # still hold, its cascade estimate over flat's); None: nothing held.
    _hold: tuple[int, int, float] | None = None

    def hold_verdict(self, decode: bool, rows: int, ratio: float | None) -> None:
        """A planned step ended: a decode step of ``rows`` rows the cost model kept flat, its
        cascade estimate ``ratio`` times flat's, holds its verdict (:meth:`held_flat`); any
        other decode step (``ratio`` None) lets go of what was held. A mixed step that runs
        flat keeps it (its new rows are counted against the held step's); one that runs
        cascade lets go (``plan_step``).

        The verdict holds for at most ``rows * ratio * (1 + margin)`` rows: flat attention's
        time grows with the rows (each reads the shared pages again), while the cascade's
        estimate would have to stand still for the verdict to turn there, so with fewer rows it
        cannot (rows like those planned: their lengths, one token a step longer, change the
        estimates far less)."""
        if not decode:
            return
        config = self.config
        if ratio is None or config is None or config.debug or config.policy != "auto":
            self._hold = None
            return
        most = int(rows * ratio * (1 + self.cost_model.margin) + 1e-9)  # not below rows by a ulp
        self._hold = (most, HOLD_STEPS, ratio)

    def held_flat(self, tokens: Mapping[Any, int]) -> bool:
        """Count a decode step (``tokens``: each row's query tokens, vLLM's
        ``num_scheduled_tokens``) flat, without reading its rows, while the last planned
        decode step's flat verdict holds (:meth:`hold_verdict`): at most :data:`HOLD_STEPS`
        steps, of at most as many rows as it holds for; True if so. At worst a held step
        misses a cascade a plan would have run, never a correct result: it runs vLLM's flat
        attention. Off with ``CASCADE_DEBUG`` (every step is planned and checked)."""
        held = self._hold
        rows = len(tokens)
        if held is None or sum(tokens.values()) != rows:  # a mixed step: planned, still held
            return False
        self._hold = None
        if held[1] <= 0 or rows > held[0] or not self.active:
            return False
        self.current = None
        stats.record_flat_step(True, PATH_HELD, COST_MODEL, held[2])
        self._hold = (held[0], held[1] - 1, held[2])
        return True

    @property
    def active(self) -> bool:  # the session's
        raise NotImplementedError

    def graphable(self, num_tokens: int) -> bool:  # the session's
        raise NotImplementedError

    def row_facts(self, first_pages: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                  num_blocks: np.ndarray) -> RowFacts:
        """What the pre-checks need of a step's rows, in one pass (:mod:`~.planning.compiled`;
        the floor's terms for :attr:`cost_model`'s prefill tile and L2 window)."""
        model = self.cost_model
        return row_facts(first_pages, seq_lens, query_lens, num_blocks, max(self.page_size, 1),
                         model.flat_prefill_tile, model.l2_window_rows)

    def skip_unshared(self, first_pages: np.ndarray, seq_lens: np.ndarray,
                      query_lens: np.ndarray, facts: RowFacts | None = None) -> bool:
        """Count a real step that provably shares no page as planned and flat; True if so.

        The runner hooks ask this first, from each row's first block id (``facts``: from
        :meth:`row_facts`), and call :meth:`plan_step` (which needs the whole block table) only
        when it answers False. With ``CASCADE_DEBUG=1`` the planner runs anyway and must agree
        (see :meth:`plan_step`).
        """
        self.current = None
        if not self.active or (self.config is not None and self.config.debug):
            return False
        with stats.planning():
            try:
                if facts is not None:
                    if facts.maybe_shared:
                        return False
                elif not nothing_shared(first_pages, seq_lens, query_lens, self.page_size):
                    return False
            except Exception as exc:  # the full planner decides instead
                stats.record_fallback("planner error", f"{type(exc).__name__}: {exc}")
                return False
            decode = _all_decode(query_lens, facts)
            stats.record_flat_step(decode, PATH_UNSHARED, unshared_reason(len(query_lens)))
        self.hold_verdict(decode, len(query_lens), None)
        self.unshared = True
        return True

    def unshared_again(self, decode: bool, requests: int) -> bool:
        """Count a step the runner hooks know shares no page, as the last one :meth:`skip_unshared`
        proved (the same requests, none new, resumed or finished), as it counted that one:
        planned and flat, without the rows read; True if so. ``decode``: every row has one
        query token. Not while inactive or with ``CASCADE_DEBUG`` (every step is planned)."""
        self.current = None
        if not self.active or (self.config is not None and self.config.debug):
            return False
        stats.record_flat_step(decode, PATH_UNSHARED, unshared_reason(requests))
        self.hold_verdict(decode, requests, None)
        return True

    def cannot_win(self, seq_lens: np.ndarray, query_lens: np.ndarray,
                   facts: RowFacts | None = None) -> bool:
        """Count a real step no plan of which could run as cascade (the cost model's floor,
        :func:`~.planning.cost.flat_floor`, charged as :meth:`_decide` charges first) as planned
        and flat, for the reason :meth:`_decide` would give; True if so. Not with
        ``CASCADE_DEBUG`` (every step is planned and checked) or ``CASCADE_POLICY=always``.
        A mixed step is planned whole (every query token) unless ``CASCADE_SPLIT_MIXED`` splits
        it (:meth:`_split_lens`). ``facts``: the rows' :meth:`row_facts`, if read."""
        self.current = None
        config = self.config
        if (not self.active or config is None or config.debug or config.policy == "always"
                or self.shape is None):
            return False
        with stats.planning():
            try:
                query = np.asarray(query_lens)
                decode = _all_decode(query, facts)
                steady, split = self.steady_cost_model, self._split_lens(query)
                tokens = facts.tokens if facts is not None else int(query.sum())
                model = (steady if decode and steady is not None
                         and self.graphable(tokens) else self.cost_model)
                if split is not None:  # the decode rows' cascade against their flat attention
                    assert self.split_cost_model is not None
                    model = self.split_cost_model
                if (facts is not None and split is None
                        and model.flat_prefill_tile == self.cost_model.flat_prefill_tile
                        and model.l2_window_rows == self.cost_model.l2_window_rows):
                    floor = flat_floor_from_facts(facts, len(query), self.page_size, self.shape,
                                                  model)
                else:
                    floor = flat_floor(seq_lens, query if split is None else split,
                                       self.page_size, self.shape, model)
            except Exception as exc:  # the full planner decides instead
                stats.record_fallback("planner error", f"{type(exc).__name__}: {exc}")
                return False
            if floor is None:
                return False
        ratio = floor.cascade_us / floor.flat_us
        stats.record_flat_step(decode, PATH_COST_FLOOR, flat_reason(
            decode, query, None if facts is None else facts.decodes), ratio)
        self.hold_verdict(decode, len(query), ratio)
        return True

    def continued_flat(self, block_table: np.ndarray, seq_lens: np.ndarray,
                       query_lens: np.ndarray, facts: RowFacts, row_keys: np.ndarray | None,
                       row_index: np.ndarray | None) -> bool:
        """Count a step that continues the last planned one (its decode rows one token longer:
        :meth:`continues`) as planned and flat, without planning it, where the last one's flat
        verdict still holds; True if so.

        Such a step's plan has the last one's shared levels and its per-request level reads
        each row's new page, if it started one: no estimate of its cascade is below the last
        one's (``_flat_held``), while flat attention's, exact from the rows' lengths and the
        shared levels' reads past the L2 window (:func:`~.planning.cost.decode_flat_us`),
        still does not beat it by the margin: :meth:`_decide` would keep it flat, for the same
        reason, under the same cost model. The planner's memory moves on to this step
        (:meth:`~.planning.planner.CascadePlanner.advance`), as planning it would have."""
        self.current = None
        held, planner, shape = self._flat_held, self._planner, self.shape
        if (held is None or planner is None or shape is None or row_keys is None
                or self.config is None or self.config.debug):
            return False
        model, cascade_us, missed, reason = held
        steady = self.steady_cost_model
        now = (steady if steady is not None and self.graphable(facts.tokens)
               else self.cost_model)
        if now is not model or not _all_decode(query_lens, facts):
            return False
        with stats.planning():
            flat_us = decode_flat_us(facts, self.page_size, shape, model, missed)
            if cascade_us * (1 + model.margin) < flat_us:
                return False
            try:
                if not planner.advance(block_table, seq_lens, query_lens, self.page_size,
                                       row_keys, row_index):
                    return False
            except Exception as exc:  # the planner plans it instead
                stats.record_fallback("planner error", f"{type(exc).__name__}: {exc}")
                return False
            ratio = cascade_us / flat_us
            stats.record_flat_step(True, PATH_KEPT_FLAT, reason, ratio)
        self.hold_verdict(True, len(query_lens), ratio if reason == COST_MODEL else None)
        return True

    def _split_lens(self, query_lens: np.ndarray) -> np.ndarray | None:
        """For a mixed step the executor splits (``CASCADE_SPLIT_MIXED``): the query lengths its
        plan covers, 1 for each row of one query token and 0 (padding, to the planner) for the
        others, which run flat; None where the step is planned whole, every query token, and
        charged the eager cost (not mixed, the split off, no split cost, or more decode rows
        than vLLM's largest CUDA-graph capture size: the decode rows would run eagerly)."""
        if self.split_cost_model is None or self.config is None or not self.config.split_mixed:
            return None
        one = np.asarray(query_lens) == 1
        decode_rows = int(np.count_nonzero(one))
        if not decode_rows or decode_rows == len(one) or not self.graphable(decode_rows):
            return None
        return one.astype(np.int32)


def _all_decode(query_lens: np.ndarray, facts: RowFacts | None) -> bool:
    """Whether every row has exactly one query token (a decode step)."""
    if facts is not None:
        return facts.all_decode(len(query_lens))
    return bool(np.all(np.asarray(query_lens) == 1))
