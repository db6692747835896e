"""A builder hands out a cascade plan only for the batch it was planned for, run as planned:
the batch's rows are the planned rows by identity, not only by their lengths (two rows of equal
lengths would read each other's KV), and vLLM dispatched the step to no FULL CUDA graph (whose
replay runs the flat attention it captured). The runner hooks plan the step; the builder's
``_cascade_step`` is where the plan is handed out. Runs on every vLLM in CI (0.26, 0.33, 0.34):
Model Runner V2's batch identity is ``CommonAttentionMetadata.req_idx`` where the release passes
it (0.30+), else vLLM's own batch order."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from test_hooks import active_session, v1_runner  # noqa: F401  (active_session: a fixture)
from test_step_ends import counters, v2_runner  # noqa: F401  (counters: a fixture)
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.integration import hooks_dispatch, hooks_step
from vllm_cascade_plugin.integration.builder import CascadeBuilder
from vllm_cascade_plugin.step import session

# Four requests sharing two pages, each with a page of its own, all of one length: a plan with
# two rows swapped passes every length check.
TABLE = np.array([[5, 6, 7], [5, 6, 8], [5, 6, 9], [5, 6, 10]], dtype=np.int32)
SEQ, Q = np.full(4, 40, dtype=np.int32), np.ones(4, dtype=np.int32)


def vllm_batch_order(runner, so) -> np.ndarray:
    """The request slots of the batch in vLLM's own order (its ``sort_batch_req_ids``, as its
    ``prepare_inputs``/``gather_batch_req_state`` builds ``idx_mapping``)."""
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    params = inspect.signature(sort_batch_req_ids).parameters
    extra = {"draft_tokens": so.scheduled_spec_decode_tokens} if "draft_tokens" in params else {}
    order = sort_batch_req_ids(so.num_scheduled_tokens, decode_query_len=1, **extra)
    return np.array([runner.req_states.req_id_to_index[r] for r in order])


def release_passes_req_idx() -> bool:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return "req_idx" in {f.name for f in dataclasses.fields(CommonAttentionMetadata)}


def metadata(req_idx=None):
    """What a builder reads of vLLM's CommonAttentionMetadata for the step (host copies)."""
    qsl = torch.arange(len(Q) + 1, dtype=torch.int32)
    cm = SimpleNamespace(query_start_loc_cpu=qsl, num_actual_tokens=len(Q),
                         seq_lens_cpu_upper_bound=torch.from_numpy(SEQ.copy()))
    if req_idx is not None:
        cm.req_idx = req_idx
    return cm


def builder():
    """A builder of the layers the session plans for (only its settings are read)."""
    from vllm_cascade_plugin.step import BuilderSettings

    return SimpleNamespace(_settings=BuilderSettings(session.config, session.shape,
                                                     session.page_size, None))


def handed_out(cm) -> bool:
    """Whether a builder of the step's layers takes the plan for the batch ``cm``."""
    return CascadeBuilder._cascade_step(builder(), cm, False) is not None


def run_v2_step(monkeypatch, wrong_order: bool, graph_mode=None):
    """Plan a V2 step through the hooks (dispatch inside execute_model), then ask the builder
    with the batch as vLLM builds it. ``wrong_order``: the plugin's prediction of vLLM's batch
    order has rows 0 and 1 swapped (what a future vLLM sorting otherwise would do)."""
    runner, so = v2_runner(TABLE, SEQ, Q, False)
    truth = vllm_batch_order(runner, so)
    if wrong_order:
        predict = hooks_dispatch.v2_rows

        def swapped(runner, so):
            req_ids, counts, _ = predict(runner, so)
            return req_ids, counts, np.array([1, 0, 2, 3])
        monkeypatch.setattr(hooks_dispatch, "v2_rows", swapped)
    seen = {}

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        self.cudagraph_manager.dispatch(4, 4, 1, 0)
        if graph_mode is not None:  # what vLLM's dispatch answered, as the hooks recorded it
            hooks_step.pending.graph_mode = None if graph_mode == "unset" else graph_mode
        seen["planned"] = session.current is not None and session.current.decision.use_cascade
        seen["taken"] = handed_out(metadata(truth if release_passes_req_idx() else None))
        return "output"

    assert hooks_step.execute_model(execute_model)(runner, so) == "output"
    return seen


