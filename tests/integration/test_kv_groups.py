"""An engine of several KV-cache groups (vLLM's hybrid KV-cache manager: a model's sliding-window
layers in groups beside its full-attention one): which group's block table a step is planned
from, that only that group's builders may run the plan, and that Model Runner V2's CPU mirror of
the block ids holds every group's ids as vLLM writes them. The reference for each plan is a fresh
``plan_cascade`` of the planned group's own rows. Beside recurrent groups, off unless
``CASCADE_UNVERIFIED``."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from test_hooks import Counts, StagedRows, block_tables, id_mappings
from vllm_cascade_plugin import stats
from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.integration import hooks_dispatch, hooks_step, kv_groups
from vllm_cascade_plugin.integration.hooks_step import PendingStep
from vllm_cascade_plugin.planning.cost import AttentionShape, cost_model_for
from vllm_cascade_plugin.planning.planner import plan_cascade
from vllm_cascade_plugin.step import BuilderSettings, session

SHAPE = AttentionShape(8, 2, 128, 2, num_layers=2)
ATTN = "model.layers.{}.self_attn.attn"
SLIDING_LAYERS, FULL_LAYERS = [ATTN.format(i) for i in (0, 2)], [ATTN.format(i) for i in (1, 3)]
WHOLE_STEP, PER_LAYER = cost_model_for("fa3"), cost_model_for("fa3", full_graphs=False)


def spec(kind: str):
    """A vLLM KV-cache spec of ``kind`` (its class is all the hooks read)."""
    from vllm.v1 import kv_cache_interface as kv

    return object.__new__({"full": kv.FullAttentionSpec, "sliding": kv.SlidingWindowSpec,
                           "mamba": kv.MambaSpec, "chunked": kv.ChunkedLocalAttentionSpec}[kind])


def groups(*kinds_and_layers):
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=spec(kind), layer_names=list(layers))
        for kind, layers in kinds_and_layers])


HYBRID = (("sliding", SLIDING_LAYERS), ("full", FULL_LAYERS))
RECURRENT = (("mamba", ["model.layers.0.mixer", "model.layers.2.mixer"]), ("full", FULL_LAYERS))


def settings(layers, unsupported=None, unverified=True) -> BuilderSettings:
    return BuilderSettings(CascadeConfig(enabled=True, policy="always", unverified=unverified),
                           SHAPE, 16, unsupported, steady_cost_model=WHOLE_STEP,
                           layer_graphs_cost_model=PER_LAYER, layers=frozenset(layers))


@pytest.fixture
def hybrid_session():
    """The session as a hybrid model's builders leave it: the sliding-window layers' builder
    cannot run cascade, the full layers' can (steps are planned for it)."""
    def make(unverified=True):
        session.register(SLIDING_LAYERS, settings(SLIDING_LAYERS, "sliding-window attention",
                                                  unverified))
        session.register(FULL_LAYERS, settings(FULL_LAYERS, unverified=unverified))
        return session
    stats.reset()
    yield make
    stats.reset()


def test_an_engine_of_one_group_plans_it_without_reading_its_layout(hybrid_session):
    hybrid_session()
    assert kv_groups.planned_group(SimpleNamespace(), 1) == (0, None)


def test_by_default_a_recurrent_hybrids_step_runs_flat_and_says_how_to_turn_it_on(
        hybrid_session, caplog):
    hybrid_session(unverified=False)
    runner = SimpleNamespace(kv_cache_config=groups(*RECURRENT))
    assert kv_groups.planned_group(runner, 2) is None
    assert stats.snapshot().fallbacks == {kv_groups.SEVERAL_GROUPS: 1}
    assert "CASCADE_UNVERIFIED=1" in caplog.text and "recurrent hybrid" in caplog.text


def test_by_default_a_sliding_window_hybrids_full_attention_group_is_planned(hybrid_session):
    """Beside sliding-window groups (Gemma 3, gpt-oss) the full-attention layers' group is
    planned without CASCADE_UNVERIFIED (on a GPU: tests/gpu/test_sliding_window_engine.py)."""
    hybrid_session(unverified=False)
    runner = SimpleNamespace(kv_cache_config=groups(*HYBRID))
    assert kv_groups.planned_group(runner, 2) == (1, frozenset(FULL_LAYERS))
    assert stats.snapshot().fallbacks == {}


