"""Row keys (CASCADE_PLAN_FROM_CHANGES): the runner hooks tell the planner which rows vLLM
changed. Guards on the vLLM code the keys stand on (they fail when vLLM changes how it writes
block ids), and engine-step sequences through the real hooks, each plan checked against a fresh
plan of the same rows (``plan_cascade``, which knows nothing of keys)."""

from __future__ import annotations

import inspect
import logging
import re
from types import SimpleNamespace

import numpy as np
import pytest

from test_hooks import (  # noqa: F401  (active_session is a fixture)
    active_session,
    block_tables,
    id_mappings,
    in_order,
    source,
)
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.integration import hooks_dispatch, hooks_step, row_keys
from vllm_cascade_plugin.planning.invariants import plan_violations
from vllm_cascade_plugin.planning.planner import plan_cascade
from vllm_cascade_plugin.step import session

# Every place vLLM's V1 worker writes a row of the CPU block table, by the method it is in.
V1_ROW_WRITES = {
    ("gpu_model_runner", "append_row"): "_update_states",
    ("gpu_input_batch", "add_row"): "add_request",
    ("gpu_input_batch", "clear_row"): "remove_request",
    ("gpu_input_batch", "swap_row"): "swap_states",
    ("gpu_input_batch", "move_row"): "condense",
}
V1_WRITERS = {"append_row", "add_row", "clear_row", "move_row", "swap_row", "clear",
              "commit_block_table", "compute_slot_mapping"}


def _enclosing(text: str, at: int) -> str:
    return re.findall(r"\n    def (\w+)\(", text[:at])[-1]


@pytest.mark.v1_runner
def test_v1_writes_a_row_anew_only_for_a_request_new_or_resumed():
    """The V1 promise: a request's row is written whole by ``add_request`` (new and resumed
    requests go there) and otherwise only appended to, in ``_update_states``; rows move with
    their request. A new writer, or a write from elsewhere, fails here."""
    from vllm.v1.worker import block_table, gpu_input_batch, gpu_model_runner

    for module in (gpu_model_runner, gpu_input_batch):
        text = inspect.getsource(module)
        name = module.__name__.rsplit(".", 1)[1]
        for match in re.finditer(r"block_table\.(\w+_row)\(", text):
            assert V1_ROW_WRITES.get((name, match.group(1))) == _enclosing(text, match.start()), (
                name, match.group(1), _enclosing(text, match.start()))
    methods = {n for n, _ in inspect.getmembers(block_table.BlockTable, inspect.isfunction)
               if not n.startswith("_")}
    assert {m for m in methods if "row" in m or m.startswith(("set", "write", "clear"))} <= \
        V1_WRITERS, methods
    update = source(gpu_model_runner.GPUModelRunner, "_update_states")
    # A resumed request is out of the batch and comes back through add_request (its row
    # written whole); append_row only for requests still in the batch.
    assert "resumed_from_preemption = req_id in req_data.resumed_req_ids" in update
    update = update[update.index("if not resumed_from_preemption:"):]
    assert in_order(update, "assert req_index is None", "req_state.block_ids = new_block_ids",
                    "if req_index is None:", "reqs_to_add.append(req_state)", "continue",
                    "self.input_batch.block_table.append_row(new_block_ids, req_index)",
                    "self.input_batch.add_request(")


def test_v2_overwrites_a_slot_only_for_a_new_request():
    from vllm.v1.worker.gpu import model_runner

    text = inspect.getsource(model_runner)
    calls = re.findall(r"block_tables\.append_block_ids\(([^)]*)\)", text)
    assert calls and all("overwrite=" in call for call in calls), calls
    for match in re.finditer(r"block_tables\.append_block_ids\(([^)]*)\)", text):
        fresh = "overwrite=True" in match.group(1)
        assert _enclosing(text, match.start()) == ("add_requests" if fresh
                                                   else "update_requests"), match.group(0)


