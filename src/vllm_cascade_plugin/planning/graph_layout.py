"""The bucketed layout of a graphed decode step: what its CUDA graphs are keyed by.

A CUDA graph bakes in every size its kernels were launched with: rows, groups per level, the
longest query run and block-table width. Online, requests arrive and finish every step, so a
graph keyed by a step's exact sizes would rarely be replayed. Here a decode step is laid out in
sizes that only change in steps ("buckets"), the way vLLM's own FULL decode graphs are:

- rows: vLLM's padded token count (its CUDA-graph capture size); the padded rows attend along
  with the last group of every shared level and read no page of their own, so their output is
  finite and never read;
- the first shared level is a full permutation of the padded rows: its groups, then the padded
  rows (in its last group), then the rows it does not cover, in one extra group that reads no KV
  (the kernel writes output 0 and LSE -inf there: exactly "nothing yet");
- later shared levels: their rows plus the padded rows (in their last group);
- groups padded to a power of two (empty groups read nothing), the longest query run to a power
  of two (FlashAttention-3 chooses its KV splits and tiles by both: they are not padded more),
  block-table widths to a multiple of :data:`GRAPH_PAGE_BUCKET` pages up to 64 pages and to a
  quarter octave above (at most 25% more), and the KV length a kernel is told to expect to the
  padded width;
- the shared levels always gather their rows (an index, even where it is the identity), and the
  per-request level's table is as wide as the most pages a row reads over every level: a row
  that joins or leaves a group moves pages between levels, not that width; and at least as wide
  as any earlier step of the same padded size and shared levels had it (:class:`LayoutBook`):
  rows grow and long requests come and go, and that width alone would otherwise make one
  layout a new graph again and again.

:func:`graph_shape` computes a step's key from its plan without building anything (the step
session charges a step the graphed cost when its key has been seen); :func:`layout` builds the
arrays the executor uploads. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .plan import CascadeLevel, CascadePlan

GRAPH_PAGE_BUCKET = 16  # block-table widths are padded to a multiple of this many pages
# int32 elements a graphed step's static metadata buffer (the levels' block tables, their
# lengths and query offsets) is allocated with at least, 4 MiB: 512 rows reading 2,048 pages
# each. Allocated once, it does not move while a batch grows (its address keys the graphs).
STATIC32_RESERVE = 1 << 20

MAX_BOOKED = 4096  # layouts the book remembers (then it forgets them all at once)

__all__ = ["BOOK", "GRAPH_PAGE_BUCKET", "LayoutBook", "LevelLayout", "graph_shape", "layout"]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def buffer_elements(numel: int) -> int:
    """What a device buffer of ``numel`` elements is allocated with (the executors' scratch):
    the next power of two up to 4M elements (a decode step's buffers), a multiple of 1M above
    (prefill-sized ones). A buffer's address is part of the keys of the CUDA graphs that read
    it: a batch that grows row by row would otherwise move it, and orphan every graph captured
    before, on every step it grows."""
    if numel <= 1 << 22:
        return 1 << max(numel - 1, 0).bit_length()
    return -(-numel >> 20) << 20


def _width(pages: int) -> int:
    """``pages`` rounded up: to a multiple of :data:`GRAPH_PAGE_BUCKET` up to 64 pages, above
    to a quarter of its power of two (itself a multiple of it)."""
    pages = max(pages, 1)
    step = GRAPH_PAGE_BUCKET if pages <= 64 else 1 << (pages.bit_length() - 3)
    return -(-pages // step) * step


def _level_width(level: CascadeLevel) -> int:
    return _width(int(np.diff(level.kv_page_indptr).max(initial=0)))


@dataclass(frozen=True, eq=False)
class LevelLayout:
    """One level of a graphed step as the kernels read it (FlashAttention's varlen form).

    cu_q : int32 ``[G_pad + 1]`` query-row offsets of the groups.
    kv_lens : int32 ``[G_pad]`` KV tokens each group reads (0 for padding groups).
    table : int32 ``[G_pad, W_pad]`` each group's page ids, 0-padded (never read past kv_lens).
    index : int64 ``[n_q]`` the level's query rows among the step's padded rows, groups
        contiguous; None when they are rows ``0..n_q-1`` in order.
    max_q, max_k : the bounds the kernel is launched with (``max_k`` -1: not used).
    """

    cu_q: np.ndarray
    kv_lens: np.ndarray
    table: np.ndarray
    index: np.ndarray | None
    max_q: int
    max_k: int

    @property
    def rows(self) -> int:
        return int(self.cu_q[-1])

    @property
    def key(self) -> tuple[int, ...]:
        return (self.rows, len(self.kv_lens), self.max_q, self.table.shape[1],
                int(self.index is None), self.max_k)


def _shared_sizes(level: CascadeLevel, first: bool, rows: int, padded: int,
                  page_size: int) -> tuple[int, ...]:
    """:attr:`LevelLayout.key` of a shared level, from its sizes alone."""
    sizes = np.diff(level.qo_indptr)
    extra = padded - rows
    largest = int(sizes[-1]) + extra if sizes.size else extra
    if sizes.size > 1:
        largest = max(largest, int(sizes[:-1].max()))
    members = int(level.qo_indptr[-1])
    n_q = padded if first else members + extra
    groups = level.num_groups + 1 if first else level.num_groups
    if first:
        largest = max(largest, rows - members)
    width = _level_width(level)
    return (n_q, _pow2(groups), min(_pow2(largest), n_q), width, 0,
            width * page_size)


class LayoutBook:
    """The widest per-request table each layout has been laid out with, by the rest of its key
    (the padded size and every shared level's sizes).

    A step's per-request table need only be as wide as its longest row's pages (bucketed), but
    that width is part of its graphs' key: in serving, rows grow a page every ``page_size``
    tokens and long requests come and go, so steps of the same rows, groups and shared levels
    kept needing new graphs for their width alone, and a long run captured and evicted graphs
    without end (``benchmarks/graphs/layout_count.py``). Here a layout's width only grows: a step
    narrower than the widest of its layout so far is laid out that wide and replays that graph.
    The extra columns are zeros, never read: the per-request kernel reads a row's pages up to
    its length, and neither its launch nor its work depends on the table's width
    (:func:`~vllm_cascade_plugin.execution.decode_level.decode_level`). The shared levels' widths
    are left exact: FlashAttention 3 chooses its KV splits by their ``max_seqlen_k``.
    """

    def __init__(self) -> None:
        self._widths: dict[tuple[object, ...], int] = {}

    def width(self, layout: tuple[object, ...], width: int) -> int:
        """The per-request table width for a step of ``layout`` whose rows need ``width``."""
        held = self._widths.get(layout, 0)
        if width <= held:
            return held
        if len(self._widths) >= MAX_BOOKED:
            self._widths.clear()
        self._widths[layout] = width
        return width

    def clear(self) -> None:
        self._widths.clear()


# The process's book: what the step session charges and the executors lay out must agree.
BOOK = LayoutBook()


def _own_sizes(plan: CascadePlan, padded: int) -> tuple[int, ...]:
    """The per-request level's key: as wide as the most pages a row reads over every level."""
    return (padded, padded, 1, _width(plan.stats.max_row_pages), 1, -1)


# The last plan's key: a step's key is asked for twice, by the step session (to charge the
# step) and by the executor laying the step out (plans are read-only, so ``is`` identifies one).
_last_shape: tuple[CascadePlan, int, LayoutBook | None, tuple[tuple[int, ...], ...]] | None = None
# The last shared levels' keys: the planner hands out the very same shared levels while the
# prefix structure holds (steady decode), so their part of the key is worked out once.
_last_shared: tuple[tuple[CascadeLevel, ...], int, int, int, tuple[tuple[int, ...], ...]] | None
_last_shared = None


def graph_shape(plan: CascadePlan, padded_rows: int,
                book: LayoutBook | None = BOOK) -> tuple[tuple[int, ...], ...]:
    """The key of a decode step's graphs (one query per row): every level's
    :attr:`LevelLayout.key` for ``padded_rows`` rows (at least the plan's), the per-request
    table as wide as ``book`` has it for this layout (which it records; None: the step's own
    width)."""
    global _last_shape, _last_shared
    rows = plan.stats.num_tokens
    padded = max(padded_rows, rows)
    last = _last_shape
    if last is not None and last[0] is plan and last[1] == padded and last[2] is book:
        return last[3]
    shared = plan.levels[:-1]
    known = _last_shared
    if (known is not None and known[1:4] == (rows, padded, plan.page_size)
            and len(known[0]) == len(shared)
            and all(a is b for a, b in zip(known[0], shared, strict=True))):
        shared_keys = known[4]
    else:
        shared_keys = tuple(_shared_sizes(level, i == 0, rows, padded, plan.page_size)
                            for i, level in enumerate(shared))
        _last_shared = (shared, rows, padded, plan.page_size, shared_keys)
    own = _own_sizes(plan, padded)
    if book is not None:
        width = book.width((padded, shared_keys), own[3])
        own = (*own[:3], width, *own[4:])
    key = (*shared_keys, own)
    _last_shape = (plan, padded, book, key)
    return key


def _padded_table(level: CascadeLevel, groups: int, width: int) -> np.ndarray:
    table = level.block_table()
    out = np.zeros((groups, width), np.int32)
    out[: table.shape[0], : table.shape[1]] = table
    return out


def _shared_layout(level: CascadeLevel, first: bool, rows: int, padded: int, page_size: int,
                   sizes: tuple[int, ...]) -> LevelLayout:
    """A shared level laid out in ``sizes`` (its part of :func:`graph_shape`)."""
    n_q, groups, max_q, width, identity, max_k = sizes
    extra = padded - rows
    members = int(level.qo_indptr[-1])
    cu_q = np.full(groups + 1, n_q, np.int32)
    cu_q[: level.num_groups] = level.qo_indptr[:-1]
    cu_q[level.num_groups] = members + extra  # the padded rows join the last group
    del identity  # 0: the rows are gathered, whatever their order (one key for both)
    parts = [np.asarray(level.q_index, np.int64), np.arange(rows, padded, dtype=np.int64)]
    if first:  # the rows it does not cover: one group that reads no KV
        covered = np.zeros(rows, bool)
        covered[level.q_index] = True
        parts.append(np.flatnonzero(~covered))
    index = np.concatenate(parts)
    kv_lens = np.zeros(groups, np.int32)
    kv_lens[: level.num_groups] = level.kv_lens(page_size)
    return LevelLayout(cu_q=cu_q, kv_lens=kv_lens, table=_padded_table(level, groups, width),
                       index=index, max_q=max_q, max_k=max_k)


def _own_layout(plan: CascadePlan, rows: int, padded: int, width: int) -> LevelLayout:
    """The per-request level: one row per request, padded rows read nothing."""
    level, page_size = plan.levels[-1], plan.page_size
    kv_lens = np.zeros(padded, np.int32)
    kv_lens[:rows] = level.kv_lens(page_size)
    return LevelLayout(cu_q=np.arange(padded + 1, dtype=np.int32), kv_lens=kv_lens,
                       table=_padded_table(level, padded, width), index=None, max_q=1,
                       max_k=-1)


def layout(plan: CascadePlan, padded_rows: int, *,
           known: dict[int, tuple[CascadeLevel, int, int, LevelLayout]] | None = None,
           book: LayoutBook | None = BOOK) -> tuple[LevelLayout, ...]:
    """Every level of a decode step laid out for ``padded_rows`` rows, in the sizes of its
    :func:`graph_shape` (``book`` as there); ``known``: the layouts of earlier plans' shared
    levels by ``id``, reused for a level that ``is`` one of them with the same rows and padding
    (steady decode keeps its shared levels), then replaced by this plan's."""
    rows = plan.stats.num_tokens
    padded = max(padded_rows, rows)
    shared = plan.levels[:-1]
    sizes = graph_shape(plan, padded, book)
    current: dict[int, tuple[CascadeLevel, int, int, LevelLayout]] = {}
    levels = []
    for i, level in enumerate(shared):
        hit = None if known is None else known.get(id(level))
        if hit is not None and hit[0] is level and hit[1:3] == (rows, padded):
            made = hit[3]
        else:
            made = _shared_layout(level, i == 0, rows, padded, plan.page_size, sizes[i])
        current[id(level)] = (level, rows, padded, made)
        levels.append(made)
    if known is not None:
        known.clear()
        known.update(current)
    return (*levels, _own_layout(plan, rows, padded, sizes[-1][3]))
