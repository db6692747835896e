"""Guards for every runtime patch of vLLM (hooks.py): they fail loudly when vLLM changes.

They run against whichever vLLM is installed; CI runs them on 0.26.0, 0.33.0 and 0.34.0.
"""

import ast
import dataclasses
import inspect
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
from packaging.version import Version

from vllm_cascade_plugin.config import CascadeConfig
from vllm_cascade_plugin.integration import compat, hooks, hooks_dispatch, hooks_step
from vllm_cascade_plugin.integration.compat import releases, sources
from vllm_cascade_plugin.planning.cost import AttentionShape
from vllm_cascade_plugin.step import session


def vllm_release() -> tuple[int, int]:
    release = Version(releases.installed_version("vllm") or "0").release
    return (*release, 0, 0)[:2]


def expected_signatures() -> dict[tuple[str, str, str], tuple[str, ...]]:
    """The signatures recorded for the installed vLLM (compat.releases.PATCHED_METHODS, written
    by hand from each release's source): the newest record at or before it (one between two
    recorded releases is checked against the older one, and fails where it differs)."""
    version = releases.installed_version("vllm") or "0"
    assert releases._release(version) >= Version("0.26.0"), f"no record for vLLM {version}"
    return releases.recorded_methods(version)


def key(owner: type, name: str) -> tuple[str, str, str]:
    return (owner.__module__, owner.__name__, name)


def written(fn) -> tuple[str, ...]:
    """``fn``'s parameters as the records write them: names, order and kinds, no defaults."""
    kinds = inspect.Parameter
    out: list[str] = []
    params = list(inspect.signature(fn).parameters.values())
    for i, p in enumerate(params):
        if p.kind is kinds.KEYWORD_ONLY and (i == 0 or params[i - 1].kind not in (
                kinds.KEYWORD_ONLY, kinds.VAR_POSITIONAL)):
            out.append("*")
        out.append({kinds.VAR_POSITIONAL: f"*{p.name}",
                    kinds.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name))
        if p.kind is kinds.POSITIONAL_ONLY and (
                i + 1 == len(params) or params[i + 1].kind is not kinds.POSITIONAL_ONLY):
            out.append("/")
    return tuple(out)


# Every way a V2 batch can match a captured graph: a new one could let a cascade step into a
# FULL graph, so it must be looked at (and added to compat.V2_FULL_GRAPH_ARGUMENTS if it does).
V2_GRAPH_MATCH_ARGUMENTS = {"desc", "num_reqs", "num_tokens", "num_active_loras", "num_ubatches",
                            *compat.V2_FULL_GRAPH_ARGUMENTS}


def original(fn):
    return getattr(fn, hooks._PATCHED, fn)


def parameters(fn):
    return list(inspect.signature(original(fn)).parameters)


@pytest.mark.parametrize("target", hooks.patch_targets(),
                         ids=lambda t: f"{t[0].__module__}.{t[0].__name__}.{t[1]}")
def test_patched_vllm_method_has_exactly_the_recorded_parameters(target):
    owner, name, _ = target
    assert written(original(getattr(owner, name))) == expected_signatures()[key(owner, name)]


def test_every_patched_method_has_a_recorded_signature():
    assert {key(owner, name) for owner, name, _ in hooks.patch_targets()} == set(
        expected_signatures())


def test_model_runner_v1_is_patched_exactly_where_vllm_has_it():
    """0.26-0.33 have both runners; 0.34 removed V1 (and its CUDA-graph dispatcher)."""
    has_v1 = releases._release(releases.installed_version("vllm") or "0") < Version("0.34.0")
    patched = {owner.__module__ for owner, _, _ in hooks.patch_targets()}
    assert compat.v1_model_runner() is has_v1
    assert ("vllm.v1.worker.gpu_model_runner" in patched) is has_v1
    assert ("vllm.v1.cudagraph_dispatcher" in patched) is has_v1


@pytest.mark.parametrize("target", hooks.patch_targets(),
                         ids=lambda t: f"{t[0].__module__}.{t[0].__name__}.{t[1]}")
def test_reading_a_patched_method_from_its_source_gives_what_python_gives(target):
    """The startup check of an untested vLLM reads parameters from source files (no import):
    for every patched method of the installed vLLM it must read what inspect reads."""
    owner, name, _ = target
    tree = sources.parse(sources.module_file(owner.__module__))
    assert tree is not None
    found = sources.definitions(tree, f"{owner.__name__}.{name}")
    assert found and sources.written_signature(found[-1]) == written(
        original(getattr(owner, name)))