class V1Batch:
    """A V1 runner's rows as the hooks read them, and the scheduler output of each step."""

    def __init__(self) -> None:
        self.req_ids: list[str] = []
        self.rows: list[list[int]] = []
        self.seq: list[int] = []

    def runner(self):
        n = len(self.req_ids)
        table = np.zeros((n + 2, 24), np.int32)  # wider and taller than the rows, as vLLM's
        for r, ids in enumerate(self.rows):
            table[r, :len(ids)] = ids
        seq = np.array(self.seq, np.int32)
        block_table = SimpleNamespace(block_table=SimpleNamespace(np=table),
                                      num_blocks_per_row=-(-seq // 16))
        batch = SimpleNamespace(num_reqs=n, req_ids=list(self.req_ids),
                                num_computed_tokens_cpu=seq - 1, block_table=[block_table])
        self.runner_ = getattr(self, "runner_", None) or SimpleNamespace(
            cudagraph_dispatcher=object(), kv_cache_config=SimpleNamespace(kv_cache_groups=[0]))
        self.runner_.input_batch = batch
        return self.runner_, table[:n], seq

    def output(self, new=(), resumed=(), finished=()):
        return SimpleNamespace(
            num_scheduled_tokens={r: 1 for r in self.req_ids},
            scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)),
            finished_req_ids=set(finished))


def run_step(batch: V1Batch, calls: list, **changes):
    """One engine step through the hooks; its plan is checked against a fresh one."""
    runner, table, seq = batch.runner()
    so = batch.output(**changes)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        step = hooks_step.pending
        hooks_dispatch.plan_once(step, hooks_dispatch.v1_plan)
        plan = session.current.plan
        q = np.ones(len(seq), np.int32)
        assert plan_violations(plan, table, seq, q) == []
        fresh = plan_cascade(table, seq, q, 16)
        assert [lv.kv_page_indices.tolist() for lv in plan.levels] == \
            [lv.kv_page_indices.tolist() for lv in fresh.levels]
        return "output"

    assert hooks_step.execute_model(execute_model)(runner, so) == "output"
    return calls[-1]


@pytest.fixture
def planner_calls(active_session, monkeypatch):  # noqa: F811
    calls: list = []
    real = session._planner.plan
    monkeypatch.setattr(session._planner, "plan", lambda *a, **k: calls.append(
        None if a[4] is None else a[4].copy()) or real(*a, **k))
    return calls


def test_v1_keys_follow_new_resumed_moved_and_finished_requests(planner_calls, caplog):
    prefix = [5, 6, 7]
    batch = V1Batch()
    batch.req_ids = ["a", "b", "c"]
    batch.rows = [[*prefix, 10], [*prefix, 11], [*prefix, 12]]
    batch.seq = [60, 61, 62]
    stats.reset()  # the INFO line is logged once per process
    with caplog.at_level(logging.INFO, logger="vllm.cascade_plugin"):
        first = run_step(batch, planner_calls, new=["a", "b", "c"])
    assert first is not None and len(set(first.tolist())) == 3
    assert "planned from the rows vLLM changed" in caplog.text
    batch.seq = [s + 1 for s in batch.seq]  # decode: the same requests, the same keys
    assert run_step(batch, planner_calls).tolist() == first.tolist()
    # "b" is preempted and resumed with other block ids at the same row: a new key there.
    batch.rows[1] = [5, 6, 40, 41]
    resumed = run_step(batch, planner_calls, resumed=["b"])
    assert resumed[0] == first[0] and resumed[2] == first[2] and resumed[1] not in first
    # "a" finishes; vLLM moves "c" into its row: a key row 0 never had.
    batch.req_ids, batch.rows, batch.seq = ["c", "b"], [batch.rows[2], batch.rows[1]], \
        [batch.seq[2], batch.seq[1]]
    moved = run_step(batch, planner_calls, finished=["a"])
    assert moved.tolist() == [first[2], resumed[1]]
    # A new request "d" shares the prefix of "c".
    batch.req_ids.append("d")
    batch.rows.append([*prefix, 30])
    batch.seq.append(55)
    grown = run_step(batch, planner_calls, new=["d"])
    assert grown[:2].tolist() == moved.tolist() and grown[2] not in (*first, *resumed)
    assert "a" not in batch.runner_.__dict__[row_keys.V1_KEYS].keys


