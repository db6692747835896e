"""Row keys (``CASCADE_PLAN_FROM_CHANGES``): which rows of a step vLLM changed, for the planner.

The planner carries each row's place in the prefix trie from one step to the next; to know which
rows still hold the block ids it planned, it compares every row with a copy of the last step's
(``O(rows x pages)``), unless it is given one key per row
(:meth:`~vllm_cascade_plugin.planning.planner.CascadePlanner.plan`): a row whose key some row
had in the last keyed step holds that row's ids, appended to at most, wherever it now is; any
other row brings a key never used. The runners know which rows vLLM wrote anew:

- V1 (``GPUModelRunner._update_states``): a request's row is written whole when it is scheduled
  new (``scheduled_new_reqs``) or resumed from preemption (``resumed_req_ids``), and otherwise
  only appended to (``append_row``); rows move (``condense``, ``swap_states``) with their
  request. A request's key is drawn each time it comes new or resumed, so the key of a row is
  its request's, and follows it when it moves.
- V2: every write of block ids goes through ``BlockTables.append_block_ids``, which the CPU
  mirror of :mod:`.hooks_dispatch` wraps; a write that overwrites a slot (a request added or
  resumed) draws the slot a new key, and a row's key is its slot's wherever vLLM's batch order
  puts the slot.

Keys come from one counter per process, never reused. Every real step's scheduler output goes
through :func:`note_step` (``execute_model``); if one cannot be read, the runner's keys are
dropped for good and the planner compares block ids as without this.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import numpy as np

from .. import stats
from . import compat

_SERIAL = itertools.count(1)
V1_KEYS = "_cascade_row_keys"  # V1 runner attribute: a RequestKeys, or False once unusable
V2_KEYS = "_cascade_slot_keys"  # V2 BlockTables attribute: int64 keys per slot, or False


class RequestKeys:
    """The keys of a V1 runner's requests: one per request, drawn when it is new or resumed."""

    def __init__(self) -> None:
        self.keys: dict[str, int] = {}

    def note(self, scheduler_output: Any) -> None:
        keys = self.keys
        for req_id in scheduler_output.finished_req_ids:
            keys.pop(req_id, None)
        for req_id in compat.rewritten_req_ids(scheduler_output):
            keys[req_id] = next(_SERIAL)

    def rows(self, req_ids: list[str], count: int) -> np.ndarray:
        """int64 keys of the first ``count`` of ``req_ids`` (the batch's rows); KeyError for a
        request never noted."""
        return np.fromiter(map(self.keys.__getitem__, req_ids), dtype=np.int64, count=count)


def _dropped(owner: Any, attribute: str, exc: BaseException) -> None:
    """Never use ``owner``'s keys again (a step's changes were missed): steps still run
    cascade, planned by comparing block ids. Logged once. Never raises."""
    try:
        owner.__dict__[attribute] = False
        stats.log_once("row keys", "vllm-cascade-plugin: the rows vLLM changed are not known "
                       "(%s: %s); the planner compares every row's block ids from now on "
                       "(as with CASCADE_PLAN_FROM_CHANGES=0).", type(exc).__name__, exc,
                       level=logging.WARNING)
    except Exception:
        pass


def note_step(runner: Any, scheduler_output: Any) -> None:
    """A V1 runner's step is about to run: note the requests whose rows vLLM writes anew.
    Every real step comes here (V2 runners, which have no ``input_batch``, are left alone).
    Never raises."""
    try:
        if not hasattr(runner, "input_batch"):
            return
        keys = runner.__dict__.get(V1_KEYS)
        if keys is False:
            return
        if keys is None:
            keys = runner.__dict__[V1_KEYS] = RequestKeys()
        keys.note(scheduler_output)
    except Exception as exc:
        _dropped(runner, V1_KEYS, exc)


def forget(runner: Any) -> None:
    """A real step's scheduler output could not be noted: the runner's keys are dropped."""
    _dropped(runner, V1_KEYS, RuntimeError("a step's scheduler output was not noted"))


def v1_rows(runner: Any, req_ids: list[str], count: int) -> np.ndarray | None:
    """The keys of a V1 step's ``count`` rows, or None (plan by comparing block ids)."""
    keys = runner.__dict__.get(V1_KEYS)
    if not keys:
        return None
    try:
        return keys.rows(req_ids, count)
    except Exception as exc:  # a request this runner never saw come: a step was missed
        _dropped(runner, V1_KEYS, exc)
        return None


def v2_written(tables: Any, slot: int, overwrite: bool, slots: int) -> None:
    """A V2 write of block ids went to ``slot`` of ``slots`` (the mirror's rows): an overwrite
    draws it a new key. Never raises."""
    if not overwrite:
        return
    try:
        keys = tables.__dict__.get(V2_KEYS)
        if keys is False:
            return
        if keys is None:
            keys = tables.__dict__[V2_KEYS] = np.zeros(slots, np.int64)
        keys[slot] = next(_SERIAL)
    except Exception as exc:
        _dropped(tables, V2_KEYS, exc)


def v2_rows(tables: Any, index: np.ndarray) -> np.ndarray | None:
    """The keys of a V2 step's rows (their slots ``index``), or None."""
    keys = tables.__dict__.get(V2_KEYS)
    if keys is None or keys is False:
        return None
    return keys[index]
