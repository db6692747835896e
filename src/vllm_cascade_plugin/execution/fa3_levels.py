"""Cascade levels on the GPU in FlashAttention's varlen + block-table form, for the FA3 executor.

Two ways in: :func:`upload_levels` packs a plan's levels as they are (eager steps; one
non-blocking copy per dtype), :func:`write_static` writes a graphed decode step's bucketed
layout (:mod:`~vllm_cascade_plugin.planning.graph_layout`) into static buffers whose
addresses its CUDA graphs bake in. Either gives :class:`FaLevel` views of the uploaded arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..planning.graph_layout import LevelLayout
from ..planning.plan import CascadeLevel
from .common import FP8_KV_DTYPE, Scratch, copy_to_device, upload


@dataclass(frozen=True, eq=False)
class FaLevel:
    """One level on the GPU in FlashAttention's varlen + block-table form."""

    level: CascadeLevel | None  # what it was made from (eager steps reuse it); None: graphed
    cu_q: torch.Tensor  # int32 [G + 1]: the level's query rows per group
    kv_lens: torch.Tensor  # int32 [G]: seqused_k
    block_table: torch.Tensor  # int32 [G, max_pages]
    max_q: int
    max_k: int
    index: torch.Tensor | None  # int64 [n_q]: the level's rows in q/out; None: q as it is
    rows: int  # n_q


def _aligned(part: np.ndarray) -> list[np.ndarray]:
    """``part`` as int32, then zeros up to 16 bytes, as a tensor of its own would be aligned."""
    return [np.asarray(part, np.int32).ravel(), np.zeros(-part.size % 4, np.int32)]


def _views(dev32: torch.Tensor, start: int, groups: int, table_shape: tuple[int, int],
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """cu_q, kv_lens and block-table views of a level packed at ``start``; and where it ends."""
    views = []
    for n in (groups + 1, groups, table_shape[0] * table_shape[1]):
        views.append(dev32[start:start + n])
        start += n + (-n % 4)
    return views[0], views[1], views[2].view(table_shape), start


def upload_levels(levels: list[tuple[int, CascadeLevel]], page_size: int,
                  device: torch.device) -> list[tuple[int, FaLevel]]:
    """``levels`` (with their positions in the plan) on ``device``: each level's int32 arrays
    (cu_q, kv_lens, block table) and int64 query index in one upload per dtype."""
    ints: list[np.ndarray] = []
    longs: list[np.ndarray] = []
    packed = []
    for position, level in levels:
        table = level.block_table()
        lens = level.kv_lens(page_size)
        packed.append((position, level, table.shape, int(lens.max(initial=0))))
        for part in (level.qo_indptr, lens, table):
            ints += _aligned(part)
        if not level.q_is_identity:
            longs.append(np.asarray(level.q_index, np.int64))
    if not packed:
        return []
    dev32 = upload(np.concatenate(ints), np.int32, device)
    dev64 = upload(np.concatenate(longs), np.int64, device) if longs else None
    result = []
    at32 = at64 = 0
    for position, level, shape, max_k in packed:
        cu_q, kv_lens, block_table, at32 = _views(dev32, at32, level.num_groups, shape)
        rows = int(level.qo_indptr[-1])
        index = None
        if not level.q_is_identity:
            assert dev64 is not None
            index = dev64[at64:at64 + rows]
            at64 += rows
        result.append((position, FaLevel(
            level=level, cu_q=cu_q, kv_lens=kv_lens, block_table=block_table,
            max_q=int(np.diff(level.qo_indptr).max(initial=0)), max_k=max_k, index=index,
            rows=rows)))
    return result


def write_static(layouts: tuple[LevelLayout, ...], scratch: Scratch, device: torch.device,
                 reserve: tuple[int, int] = (0, 0),
                 ) -> tuple[tuple[FaLevel, ...], tuple[int, int]]:
    """A graphed step's levels written into the static buffers ``static32``/``static64`` of
    ``scratch`` (allocated with at least ``reserve`` elements); returns their views and the
    buffers' addresses (they move only when a buffer grows, which the graphs' keys then show).

    The copies are ordered on the stream after the previous step's replays, which read the old
    values, and before this step's, which read the new ones."""
    ints: list[np.ndarray] = []
    longs = [layout.index for layout in layouts if layout.index is not None]
    for layout in layouts:
        for part in (layout.cu_q, layout.kv_lens, layout.table):
            ints += _aligned(part)
    host32 = np.concatenate(ints)
    host64 = np.concatenate(longs) if longs else np.zeros(0, np.int64)
    dev32 = scratch.take("static32", (max(host32.size, 1),), torch.int32, device, reserve[0])
    dev64 = scratch.take("static64", (max(host64.size, 1),), torch.int64, device, reserve[1])
    for dev, host, dtype in ((dev32, host32, np.int32), (dev64, host64, np.int64)):
        if host.size:
            copy_to_device(dev, host, dtype)
    addresses = (dev32.data_ptr(), dev64.data_ptr())
    # The views depend on the buffers and the layouts' sizes only: a step of the same sizes as
    # an earlier one takes that step's (making them is ten torch calls of host time).
    sizes = (addresses, *((layout.key, layout.table.shape,
                           None if layout.index is None else layout.index.size)
                          for layout in layouts))
    levels = scratch.memo.get(sizes)
    if levels is None:
        levels = scratch.memo[sizes] = _static_views(layouts, dev32, dev64)
    return levels, addresses


def _static_views(layouts: tuple[LevelLayout, ...], dev32: torch.Tensor, dev64: torch.Tensor,
                  ) -> tuple[FaLevel, ...]:
    levels = []
    at32 = at64 = 0
    for layout in layouts:
        groups = len(layout.kv_lens)
        cu_q, kv_lens, table, at32 = _views(dev32, at32, groups, layout.table.shape)
        index = None
        if layout.index is not None:
            index = dev64[at64:at64 + layout.index.size]
            at64 += layout.index.size
        levels.append(FaLevel(level=None, cu_q=cu_q, kv_lens=kv_lens, block_table=table,
                              max_q=layout.max_q, max_k=layout.max_k, index=index,
                              rows=layout.rows))
    return tuple(levels)


def gather_rows(q: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = q[index[i]]``; an FP8 query moved as its bytes (a copy, exact)."""
    if q.dtype == FP8_KV_DTYPE:
        q, out = q.view(torch.uint8), out.view(torch.uint8)
    torch.index_select(q, 0, index, out=out)
