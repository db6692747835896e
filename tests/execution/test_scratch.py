"""The executors' scratch buffers: a batch that grows row by row moves them a few times, not on
every step (their addresses are in the keys of the CUDA graphs that read them)."""

from __future__ import annotations

import torch

from vllm_cascade_plugin.execution.common import Scratch


def test_a_batch_growing_row_by_row_moves_its_buffer_once_per_doubling():
    scratch = Scratch()
    addresses = []
    for rows in range(1, 513):
        view = scratch.take("level_out", (rows, 4, 8), torch.float32, torch.device("cpu"))
        assert view.shape == (rows, 4, 8) and view.is_contiguous()
        addresses.append(view.data_ptr())
    assert len(set(addresses)) == 10  # 32, 64, ... 16384 elements: 1 to 512 rows of 32
    assert scratch.nbytes() == 512 * 32 * 4  # nothing kept of the smaller buffers


def test_a_smaller_step_reuses_the_buffer_and_large_buffers_grow_by_a_megaelement():
    scratch = Scratch()
    big = scratch.take("gather_q", (5_000_000,), torch.int8, torch.device("cpu"))
    assert scratch.nbytes() == 5 << 20  # rounded up to a multiple of 1M elements, not 8M
    small = scratch.take("gather_q", (1000,), torch.int8, torch.device("cpu"))
    assert small.data_ptr() == big.data_ptr()


def test_a_view_taken_again_is_of_the_buffer_as_it_is_now():
    """Views are reused across steps, never past their buffer: one that grew, or changed dtype,
    hands out views of the new buffer, and the other names keep theirs."""
    scratch, cpu = Scratch(), torch.device("cpu")
    small = scratch.take("level_out", (4, 8), torch.float32, cpu)
    other = scratch.take("gather_q", (4, 8), torch.float32, cpu)
    assert scratch.take("level_out", (4, 8), torch.float32, cpu) is small  # the same step shape
    grown = scratch.take("level_out", (1024, 8), torch.float32, cpu)
    assert grown.data_ptr() != small.data_ptr()
    again = scratch.take("level_out", (4, 8), torch.float32, cpu)
    assert again.data_ptr() == grown.data_ptr() and again.shape == (4, 8)
    halves = scratch.take("level_out", (4, 8), torch.bfloat16, cpu)
    assert halves.dtype == torch.bfloat16 and halves.data_ptr() != grown.data_ptr()
    assert scratch.take("level_out", (4, 8), torch.float32, cpu).data_ptr() != grown.data_ptr()
    assert scratch.take("gather_q", (4, 8), torch.float32, cpu) is other

