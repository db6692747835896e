"""Every step the runner hooks plan ends inside the same ``execute_model`` call, on both model
runners: it is counted as cascade or as flat with one reason before the call returns, so the
counters never wait for the next step to tell how this one ended."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from test_hooks import (  # noqa: F401  (active_session is a fixture)
    active_session,
    block_tables,
    captured_graphs,
    id_mappings,
    v1_runner,
)
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.integration import hooks_dispatch, hooks_step
from vllm_cascade_plugin.stats import counters as c
from vllm_cascade_plugin.step import session

SHARED = np.array([[5, 6, 7], [5, 6, 8], [5, 6, 9], [5, 6, 10]], dtype=np.int32)
UNSHARED = SHARED + 20 * np.arange(4, dtype=np.int32)[:, None]
SEQ, Q = np.array([40, 41, 42, 43], dtype=np.int32), np.ones(4, dtype=np.int32)


def model_call(runs_cascade: bool) -> None:
    """What the step's metadata builders do with its plan: run it (or not)."""
    step = session.current
    if runs_cascade and step is not None and step.decision.use_cascade:
        stats.record_cascade(1, 1, step.decode)


def ended_as(before: stats.Counters) -> str | None:
    """How the one step since ``before`` ended: its flat reason, or None for cascade; and every
    planned step has ended."""
    now = stats.snapshot()
    assert now.steps_planned == before.steps_planned + 1
    assert now.steps_planned == now.steps_cascade + sum(now.flat_reasons.values())
    if now.steps_cascade > before.steps_cascade:
        return None
    [reason] = (now.flat_reasons - before.flat_reasons).keys()
    return reason


CASES = [  # (block table, a short block table, the builders run the plan, how the step ends)
    (SHARED, False, True, None),
    (SHARED, False, False, c.UNUSED),
    (UNSHARED, False, True, c.NO_SHARED),
    (SHARED, True, True, "block table shorter than the sequence"),
]


@pytest.fixture
def counters():
    stats.reset()
    yield
    stats.reset()


@pytest.mark.parametrize(("table", "short", "runs", "reason"), CASES)
def test_v1_runner_counts_each_step_when_execute_model_returns(active_session, counters,  # noqa: F811
                                                               table, short, runs, reason):
    from vllm.config import CUDAGraphMode

    runner, so = v1_runner(table, SEQ, Q)
    if short:
        runner.input_batch.block_table[0].num_blocks_per_row = np.ones(4, np.int32)

    def vllm_dispatch(self, num_tokens, uniform_decode=False, has_lora=False,
                      num_active_loras=0, valid_modes=None, invalid_modes=None):
        return CUDAGraphMode.PIECEWISE, SimpleNamespace(num_tokens=num_tokens)

    dispatch = hooks_dispatch.v1_dispatch(vllm_dispatch)

    def determine(self, num_tokens):
        return dispatch(self.cudagraph_dispatcher, num_tokens)

    decide = hooks_dispatch.v1_determine_batch_execution(determine)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        decide(self, 4)
        model_call(runs)
        return "output"

    before = stats.snapshot()
    assert hooks_step.execute_model(execute_model)(runner, so) == "output"
    assert ended_as(before) == reason


def v2_runner(table: np.ndarray, seq: np.ndarray, q: np.ndarray, short: bool):
    """A V2 runner's state for one step, as the hooks read it: block ids written through
    vLLM's real ``BlockTables`` (the mirror), requests in slots 0..3."""
    tables = block_tables(**id_mappings()[0])  # kernel blocks = KV blocks
    for row, ids in enumerate(table):
        tables.append_block_ids(row, ([int(i) for i in ids[: 1 if short else 3]],), True)
        tables.num_blocks.np[0, row] = 1 if short else 3  # what vLLM's write records
    manager, _ = captured_graphs()
    names = [f"r{i}" for i in range(len(q))]
    states = SimpleNamespace(req_id_to_index={n: i for i, n in enumerate(names)},
                             num_computed_tokens_np=seq - q)
    runner = SimpleNamespace(block_tables=tables, req_states=states, decode_query_len=1,
                             cudagraph_manager=manager)
    so = SimpleNamespace(num_scheduled_tokens=dict(zip(names, q.tolist(), strict=True)),
                         scheduled_spec_decode_tokens={})
    return runner, so


@pytest.mark.parametrize(("table", "short", "runs", "reason"), CASES)
def test_v2_runner_counts_each_step_when_execute_model_returns(active_session, counters,  # noqa: F811
                                                               table, short, runs, reason):
    runner, so = v2_runner(table, SEQ, Q, short)

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        self.cudagraph_manager.dispatch(4, 4, 1, 0)
        model_call(runs)
        return "output"

    before = stats.snapshot()
    assert hooks_step.execute_model(execute_model)(runner, so) == "output"
    assert ended_as(before) == reason