def test_by_default_an_engine_of_a_recurrent_hybrid_stands_down_after_its_first_step(
        hybrid_session):
    """The reason holds for every step of the engine: after the first, no step is made pending
    (nothing planned or counted: vLLM's path as without the plugin), until a builder registers
    again and a step meets the reason again."""
    hybrid_session(unverified=False)
    runner = SimpleNamespace(kv_cache_config=groups(*RECURRENT))
    seen = []

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        seen.append(hooks_step.pending)
        if hooks_step.pending is not None:
            hooks_dispatch.plan_once(hooks_step.pending,
                                     lambda step: kv_groups.planned_group(step.runner, 2))
        return "output"

    wrapped = hooks_step.execute_model(execute_model)
    so = SimpleNamespace(num_scheduled_tokens={"a": 1})
    for _ in range(3):
        assert wrapped(runner, so) == "output"
    assert seen[0] is not None and seen[1:] == [None, None]
    assert not session.active
    assert stats.snapshot().fallbacks == {kv_groups.SEVERAL_GROUPS: 1}
    session.register(FULL_LAYERS, settings(FULL_LAYERS, unverified=False))  # vLLM's new builder
    assert session.active
    assert wrapped(runner, so) == "output" and seen[-1] is not None
    assert not session.active and stats.snapshot().fallbacks == {kv_groups.SEVERAL_GROUPS: 2}


def test_the_full_attention_layers_group_is_planned_with_per_layer_graphs_cost(hybrid_session):
    hybrid_session()
    assert session.steady_cost_model is WHOLE_STEP
    runner = SimpleNamespace(kv_cache_config=groups(*HYBRID))
    assert kv_groups.planned_group(runner, 2) == (1, frozenset(FULL_LAYERS))
    assert session.steady_cost_model is PER_LAYER  # no whole-step graphs in such an engine
    assert stats.snapshot().fallbacks == {}


def test_a_recurrent_hybrids_attention_group_is_planned_beside_its_mamba_state(hybrid_session):
    """With CASCADE_UNVERIFIED, a Mamba or linear-attention hybrid (vLLM gives both a MambaSpec
    group): the attention layers' group is planned, the recurrent layers' group left to its own
    builders."""
    hybrid_session()
    runner = SimpleNamespace(kv_cache_config=groups(*RECURRENT))
    assert kv_groups.planned_group(runner, 2) == (1, frozenset(FULL_LAYERS))
    assert stats.snapshot().fallbacks == {}


@pytest.mark.parametrize(("layout", "detail"), [
    ((("chunked", ["model.layers.0.self_attn.attn"]), ("full", FULL_LAYERS)),
     "ChunkedLocalAttentionSpec"),
    ((("full", FULL_LAYERS[:1]), ("full", FULL_LAYERS[1:])), "no one KV-cache group"),
])
def test_groups_other_than_sliding_window_and_recurrent_ones_keep_the_step_flat(
        hybrid_session, caplog, layout, detail):
    hybrid_session()
    runner = SimpleNamespace(kv_cache_config=groups(*layout))
    assert kv_groups.planned_group(runner, 2) is None
    assert stats.snapshot().fallbacks == {kv_groups.SEVERAL_GROUPS: 1}
    assert detail in caplog.text


def hybrid_tables():
    """vLLM's real BlockTables methods over two groups (sliding, full) of 4 slots."""
    tables = block_tables(**id_mappings()[0])  # kernel blocks = KV blocks
    tables.num_kv_cache_groups = 2
    tables.block_tables = [StagedRows((4, 32)), StagedRows((4, 32))]
    tables.num_blocks = Counts((2, 4))
    if hasattr(tables, "blocks_per_kv_block"):
        tables.blocks_per_kv_block = [1, 1]
    return tables


