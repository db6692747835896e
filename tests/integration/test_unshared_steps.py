"""Both runners' hooks on steps that share nothing: once the pre-check has proved a step's
rows share no page, later steps are known unshared from the first block ids of the requests
that came since (``unshared_rows``), without every row being read. Whether a step shares is
checked against the planner run on the whole block table (``plan_cascade``), never against the
hook's own answer, over serving runs simulated as vLLM's scheduler and prefix cache make them:
requests arriving on a cached prompt's pages or on pages of their own, chunked prefills,
requests finishing, preempted and resumed, not scheduled for a step, freed block ids reused."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from test_hooks import (  # noqa: F401  (active_session: a fixture)
    Counts,
    StagedRows,
    active_session,
    block_tables,
    captured_graphs,
    id_mappings,
)
from test_step_ends import counters  # noqa: F401  (a fixture)
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.integration import hooks_dispatch, hooks_step
from vllm_cascade_plugin.planning.planner import plan_cascade
from vllm_cascade_plugin.stats import counters as c
from vllm_cascade_plugin.step import session

PAGE, SLOTS, WIDTH = 16, 24, 48
PROMPTS = {g: [1000 * (g + 1) + i for i in range(3)] for g in range(2)}  # 3 pages each


class Engine:
    """A V2 runner's state (block ids written through vLLM's real ``BlockTables``) and the
    scheduler's output, step by step, as vLLM makes them; ``v1``: the steps go through the V1
    runner's hook instead, which reads the same block ids from its persistent batch (the step's
    requests in rows 0..n-1, as vLLM condenses it before the hook)."""

    def __init__(self, v1: bool = False) -> None:
        self.v1 = v1
        batch = SimpleNamespace(block_table=[SimpleNamespace(block_table=SimpleNamespace())])
        self.v1_runner = SimpleNamespace(input_batch=batch, cudagraph_dispatcher=object(),
                                         kv_cache_config=SimpleNamespace(kv_cache_groups=[0]))
        self.tables = block_tables(**id_mappings()[0],  # kernel blocks = KV blocks
                                   block_tables=[StagedRows((SLOTS, WIDTH))],
                                   num_blocks=Counts((1, SLOTS)))
        self.table = np.zeros((SLOTS, WIDTH), np.int32)
        self.computed = np.zeros(SLOTS, np.int32)
        self.prompt = np.zeros(SLOTS, np.int32)  # tokens of each request's prompt
        self.slot: dict[str, int] = {}
        self.runner = SimpleNamespace(
            block_tables=self.tables, decode_query_len=1, cudagraph_manager=captured_graphs()[0],
            req_states=SimpleNamespace(req_id_to_index=self.slot,
                                       num_computed_tokens_np=self.computed))
        self.free = list(range(SLOTS))
        self.free_ids: list[int] = []  # freed block ids, handed out again first
        self.next_id = 1
        self.cached: set[int] = set()  # prompts whose pages are in the prefix cache
        self.count = 0
        self.new: list[str] = []
        self.finished: set[str] = set()
        self.preempted: set[str] = set()
        self.waiting: list[tuple[str, int | None]] = []  # preempted: (request, prompt group)
        self.group: dict[str, int | None] = {}

    def _fresh(self, n: int) -> list[int]:
        ids = []
        for _ in range(n):
            if self.free_ids:
                ids.append(self.free_ids.pop())
            else:
                ids.append(self.next_id)
                self.next_id += 1
        return ids

    def _write(self, slot: int, ids: list[int], overwrite: bool) -> None:
        start = 0 if overwrite else int(self.tables.num_blocks.np[0, slot])
        self.tables.append_block_ids(slot, (ids,), overwrite)
        self.tables.num_blocks.np[0, slot] = start + len(ids)
        self.table[slot, start:start + len(ids)] = ids

    def arrive(self, group: int | None, req_id: str | None = None) -> None:
        """A request (new, or ``req_id`` resumed) of a shared prompt or one of its own: on the
        prompt's cached pages where they are cached, else on pages of its own."""
        if not self.free:
            return
        if req_id is None:
            req_id, self.count = f"r{self.count}", self.count + 1
        slot = self.free.pop(0)
        self.slot[req_id], self.group[req_id] = slot, group
        owned = {self.table[s, 0] for s in self.slot.values()}
        if group is not None and group in self.cached:  # a prefix cache hit
            pages, self.computed[slot] = list(PROMPTS[group]), 3 * PAGE
        elif group is not None and PROMPTS[group][0] not in owned:  # its pages, to be cached
            pages, self.computed[slot] = list(PROMPTS[group]), 0
        else:
            pages, self.computed[slot] = self._fresh(3), 0
        self.prompt[slot] = 3 * PAGE + 5
        self._write(slot, pages, True)
        self.new.append(req_id)

    def leave(self, req_id: str, preempted: bool = False) -> None:
        slot = self.slot.pop(req_id)
        used = self.table[slot, :self.tables.num_blocks.np[0, slot]].tolist()
        self.free_ids += [i for i in used if i not in PROMPTS.get(self.group[req_id], ())]
        self.free.append(slot)
        if preempted:
            self.preempted.add(req_id)
            self.waiting.append((req_id, self.group[req_id]))
        else:
            self.finished.add(req_id)

    def step(self, skipped: set[str] = frozenset()) -> tuple[str | None, bool]:
        """One engine step through the hooks, every request but ``skipped`` scheduled (prefills
        in chunks of up to 20 tokens): (how it ended, its flat reason or None for cascade;
        whether plan_cascade finds a shared page in the rows it ran)."""
        running = [r for r in self.slot if r not in skipped]
        tokens = {}
        for r in running:
            s = self.slot[r]
            tokens[r] = int(max(1, min(20, self.prompt[s] - self.computed[s])))
            pages = -(-(self.computed[s] + tokens[r]) // PAGE)
            if pages > self.tables.num_blocks.np[0, s]:
                self._write(s, self._fresh(int(pages - self.tables.num_blocks.np[0, s])), False)
        so = SimpleNamespace(
            num_scheduled_tokens=tokens, scheduled_spec_decode_tokens={},
            scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in self.new],
            finished_req_ids=set(self.finished), preempted_req_ids=set(self.preempted),
            scheduled_cached_reqs=SimpleNamespace())

        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            if isinstance(getattr(self, "input_batch", None), SimpleNamespace):
                determine(self)
            else:
                self.cudagraph_manager.dispatch(len(tokens), len(tokens), 1, 0)
            step = session.current
            if step is not None and step.decision.use_cascade:
                stats.record_cascade(1, 1, step.decode)
            return "output"

        before = stats.snapshot()
        runner = self._v1_batch(running) if self.v1 else self.runner
        assert hooks_step.execute_model(execute_model)(runner, so) == "output"
        now = stats.snapshot()
        assert now.steps_planned == before.steps_planned + 1
        [ended] = [None] if now.steps_cascade > before.steps_cascade else list(
            (now.flat_reasons - before.flat_reasons).keys())
        rows = np.array([self.slot[r] for r in running], dtype=np.int64)
        query = np.array([tokens[r] for r in running], dtype=np.int32)
        plan = plan_cascade(self.table[rows], self.computed[rows] + query, query, PAGE)
        self.computed[rows] += query
        for r in running:
            g, s = self.group[r], self.slot[r]
            if g is not None and self.table[s, 0] == PROMPTS[g][0] and self.computed[s] >= 3 * PAGE:
                self.cached.add(g)  # its prompt's pages are full: in the prefix cache
        self.new, self.finished, self.preempted = [], set(), set()
        return ended, plan.num_levels > 1

    def _v1_batch(self, running: list[str]) -> SimpleNamespace:
        """The V1 runner with its persistent batch as vLLM leaves it for the step's hook."""
        rows = [self.slot[r] for r in running]
        batch = self.v1_runner.input_batch
        batch.num_reqs, batch.req_ids = len(running), list(running)
        batch.req_id_to_index = {r: i for i, r in enumerate(running)}
        batch.num_computed_tokens_cpu = self.computed[rows]
        batch.block_table[0].block_table.np = self.table[rows]
        batch.block_table[0].num_blocks_per_row = self.tables.num_blocks.np[0, rows]
        return self.v1_runner