def test_v1_keys_are_dropped_when_a_step_cannot_be_read(planner_calls, caplog):
    batch = V1Batch()
    batch.req_ids, batch.rows, batch.seq = ["a", "b"], [[5, 6, 9], [5, 6, 8]], [40, 41]
    assert run_step(batch, planner_calls, new=["a", "b"]) is not None
    runner, _, _ = batch.runner()

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return "output"

    broken = SimpleNamespace(finished_req_ids=set())  # no scheduled_new_reqs: unreadable
    with caplog.at_level(logging.WARNING, logger="vllm.cascade_plugin"):
        assert hooks_step.execute_model(execute_model)(runner, broken) == "output"
    assert runner.__dict__[row_keys.V1_KEYS] is False
    assert "compares every row's block ids" in caplog.text
    # From now on the planner compares block ids, and plans as before.
    batch.seq = [s + 1 for s in batch.seq]
    assert run_step(batch, planner_calls) is None


def test_v1_plans_without_keys_when_plan_from_changes_is_off(planner_calls):
    session.config = session.config.__class__(**{**vars(session.config),
                                                 "plan_from_changes": False})
    batch = V1Batch()
    batch.req_ids, batch.rows, batch.seq = ["a", "b"], [[5, 6, 9], [5, 6, 8]], [40, 41]
    assert run_step(batch, planner_calls, new=["a", "b"]) is None


@pytest.mark.parametrize("state", id_mappings(), ids=str)
def test_v2_slot_keys_change_on_overwrite_only(state):
    tables = block_tables(**state)
    tables.append_block_ids(2, ([7, 8, 9],), overwrite=True)
    tables.append_block_ids(1, ([3, 4],), overwrite=True)
    index = np.array([2, 1])
    first = row_keys.v2_rows(tables, index).copy()
    assert first[0] != first[1] and 0 not in first
    tables.append_block_ids(2, ([10],), overwrite=False)  # appended: the same key
    assert row_keys.v2_rows(tables, index).tolist() == first.tolist()
    tables.append_block_ids(2, ([11, 12],), overwrite=True)  # the slot reused: a new key
    again = row_keys.v2_rows(tables, index)
    assert again[1] == first[1] and again[0] not in first


def test_v1_steady_decode_skips_the_pre_checks_and_plans_as_fresh(planner_calls, monkeypatch):
    """A step of the last step's requests, each one token longer, continues it: the runner
    hooks ask neither pre-check (sharing from first block ids, the cost model's floor), and
    its plan is still a fresh plan's (``run_step`` checks); a step with a new request asks."""
    asked: list[str] = []
    for name in ("skip_unshared", "cannot_win"):
        real = getattr(session, name)
        monkeypatch.setattr(session, name, lambda *a, _n=name, _r=real: asked.append(_n) or
                            _r(*a))
    batch = V1Batch()
    batch.req_ids, batch.rows, batch.seq = ["a", "b"], [[5, 6, 9], [5, 6, 8]], [40, 41]
    run_step(batch, planner_calls, new=["a", "b"])
    assert asked == ["skip_unshared", "cannot_win"]
    for _ in range(9):  # into a new page on the way: 48 -> 49 tokens
        batch.seq = [s + 1 for s in batch.seq]
        if batch.seq[0] == 49:
            batch.rows[0].append(20)
        if batch.seq[1] == 49:
            batch.rows[1].append(21)
        run_step(batch, planner_calls)
    assert asked == ["skip_unshared", "cannot_win"]
    batch.req_ids.append("c")
    batch.rows.append([5, 6, 30])
    batch.seq.append(35)
    run_step(batch, planner_calls, new=["c"])
    assert asked == ["skip_unshared", "cannot_win"] * 2