def test_v2_mirror_holds_every_groups_ids_as_vllm_writes_them():
    tables = hybrid_tables()
    tables.append_block_ids(2, ([7, 8, 9], [17, 18, 19]), overwrite=True)
    tables.append_block_ids(2, ([10], [20]), overwrite=False)
    tables.append_block_ids(1, ([3, 4], [13, 14]), overwrite=True)
    tables.append_block_ids(2, ([0, 12], [21, 22]), overwrite=True)  # a reused slot rewritten
    mirrors = tables.__dict__[hooks_dispatch.MIRROR]
    assert len(mirrors) == 2
    for g in range(2):
        for row in range(4):
            count = tables.num_blocks.np[g, row]
            assert np.array_equal(mirrors[g][row, :count],
                                  tables.block_tables[g].gpu[row, :count])
    assert mirrors[1][2, :2].tolist() == [21, 22]


def v2_hybrid_runner(sliding: np.ndarray, full: np.ndarray, seq: np.ndarray):
    """A V2 runner of the hybrid layout whose slots 0..3 hold ``sliding`` and ``full`` ids."""
    tables = hybrid_tables()
    for row in range(len(seq)):
        tables.append_block_ids(row, (sliding[row].tolist(), full[row].tolist()), True)
    names = [f"r{i}" for i in range(len(seq))]
    states = SimpleNamespace(req_id_to_index={n: i for i, n in enumerate(names)},
                             num_computed_tokens_np=seq - 1)
    runner = SimpleNamespace(block_tables=tables, req_states=states, decode_query_len=1,
                             kv_cache_config=groups(*HYBRID))
    so = SimpleNamespace(num_scheduled_tokens={n: 1 for n in names},
                         scheduled_spec_decode_tokens={}, scheduled_new_reqs=[],
                         finished_req_ids=set(),
                         scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()))
    return runner, so


# Four requests sharing three pages in the full group; in the sliding group the pages below the
# window are the null block 0 and the rest differ (vLLM frees what left the window).
FULL = np.array([[5, 6, 7, 40], [5, 6, 7, 41], [5, 6, 7, 42], [5, 6, 7, 43]], np.int32)
SLIDING = np.array([[0, 0, 60, 70], [0, 0, 61, 71], [0, 0, 62, 72], [0, 0, 63, 73]], np.int32)
SEQ = np.full(4, 60, np.int32)


def test_a_v2_step_is_planned_from_the_full_groups_ids_and_only_its_builders_take_it(
        hybrid_session):
    hybrid_session()
    runner, so = v2_hybrid_runner(SLIDING, FULL, SEQ)
    assert hooks_dispatch.v2_plan(PendingStep(runner, so)) is True
    step = session.current
    expected = plan_cascade(FULL, SEQ, np.ones(4, np.int32), 16)
    assert step.plan.stats == expected.stats and step.plan.num_levels == 2
    assert step.plan.levels[0].kv_page_indices.tolist() == [5, 6, 7]
    assert step.group_layers == frozenset(FULL_LAYERS)
    full, sliding = settings(FULL_LAYERS), settings(SLIDING_LAYERS)
    assert step.planned_for(full)
    assert not step.planned_for(sliding)  # same shape and page size, another group's ids
    same_shape_elsewhere = dataclasses.replace(full, layers=frozenset({ATTN.format(9)}))
    assert not step.planned_for(same_shape_elsewhere)


def test_a_v1_step_is_planned_from_the_full_groups_block_table(hybrid_session):
    hybrid_session()
    n = len(SEQ)

    def table(ids):
        return SimpleNamespace(block_table=SimpleNamespace(np=ids),
                               num_blocks_per_row=np.full(n, ids.shape[1]))

    batch = SimpleNamespace(num_reqs=n, req_ids=[f"r{i}" for i in range(n)],
                            num_computed_tokens_cpu=SEQ - 1,
                            block_table=[table(SLIDING), table(FULL)])
    runner = SimpleNamespace(input_batch=batch, kv_cache_config=groups(*HYBRID))
    so = SimpleNamespace(num_scheduled_tokens=dict.fromkeys(batch.req_ids, 1))
    assert hooks_dispatch.v1_plan(PendingStep(runner, so)) is True
    assert session.current.plan.levels[0].kv_page_indices.tolist() == [5, 6, 7]
    assert session.current.group_layers == frozenset(FULL_LAYERS)