def test_the_installed_vllm_reads_as_its_record_from_source_and_no_record_is_untested():
    """What ``CASCADE_ALLOW_UNTESTED_VLLM`` checks, run on the installed (tested) vLLM against
    its own record: nothing changed; and no record is for a release past the newest tested."""
    assert max(releases.PATCHED_METHODS) == Version(releases.NEWEST_TESTED_VLLM).release[:2]
    assert releases.patched_method_changes(releases.installed_version("vllm") or "") == []


def test_the_signature_guard_fails_on_a_parameter_added_anywhere_or_a_changed_kind():
    """What the guard compares: a new trailing parameter (with a default, so every old call
    still works), a new one in the middle, a keyword-only one, a reordering."""
    def recorded(self, scheduler_output, intermediate_tensors=None):
        pass

    def trailing(self, scheduler_output, intermediate_tensors=None, new_flag=False):
        pass

    def middle(self, new, scheduler_output, intermediate_tensors=None):
        pass

    def keyword_only(self, scheduler_output, *, intermediate_tensors=None):
        pass

    def swapped(self, intermediate_tensors, scheduler_output):
        pass

    def variadic(self, /, *args, flag=False, **kwargs):
        pass

    def from_source(fn) -> tuple[str, ...]:  # what the startup check of an untested vLLM reads
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        return sources.written_signature(sources.definitions(tree, fn.__name__)[0])

    recorded_list = ("self", "scheduler_output", "intermediate_tensors")
    for read in (written, from_source):
        assert read(recorded) == recorded_list
        for changed in (trailing, middle, keyword_only, swapped):
            assert read(changed) != recorded_list, changed.__name__
        assert read(keyword_only) == ("self", "scheduler_output", "*", "intermediate_tensors")
        assert read(variadic) == ("self", "/", "*args", "flag", "**kwargs")


def test_install_wraps_every_target_once():
    hooks.install()
    hooks.install()
    for owner, name, _ in hooks.patch_targets():
        fn = getattr(owner, name)
        assert hasattr(fn, hooks._PATCHED), f"{owner.__name__}.{name} is not wrapped"
        assert not hasattr(getattr(fn, hooks._PATCHED), hooks._PATCHED), "wrapped twice"


def source(owner, name):
    return inspect.getsource(original(getattr(owner, name)))


def in_order(text, *parts):
    positions = [text.index(p) for p in parts]
    return positions == sorted(positions)


@pytest.fixture
def active_session():
    saved = dict(vars(session))
    session.configure(CascadeConfig(enabled=True, policy="always"), AttentionShape(8, 2, 128, 2),
                      16, None)
    yield session
    vars(session).update(saved)


# ----------------------------------------------------------------------------------- V1 runner

@pytest.mark.v1_runner
def test_v1_runner_plans_from_committed_rows_before_it_picks_cuda_graphs():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    text = source(GPUModelRunner, "execute_model")
    assert in_order(text, "self._update_states(scheduler_output)",
                    "tokens = [scheduler_output.num_scheduled_tokens[i] for i in req_ids]",
                    "self._prepare_inputs(", "self._determine_batch_execution_and_padding(",
                    "self._build_attention_metadata(")
    assert "block_table.commit_block_table(" in source(GPUModelRunner, "_prepare_inputs")
    decide = source(GPUModelRunner, "_determine_batch_execution_and_padding")
    assert "self.cudagraph_dispatcher.dispatch(" in decide and "invalid_modes=" in decide


@pytest.mark.v1_runner
def test_v1_dispatcher_honours_invalid_modes_and_is_the_runners():
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "allowed_modes -= invalid_modes" in source(CudagraphDispatcher, "dispatch")
    assert "self.cudagraph_dispatcher = CudagraphDispatcher(" in inspect.getsource(
        GPUModelRunner.__init__)


@pytest.mark.v1_runner
def test_v1_block_table_rows_are_the_builder_rows():
    from vllm.v1.worker.block_table import BlockTable
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = source(GPUModelRunner, "_build_attention_metadata")
    assert "blk_table.get_device_tensor(num_reqs_padded)" in build
    init = inspect.getsource(BlockTable.__init__)
    assert "self.num_blocks_per_row" in init and "self.block_table = self._make_buffer(" in init
    assert "self.num_computed_tokens_cpu" in inspect.getsource(InputBatch.__init__)