determine = hooks_dispatch.v1_determine_batch_execution(lambda self: None)


@pytest.fixture
def rows_read(monkeypatch):
    """How many steps the hook read the rows of (``plan_rows``: both runners' hooks call it
    with the rows they read, after the known-unshared and held-flat checks)."""
    calls = []
    real = hooks_dispatch.plan_rows
    monkeypatch.setattr(hooks_dispatch, "plan_rows",
                        lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    return calls


@pytest.fixture(params=["v2", "v1"])
def runner(request, active_session):  # noqa: F811
    """Which runner's hook the simulated engine's steps go through (the V1 runner's known
    unshared steps with CASCADE_UNVERIFIED, their switch until they run on a GPU)."""
    if request.param == "v1":
        active_session.config = dataclasses.replace(active_session.config, unverified=True)
    return request.param


def engine_of_own_prompts(count: int = 3, v1: bool = False) -> Engine:
    engine = Engine(v1)
    for _ in range(count):
        engine.arrive(None)
    return engine


def test_steady_steps_of_requests_that_share_nothing_are_flat_without_reading_rows(
        active_session, counters, rows_read, runner):  # noqa: F811
    engine = engine_of_own_prompts(v1=runner == "v1")
    for _ in range(6):
        assert engine.step() == (c.NO_SHARED, False)
    assert len(rows_read) == 1
    now = stats.snapshot()
    assert now.planning_paths[c.PATH_UNSHARED] == now.steps_planned == 6
    assert now.decode_steps_planned == 3  # three prefill chunks (53 tokens), then decode


def test_without_cascade_unverified_the_v1_runner_reads_every_step(
        active_session, counters, rows_read):  # noqa: F811
    engine = engine_of_own_prompts(v1=True)
    for _ in range(4):
        assert engine.step() == (c.NO_SHARED, False)
    assert len(rows_read) == 4
    assert stats.snapshot().planning_paths[c.PATH_UNSHARED] == 4  # each by its pre-check


def test_requests_that_come_and_go_on_pages_of_their_own_are_known_without_their_rows(
        active_session, counters, rows_read, runner):  # noqa: F811
    engine = engine_of_own_prompts(v1=runner == "v1")
    assert engine.step() == (c.NO_SHARED, False)
    engine.leave("r1")
    engine.arrive(None)  # on r1's freed block ids
    assert engine.step() == (c.NO_SHARED, False)
    engine.leave("r0", preempted=True)
    assert engine.step() == (c.NO_SHARED, False)
    engine.arrive(None, "r0")  # resumed (a new request in 0.34)
    assert engine.step() == (c.NO_SHARED, False)
    assert len(rows_read) == 1


def test_a_request_that_arrives_on_a_running_requests_pages_is_planned(
        active_session, counters, rows_read, runner):  # noqa: F811
    engine = engine_of_own_prompts(2, v1=runner == "v1")
    engine.arrive(0)
    for _ in range(3):  # its prompt's pages fill and are cached
        assert engine.step() == (c.NO_SHARED, False)
    engine.arrive(0)  # on them
    assert engine.step() == (None, True)  # cascade (CASCADE_POLICY=always)
    assert engine.step() == (None, True)
    assert len(rows_read) == 3


def test_a_request_not_run_since_the_proof_is_looked_up(
        active_session, counters, rows_read, runner):  # noqa: F811
    engine = engine_of_own_prompts(2, v1=runner == "v1")
    engine.arrive(0)  # r2: the shared prompt's first request
    for _ in range(3):  # its pages fill and are cached
        assert engine.step() == (c.NO_SHARED, False)
    engine.arrive(0)  # r3: on r2's pages
    assert engine.step(skipped={"r2"}) == (c.NO_SHARED, False)  # r2 not run: kept r0, r1, r3
    assert engine.step() == (None, True)  # r2 runs again
    assert len(rows_read) == 3


def test_with_debug_every_step_is_planned(active_session, counters, rows_read):  # noqa: F811
    session.config = CascadeConfig(enabled=True, policy="always", debug=True)
    engine = engine_of_own_prompts()
    held, ids = engine.tables.block_tables[0], engine.tables.block_tables[0].gpu
    held.gpu = torch.from_numpy(ids)  # vLLM's ids on the device (read back in debug)

    def stage_write(row, start, new):
        ids[row, start:start + len(new)] = new
    held.stage_write = stage_write
    for _ in range(3):
        assert engine.step() == (c.NO_SHARED, False)
    assert len(rows_read) == 3
    assert stats.snapshot().planning_paths.get(c.PATH_UNSHARED, 0) == 0


@pytest.mark.parametrize("seed", range(6))
def test_serving_runs_share_exactly_where_the_planner_finds_shared_pages(
        active_session, counters, rows_read, runner, seed):  # noqa: F811
    rng = np.random.default_rng(seed)
    engine, steps, shared_steps, unshared_reads = Engine(runner == "v1"), 300, 0, 0
    sharing = 0.03 + 0.02 * seed  # of arrivals, on a shared prompt
    for _ in range(steps):
        if not engine.slot:
            engine.arrive(None)
        for _ in range(int(rng.integers(0, 3))):
            engine.arrive(int(rng.integers(0, 2)) if rng.random() < sharing else None)
        if engine.waiting and rng.random() < 0.3:
            engine.arrive(*reversed(engine.waiting.pop(0)))
        for r in list(engine.slot):
            if r not in engine.new and rng.random() < 0.06:
                engine.leave(r, preempted=rng.random() < 0.2)
        skipped = {r for r in engine.slot if r not in engine.new and rng.random() < 0.05}
        read = len(rows_read)
        ended, shares = engine.step(skipped)
        assert (ended is None) == shares and ended in (None, c.NO_SHARED, c.SINGLE)
        shared_steps += shares
        unshared_reads += (not shares) and len(rows_read) > read
    assert 0 < shared_steps < steps
    assert unshared_reads < (steps - shared_steps) / 4  # most unshared steps were not read
