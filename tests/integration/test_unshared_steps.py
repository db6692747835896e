"""Model Runner V2's hook on steps that share nothing: once the pre-check has proved a step's
rows share no page, the next steps of the same requests (none new, resumed or finished) are
counted flat for the same reason without their rows being read, and any change to the batch
reads them again. Whether a step shares is checked against the planner run on the whole block
table (``plan_cascade``), not against the hook's own answer."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from test_hooks import active_session  # noqa: F401  (a fixture)
from test_step_ends import counters, v2_runner  # noqa: F401  (a fixture)
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.integration import hooks_dispatch, hooks_step
from vllm_cascade_plugin.planning.planner import plan_cascade
from vllm_cascade_plugin.stats import counters as c
from vllm_cascade_plugin.step import session

PAGE = 16
# Three running requests, each on pages of its own; slot 3 is free until a request arrives.
OWN = np.array([[5, 6, 7], [15, 16, 17], [25, 26, 27], [0, 0, 0]], dtype=np.int32)


class Batch:
    """A V2 runner over ``OWN`` and the scheduler's output of each step, as vLLM changes them:
    every running request decodes one token; ``arrive`` and ``finish`` change who runs."""

    def __init__(self, running: int = 3) -> None:
        self.table = OWN.copy()
        self.seq = np.array([40, 41, 42, 33], dtype=np.int32)
        self.runner, _ = v2_runner(self.table, self.seq, np.ones(4, np.int32), False)
        self.running = [f"r{i}" for i in range(running)]
        self.new: list[str] = []
        self.finished: set[str] = set()
        self.resumed: set[str] = set()

    def arrive(self, slot: int, pages: list[int], computed: int) -> None:
        """A request arrives in ``slot`` holding ``pages`` (a prefix cache hit where they are
        another request's), ``computed`` tokens of them already in the cache."""
        self.table[slot] = pages
        self.runner.block_tables.append_block_ids(slot, (pages,), True)
        self.runner.block_tables.num_blocks.np[0, slot] = len(pages)
        self.runner.req_states.num_computed_tokens_np[slot] = computed
        self.seq[slot] = computed + 1
        self.running.append(f"r{slot}")
        self.new.append(f"r{slot}")

    def finish(self, req_id: str) -> None:
        self.running.remove(req_id)
        self.finished.add(req_id)

    def step(self) -> tuple[str | None, bool]:
        """One engine step through the hooks: (how it ended: its flat reason or None for
        cascade, whether plan_cascade finds a shared page in the rows it ran)."""
        so = SimpleNamespace(
            num_scheduled_tokens=dict.fromkeys(self.running, 1), scheduled_spec_decode_tokens={},
            scheduled_new_reqs=list(self.new), finished_req_ids=set(self.finished),
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(self.resumed)))
        rows = [int(r[1:]) for r in self.running]

        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            self.cudagraph_manager.dispatch(len(rows), len(rows), 1, 0)
            step = session.current
            if step is not None and step.decision.use_cascade:
                stats.record_cascade(1, 1, step.decode)
            return "output"

        before = stats.snapshot()
        assert hooks_step.execute_model(execute_model)(self.runner, so) == "output"
        now = stats.snapshot()
        assert now.steps_planned == before.steps_planned + 1
        reasons = list((now.flat_reasons - before.flat_reasons).keys())
        ended = None if now.steps_cascade > before.steps_cascade else reasons[0]
        plan = plan_cascade(self.table[rows], self.seq[rows], np.ones(len(rows), np.int32), PAGE)
        # Every running request decodes a token; the step's changes are now past.
        self.runner.req_states.num_computed_tokens_np[rows] = self.seq[rows]
        self.seq[rows] += 1
        self.new, self.finished, self.resumed = [], set(), set()
        return ended, plan.num_levels > 1


@pytest.fixture
def rows_read(monkeypatch):
    """How many steps the hook read the rows of (``v2_rows``)."""
    calls = []
    real = hooks_dispatch.v2_rows
    monkeypatch.setattr(hooks_dispatch, "v2_rows",
                        lambda runner, so: calls.append(1) or real(runner, so))
    return calls


def test_steady_steps_of_requests_that_share_nothing_are_flat_without_reading_rows(
        active_session, counters, rows_read):  # noqa: F811
    batch = Batch()
    for _ in range(4):
        assert batch.step() == (c.NO_SHARED, False)
    assert len(rows_read) == 1
    now = stats.snapshot()
    assert now.planning_paths[c.PATH_UNSHARED] == now.steps_planned == 4
    assert now.decode_steps_planned == 4 and now.decode_flat_reasons[c.NO_SHARED] == 4


def test_a_request_that_arrives_on_a_running_requests_pages_is_planned(
        active_session, counters, rows_read):  # noqa: F811
    batch = Batch()
    assert batch.step() == (c.NO_SHARED, False)
    assert batch.step() == (c.NO_SHARED, False)
    batch.arrive(3, [5, 6, 37], computed=2 * PAGE)  # r0's first two pages, from the cache
    assert batch.step() == (None, True)  # cascade (CASCADE_POLICY=always)
    assert batch.step() == (None, True)
    assert len(rows_read) == 3


@pytest.mark.parametrize("change", ["finish", "resume", "arrive unshared"])
def test_any_change_to_the_batch_reads_the_rows_again(active_session, counters, rows_read,  # noqa: F811
                                                      change):
    batch = Batch()
    assert batch.step() == (c.NO_SHARED, False)
    if change == "finish":
        batch.finish("r1")
    elif change == "resume":
        batch.resumed.add("r2")
    else:
        batch.arrive(3, [35, 36, 37], computed=0)
    assert batch.step() == (c.NO_SHARED, False)
    assert len(rows_read) == 2
    assert batch.step() == (c.NO_SHARED, False)  # steady again: not read
    assert len(rows_read) == 2


def test_the_same_requests_in_another_order_are_read(active_session, counters, rows_read):  # noqa: F811
    batch = Batch()
    batch.step()
    batch.running.reverse()
    assert batch.step() == (c.NO_SHARED, False)
    assert len(rows_read) == 2


def test_with_debug_every_step_is_planned(active_session, counters, rows_read):  # noqa: F811
    session.config = CascadeConfig(enabled=True, policy="always", debug=True)
    batch = Batch()
    held = batch.runner.block_tables.block_tables[0]
    held.gpu = torch.from_numpy(held.gpu)  # vLLM's ids on the device (read back in debug)
    for _ in range(3):
        assert batch.step() == (c.NO_SHARED, False)
    assert len(rows_read) == 3
    assert stats.snapshot().planning_paths.get(c.PATH_UNSHARED, 0) == 0


def test_a_step_that_shared_is_never_taken_as_unshared(active_session, counters, rows_read):  # noqa: F811
    batch = Batch()
    batch.arrive(3, [5, 6, 37], computed=2 * PAGE)
    for _ in range(3):
        assert batch.step() == (None, True)
    assert len(rows_read) == 3
