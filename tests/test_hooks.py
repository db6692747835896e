"""Guards for every runtime patch of vLLM (hooks.py): they fail loudly when vLLM changes."""

import inspect

import numpy as np
import pytest

from vllm_cascade_plugin import hooks

EXPECTED_PARAMETERS = {
    "initialize_metadata_builders": ["self", "kv_cache_config", "kernel_block_sizes"],
    "_compute_cascade_attn_prefix_lens": [
        "self", "num_scheduled_tokens", "num_computed_tokens", "num_common_prefix_blocks"],
    "append_block_ids": ["self", "req_index", "new_block_ids", "overwrite"],
    "dispatch": ["self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"],
}


def original(fn):
    return getattr(fn, hooks._PATCHED, fn)


@pytest.mark.parametrize("target", hooks.patch_targets(),
                         ids=lambda t: f"{t[0].__module__}.{t[0].__name__}.{t[1]}")
def test_patched_vllm_method_still_has_the_signature_we_wrap(target):
    owner, name, _ = target
    params = list(inspect.signature(original(getattr(owner, name))).parameters)
    if name == "execute_model":
        assert params[:2] == ["self", "scheduler_output"]
        if "gpu.model_runner" in owner.__module__:
            assert params[:4] == ["self", "scheduler_output", "intermediate_tensors", "dummy_run"]
    else:
        assert params == EXPECTED_PARAMETERS[name]


def test_install_wraps_every_target_once():
    hooks.install()
    hooks.install()
    for owner, name, _ in hooks.patch_targets():
        fn = getattr(owner, name)
        assert hasattr(fn, hooks._PATCHED), f"{owner.__name__}.{name} is not wrapped"
        assert not hasattr(getattr(fn, hooks._PATCHED), hooks._PATCHED), "wrapped twice"


def source(owner, name):
    return inspect.getsource(original(getattr(owner, name)))


def test_v1_runner_still_decides_cuda_graphs_after_its_cascade_hook():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    text = source(GPUModelRunner, "execute_model")
    hook = text.index("self._compute_cascade_attn_prefix_lens(")
    assert "if self.cascade_attn_enabled" in text[:hook]
    decide = text.index("use_cascade_attn=cascade_attn_prefix_lens is not None")
    build = text.index("self._build_attention_metadata(")
    assert hook < decide < build
    dispatch = source(GPUModelRunner, "_determine_batch_execution_and_padding")
    assert "disable_full=use_cascade_attn" in dispatch


def test_v1_block_table_rows_are_the_builder_rows():
    from vllm.v1.worker.block_table import BlockTable
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build = source(GPUModelRunner, "_build_attention_metadata")
    assert "blk_table.get_device_tensor(num_reqs_padded)" in build
    init = inspect.getsource(BlockTable.__init__)
    assert "self.num_blocks_per_row" in init and "self.block_table = self._make_buffer(" in init


def test_v2_runner_updates_block_ids_before_dispatch_and_sorts_rows_like_we_do():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner, sort_batch_req_ids

    text = source(GPUModelRunner, "execute_model")
    order = [text.index(s) for s in ("self.update_requests(scheduler_output)",
                                     "self.block_tables.apply_staged_writes()",
                                     "dispatch_cg_and_sync_dp(",
                                     "self.prepare_inputs(scheduler_output, batch_desc)")]
    assert order == sorted(order)
    prepare = inspect.getsource(GPUModelRunner.prepare_inputs)
    assert "sort_batch_req_ids(" in prepare and "self.req_states.req_id_to_index.get" in prepare
    assert sort_batch_req_ids({"a": 5, "b": 1, "c": 1}, 1) == ["b", "c", "a"]


class StagedRows:
    """Stands in for vLLM's pinned/UVA StagedWriteTensor: applies each write to a numpy table."""

    def __init__(self, shape):
        self.gpu = np.zeros(shape, dtype=np.int32)

    def stage_write(self, index, start, ids):
        self.gpu[index, start:start + len(ids)] = ids


class Counts:
    def __init__(self, shape):
        self.np = np.zeros(shape, dtype=np.int32)


@pytest.mark.parametrize("bpk", [1, 2])
def test_v2_block_id_mirror_equals_what_vllm_writes(bpk):
    from vllm.v1.worker.gpu.block_table import BlockTables

    hooks.install()
    tables = object.__new__(BlockTables)  # vLLM's real methods, CPU stand-ins for its buffers
    tables.num_kv_cache_groups, tables.blocks_per_kv_block = 1, [bpk]
    tables.block_tables, tables.num_blocks = [StagedRows((4, 32))], Counts((1, 4))
    tables.append_block_ids(2, ([7, 8, 9],), overwrite=True)
    tables.append_block_ids(2, ([10],), overwrite=False)
    tables.append_block_ids(1, ([3, 4],), overwrite=True)
    tables.append_block_ids(2, ([11, 12],), overwrite=True)  # a reused slot is rewritten
    mirror = tables.__dict__[hooks._MIRROR]
    for row in range(4):
        count = tables.num_blocks.np[0, row]
        assert np.array_equal(mirror[row, :count], tables.block_tables[0].gpu[row, :count])
    assert tables.num_blocks.np[0, 2] == 2 * bpk


def test_v2_dispatch_avoids_full_graphs_only_on_cascade_steps():
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    calls = []

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras):
        calls.append(uniform_token_count)
        mode = CUDAGraphMode.FULL if uniform_token_count == 1 else CUDAGraphMode.PIECEWISE
        return BatchExecutionDescriptor(mode, num_tokens, num_reqs, uniform_token_count)

    class Manager:
        pass

    class Runner:
        cudagraph_manager = Manager()

    wrapped = hooks._v2_dispatch(dispatch)
    manager = Runner.cudagraph_manager
    assert hooks._pending is None
    assert wrapped(manager, 8, 8, 1, 0).cg_mode == CUDAGraphMode.FULL  # no step: untouched
    hooks._pending = step = hooks._PendingStep(Runner(), None)
    try:
        step.cascade = False
        assert wrapped(manager, 8, 8, 1, 0).cg_mode == CUDAGraphMode.FULL
        step.cascade = True
        assert wrapped(manager, 8, 8, 1, 0).cg_mode == CUDAGraphMode.PIECEWISE
        assert wrapped(Manager(), 8, 8, 1, 0).cg_mode == CUDAGraphMode.FULL  # another manager
    finally:
        hooks._pending = None
    assert calls == [1, 1, None, 1]