def v1_runner(table, seq, q):
    """A V1 runner's state for one step, as the hooks read it (rows in batch order)."""
    n = len(q)
    block_table = SimpleNamespace(block_table=SimpleNamespace(np=table),
                                  num_blocks_per_row=-(-seq // 16))
    batch = SimpleNamespace(num_reqs=n, req_ids=[f"r{i}" for i in range(n)],
                            num_computed_tokens_cpu=seq - q, block_table=[block_table])
    runner = SimpleNamespace(input_batch=batch, cudagraph_dispatcher=object(),
                             kv_cache_config=SimpleNamespace(kv_cache_groups=[0]))
    so = SimpleNamespace(num_scheduled_tokens=dict(zip(batch.req_ids, q.tolist(), strict=True)))
    return runner, so


@pytest.mark.parametrize("shared", [True, False])
def test_v1_cascade_steps_exclude_full_graphs_and_others_keep_vllms_choice(active_session,
                                                                           shared):
    from vllm.config import CUDAGraphMode

    table = np.array([[5, 6, 7], [5, 6, 8], [5, 6, 9]], dtype=np.int32)
    if not shared:
        table[:, :2] += np.arange(3)[:, None] * 10
    seq, q = np.array([40, 41, 42], dtype=np.int32), np.ones(3, dtype=np.int32)
    runner, so = v1_runner(table, seq, q)
    seen = []

    padded = []

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        decide(self, num_tokens=3)
        padded.append(session.padded_tokens)
        return "output"

    def determine(self, num_tokens):
        dispatch(self.cudagraph_dispatcher, num_tokens, uniform_decode=True, valid_modes=None,
                 invalid_modes=None)
        dispatch(self.cudagraph_dispatcher, num_tokens, valid_modes={CUDAGraphMode.PIECEWISE})

    def vllm_dispatch(self, num_tokens, uniform_decode=False, has_lora=False,
                      num_active_loras=0, valid_modes=None, invalid_modes=None):
        seen.append((valid_modes, invalid_modes))
        return CUDAGraphMode.PIECEWISE, SimpleNamespace(num_tokens=8)  # padded to a graph size

    decide = hooks_dispatch.v1_determine_batch_execution(determine)
    dispatch = hooks_dispatch.v1_dispatch(vllm_dispatch)
    assert hooks_step.execute_model(execute_model)(runner, so) == "output"
    # Only the first dispatch is ours to change: the second re-dispatches to an agreed mode.
    first = {CUDAGraphMode.FULL} if shared else None
    assert seen == [(None, first), ({CUDAGraphMode.PIECEWISE}, None)]
    # A cascade step learns the padded token count its tensors have; it ends with the step.
    assert padded == [8 if shared else 0] and session.padded_tokens == 0
    assert hooks_step.pending is None and session.current is None


def test_a_step_whose_rows_start_on_different_blocks_skips_the_planner(active_session,
                                                                       monkeypatch):
    """No two first block ids alike: no sharing possible, so the block table is never planned."""
    from vllm_cascade_plugin import stats

    calls = []
    real_plan = session._planner.plan
    monkeypatch.setattr(session._planner, "plan",
                        lambda *args, **kwargs: calls.append(1) or real_plan(*args, **kwargs))
    seq, q = np.array([40, 41, 42], dtype=np.int32), np.ones(3, dtype=np.int32)
    before = stats.snapshot()
    unshared = np.array([[5, 6, 7], [15, 16, 8], [25, 26, 9]], dtype=np.int32)
    assert hooks_dispatch.v1_plan(hooks_step.PendingStep(*v1_runner(unshared, seq, q))) is False
    assert calls == [] and session.current is None
    shared = np.array([[5, 6, 7], [5, 6, 8], [25, 26, 9]], dtype=np.int32)
    assert hooks_dispatch.v1_plan(hooks_step.PendingStep(*v1_runner(shared, seq, q))) is True
    assert calls == [1]
    after = stats.snapshot()
    # Both steps count as planned decode steps; only the second ran the planner.
    assert after.decode_steps_planned - before.decode_steps_planned == 2


# ----------------------------------------------------------------------------------- V2 runner

def test_v2_runner_updates_block_ids_before_dispatch_and_sorts_rows_like_we_do():
    from vllm.v1.worker.gpu import dp_utils
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    text = source(GPUModelRunner, "execute_model")
    assert in_order(text, "self.update_requests(scheduler_output)",
                    "self.block_tables.apply_staged_writes()", "dispatch_cg_and_sync_dp(",
                    "self.prepare_inputs(")
    assert "cudagraph_manager.dispatch(" in inspect.getsource(dp_utils.dispatch_cg_and_sync_dp)
    assert "dispatch" not in vars(ModelCudaGraphManager)  # the runner's manager: ours wraps it
    # The rows of a batch: sorted where vLLM sorts them (0.26-0.27: prepare_inputs; 0.28+: before
    # dispatch, in gather_batch_req_state), then mapped to request slots as we map them.
    sorter = getattr(GPUModelRunner, "gather_batch_req_state", GPUModelRunner.prepare_inputs)
    text = inspect.getsource(sorter)
    assert "sort_batch_req_ids(" in text and "self.req_states.req_id_to_index." in text
    runner = SimpleNamespace(decode_query_len=1)
    so = SimpleNamespace(num_scheduled_tokens={"a": 5, "b": 1, "c": 1},
                         scheduled_spec_decode_tokens={})
    assert compat.v2_batch_order(runner, so) == ["b", "c", "a"]
    # A decode step without drafts: the scheduler's order, which vLLM's own sort keeps.
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    decode = {f"r{i}": 1 for i in (5, 3, 9, 1, 7)}
    uniform = SimpleNamespace(num_scheduled_tokens=decode, scheduled_spec_decode_tokens={})
    drafts = ({"draft_tokens": {}} if "draft_tokens" in inspect.signature(
        sort_batch_req_ids).parameters else {})
    order = sort_batch_req_ids(decode, decode_query_len=1, **drafts)
    assert compat.v2_batch_order(runner, uniform) == order == list(decode)


def test_v2_rows_are_in_the_order_vllms_own_sort_gives():
    """The hook's numpy order (hooks_dispatch.v2_rows) against the installed vLLM's
    sort_batch_req_ids on random batches: decode rows, short extends and prefills mixed, ties,
    decode query lengths of 1 and 3 (speculative decoding's), with and without draft tokens."""
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    takes_drafts = "draft_tokens" in inspect.signature(sort_batch_req_ids).parameters
    rng = np.random.default_rng(0)
    for trial in range(300):
        decode_query_len = (1, 3)[trial % 2]
        n = int(rng.integers(1, 300))
        counts = np.where(rng.random(n) < rng.random(), decode_query_len,
                          rng.choice([1, 2, 3, 5, 16, 517, 2048], n))
        tokens = {f"cmpl-{rng.integers(1 << 30):x}-{i}": int(c) for i, c in enumerate(counts)}
        drafts = ({r: [7] * (c - 1) for r, c in tokens.items() if c == decode_query_len > 1}
                  if trial % 3 == 0 else {})
        runner = SimpleNamespace(decode_query_len=decode_query_len)
        so = SimpleNamespace(num_scheduled_tokens=tokens, scheduled_spec_decode_tokens=drafts)
        expected = (sort_batch_req_ids(tokens, drafts, decode_query_len) if takes_drafts
                    else sort_batch_req_ids(tokens, decode_query_len))
        req_ids, query_lens, order = hooks_dispatch.v2_rows(runner, so)
        assert req_ids == list(tokens) and query_lens.dtype == np.int32
        in_order = req_ids if order is None else [req_ids[i] for i in order]
        assert in_order == expected, (trial, decode_query_len)
        assert (query_lens if order is None else query_lens[order]).tolist() == [
            tokens[r] for r in expected]


class StagedRows:
    """Stands in for vLLM's pinned/UVA StagedWriteTensor: applies each write to a numpy table."""

    def __init__(self, shape):
        self.gpu = np.zeros(shape, dtype=np.int32)

    def stage_write(self, index, start, ids):
        self.gpu[index, start:start + len(ids)] = ids


class Counts:
    def __init__(self, shape):
        self.np = np.zeros(shape, dtype=np.int32)


def block_tables(**state):
    """vLLM's real BlockTables methods over CPU stand-ins for its buffers."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    hooks.install()
    tables = object.__new__(BlockTables)
    tables.num_kv_cache_groups = 1
    tables.block_tables, tables.num_blocks = [StagedRows((4, 32))], Counts((1, 4))
    vars(tables).update(state)
    return tables


def id_mappings():
    """The BlockTables state that changes which ids it writes, in the installed release."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    text = inspect.getsource(BlockTables)
    cases = [{}]
    if "self.blocks_per_kv_block" in text:  # 0.26-0.31: kernel blocks smaller than KV blocks
        cases = [{"blocks_per_kv_block": [1]}, {"blocks_per_kv_block": [2]}]
    if "redirect_writes_to_null_block" in text:  # 0.32+: elastic EP warm-up
        cases.append({"redirect_writes_to_null_block": True})
    return cases


@pytest.mark.parametrize("state", id_mappings(), ids=str)
def test_v2_block_id_mirror_equals_what_vllm_writes(state):
    tables = block_tables(**state)
    tables.append_block_ids(2, ([7, 8, 9],), overwrite=True)
    tables.append_block_ids(2, ([10],), overwrite=False)
    tables.append_block_ids(1, ([3, 4],), overwrite=True)
    tables.append_block_ids(2, ([11, 12],), overwrite=True)  # a reused slot is rewritten
    [mirror] = tables.__dict__[hooks_dispatch.MIRROR]
    for row in range(4):
        count = tables.num_blocks.np[0, row]
        assert np.array_equal(mirror[row, :count], tables.block_tables[0].gpu[row, :count])


def test_v2_graph_matching_takes_no_argument_we_do_not_know():
    from vllm.v1.worker.gpu import cudagraph_utils

    assert set(inspect.signature(cudagraph_utils._is_compatible).parameters) <= (
        V2_GRAPH_MATCH_ARGUMENTS)


def captured_graphs():
    """vLLM's real CudaGraphManager over hand-made captures for batches of 8 tokens: FULL decode
    graphs (uniform, and varlen where the release has them) before a PIECEWISE one."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, CudaGraphManager

    hooks.install()
    uniform = BatchExecutionDescriptor(CUDAGraphMode.FULL, 8, 8, uniform_token_count=1)
    token_keyed = []
    if "max_query_len" in {f.name for f in dataclasses.fields(BatchExecutionDescriptor)}:
        token_keyed.append(BatchExecutionDescriptor(CUDAGraphMode.FULL, 8, 8, max_query_len=1))
    token_keyed.append(BatchExecutionDescriptor(CUDAGraphMode.PIECEWISE, 8, None))
    manager = object.__new__(CudaGraphManager)
    manager._graphs_captured = True
    manager._resolve_effective_loras = lambda n: n
    if "_decode_descs" in inspect.getsource(CudaGraphManager.__init__):
        # 0.34: uniform decode graphs by (query length, LoRAs, microbatches), then request
        # count (entry n: the smallest graph that takes n requests); the rest by token count.
        manager._decode_descs = {(1, 0, 1): [uniform] * 9}
        manager._candidates = {(8, 0): token_keyed}
    else:
        manager._candidates = {(8, 0): [uniform, *token_keyed]}
    return manager, len(token_keyed)


def test_v2_dispatch_avoids_full_graphs_only_on_cascade_steps():
    from vllm.config import CUDAGraphMode

    manager, num_full = captured_graphs()
    varlen = {"max_query_len": 1} if "max_query_len" in parameters(manager.dispatch) else {}

    def mode(uniform, owner=manager):
        return owner.dispatch(8, 8, uniform, 0, **varlen).cg_mode

    full_for_any_decode = CUDAGraphMode.FULL if num_full > 1 else CUDAGraphMode.PIECEWISE
    assert mode(1) == CUDAGraphMode.FULL and mode(None) == full_for_any_decode  # no step
    step = hooks_step.PendingStep(SimpleNamespace(cudagraph_manager=manager), None)
    hooks_step.pending = step
    try:
        step.cascade = False
        assert mode(1) == CUDAGraphMode.FULL
        step.cascade = True
        assert mode(1) == CUDAGraphMode.PIECEWISE and mode(None) == CUDAGraphMode.PIECEWISE
        assert session.padded_tokens == 8
        assert mode(1, captured_graphs()[0]) == CUDAGraphMode.FULL  # another manager
    finally:
        hooks_step.pending = None
        session.end_step()


def test_v2_cascade_step_never_gets_a_full_graph_for_any_batch():
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    manager, _ = captured_graphs()
    manager._candidates = {(8, 0): [BatchExecutionDescriptor(CUDAGraphMode.FULL, 8, 8)]}
    step = hooks_step.PendingStep(SimpleNamespace(cudagraph_manager=manager), None)
    hooks_step.pending = step
    step.cascade = True
    try:
        desc = manager.dispatch(6, 8, 1, 0)
    finally:
        hooks_step.pending = None
    assert (desc.cg_mode, desc.num_tokens, desc.num_reqs) == (CUDAGraphMode.NONE, 8, 6)


def test_v2_dummy_profile_and_capture_runs_never_plan(active_session):
    seen = []

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        seen.append(hooks_step.pending)
        return "output"

    wrapped = hooks_step.execute_model(execute_model)
    assert wrapped(object(), "dummy", dummy_run=True) == "output"
    assert wrapped(object(), "dummy", None, True) == "output"
    assert wrapped(object(), "real") == "output"
    assert seen[0] is None and seen[1] is None
    assert seen[2] is not None and seen[2].scheduler_output == "real"
    assert hooks_step.pending is None and session.current is None  # cleared when the step ends