def test_a_v2_plan_of_the_rows_vllm_runs_is_taken(active_session, counters, monkeypatch):  # noqa: F811
    assert run_v2_step(monkeypatch, wrong_order=False) == {"planned": True, "taken": True}
    assert hooks_step.ROWS_DIFFER not in stats.snapshot().fallbacks


def test_a_v2_plan_whose_rows_are_not_vllms_rows_runs_flat_and_says_which(
        active_session, counters, monkeypatch, caplog):  # noqa: F811
    assert run_v2_step(monkeypatch, wrong_order=True) == {"planned": True, "taken": False}
    assert stats.snapshot().fallbacks == {hooks_step.ROWS_DIFFER: 1}
    assert "row 0 of 4: planned 1, the batch's 0" in caplog.text


@pytest.mark.parametrize("mode", ["FULL", None])
def test_a_cascade_step_never_hands_its_plan_to_a_full_graph_or_an_unknown_mode(
        active_session, counters, monkeypatch, mode):  # noqa: F811
    """Forced: vLLM's dispatch answered FULL for a cascade step (a dispatch path the hooks do
    not cover), or the step's mode was never recorded."""
    seen = run_v2_step(monkeypatch, wrong_order=False, graph_mode=mode or "unset")
    assert seen == {"planned": True, "taken": False}
    assert stats.snapshot().fallbacks == {hooks_step.FULL_GRAPH: 1}


def test_a_v1_plan_whose_rows_moved_before_the_build_runs_flat(active_session, counters):  # noqa: F811
    from vllm.config import CUDAGraphMode

    runner, so = v1_runner(TABLE, SEQ, Q)
    seen = []

    def dispatch(self, num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0,
                 valid_modes=None, invalid_modes=None):
        return CUDAGraphMode.PIECEWISE, SimpleNamespace(num_tokens=num_tokens)

    decide = hooks_dispatch.v1_determine_batch_execution(lambda self, **kw: None)
    dispatcher = hooks_dispatch.v1_dispatch(dispatch)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        decide(self, num_tokens=4)
        dispatcher(self.cudagraph_dispatcher, 4)
        seen.append(handed_out(metadata()))
        ids = self.input_batch.req_ids
        ids[1], ids[2] = ids[2], ids[1]  # two rows of equal lengths trade places
        seen.append(handed_out(metadata()))
        return "output"

    hooks_step.execute_model(execute_model)(runner, so)
    assert seen == [True, False]
    assert stats.snapshot().fallbacks == {hooks_step.ROWS_DIFFER: 1}


def test_debug_compares_the_mirrored_block_ids_with_vllms_and_stops_planning_from_them(
        active_session, counters, monkeypatch, caplog):  # noqa: F811
    session.config = CascadeConfig(enabled=True, policy="always", debug=True)
    runner, so = v2_runner(TABLE, SEQ, Q, False)
    tables = runner.block_tables
    held = tables.block_tables[0]
    held.gpu = torch.from_numpy(held.gpu)  # vLLM's ids on the device (read back in debug)
    seen = []

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        self.cudagraph_manager.dispatch(4, 4, 1, 0)
        seen.append(session.current is not None and session.current.decision.use_cascade)
        return "output"

    step = hooks_step.execute_model(execute_model)
    step(runner, so)
    tables.__dict__[hooks_dispatch.MIRROR][0][2, 1] = 99  # a write the mirror got wrong
    step(runner, so)
    step(runner, so)
    assert seen == [True, False, False]
    assert stats.snapshot().fallbacks[hooks_dispatch.MIRROR_DIFFERS] == 1
    assert stats.snapshot().fallbacks["no CPU block ids"] == 1  # never planned from it again
    assert "request slot 2, page 1: mirrored 99, vLLM's 6" in caplog.text
