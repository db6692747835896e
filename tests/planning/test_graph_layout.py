"""The bucketed layout of graphed decode steps: its key is what the step session charges and
what the executor's graphs are keyed by, so both must agree; its arrays must keep every real
row's attention exactly as planned while padded rows and changing batches fit one layout."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_planner import batches, limits, make_batch
from vllm_cascade_plugin.planning.graph_layout import GRAPH_PAGE_BUCKET, graph_shape, layout


def decode_plan(batch, limits):
    batch = dataclasses.replace(batch, query_lens=np.minimum(batch.query_lens, 1))
    return batch.plan(**limits)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_requests=8), limits=limits, extra=st.integers(0, 9))
def test_the_cheap_key_is_the_built_layouts_key(batch, limits, extra):
    plan = decode_plan(batch, limits)
    if plan.num_levels < 2:
        return
    rows = plan.stats.num_tokens
    built = layout(plan, rows + extra)
    assert graph_shape(plan, rows + extra) == tuple(level.key for level in built)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_requests=8), limits=limits, extra=st.integers(0, 9))
def test_every_real_row_reads_exactly_its_planned_pages_and_padded_rows_read_none_of_their_own(
        batch, limits, extra):
    """Replaying the layout's groups row by row gives each real row the pages the plan gives it,
    level by level; the first level lists every padded row once; groups past the plan's are
    empty or read nothing."""
    plan = decode_plan(batch, limits)
    if plan.num_levels < 2:
        return
    rows = plan.stats.num_tokens
    padded = rows + extra
    built = layout(plan, padded)
    *shared, own = built
    first_index = shared[0].index if shared[0].index is not None else np.arange(padded)
    assert sorted(first_index.tolist()) == list(range(padded))
    for level, made in zip(plan.levels[:-1], shared, strict=True):
        index = made.index if made.index is not None else np.arange(made.rows)
        want: dict[int, list[int]] = {}
        for g in range(level.num_groups):
            pages = level.kv_page_indices[level.kv_page_indptr[g]:level.kv_page_indptr[g + 1]]
            for q in level.q_index[level.qo_indptr[g]:level.qo_indptr[g + 1]].tolist():
                want[q] = pages.tolist()
        got: dict[int, list[int]] = {}
        for g in range(len(made.kv_lens)):
            n_pages = -(-int(made.kv_lens[g]) // plan.page_size)
            for q in index[made.cu_q[g]:made.cu_q[g + 1]].tolist():
                assert q not in got  # every row at most once per level
                got[q] = made.table[g, :n_pages].tolist()
        assert {q: p for q, p in got.items() if q < rows and p} == want
        assert all(q >= rows or q in want or not p for q, p in got.items())
        assert made.table.shape[1] % GRAPH_PAGE_BUCKET == 0
        assert made.max_k >= int(made.kv_lens.max()) and made.max_q >= int(
            np.diff(made.cu_q).max())
    assert own.rows == padded and (own.kv_lens[rows:] == 0).all()
    assert own.kv_lens[:rows].tolist() == plan.levels[-1].kv_lens(plan.page_size).tolist()


def test_batches_that_differ_in_rows_and_order_share_one_layout():
    """Four rows on two interleaved prefixes, then five with a new arrival and the rows
    reordered: both padded to 8 rows, one key."""
    a = make_batch([[1, 2, 9], [3, 4, 10], [1, 2, 11], [3, 4, 12]], [40, 41, 38, 45],
                   [1] * 4, page_size=16).plan()
    b = make_batch([[3, 4, 13], [1, 2, 11], [1, 2, 9], [3, 4, 12], [1, 2, 14]],
                   [39, 38, 41, 46, 35], [1] * 5, page_size=16).plan()
    assert graph_shape(a, 8) == graph_shape(b, 8)
    assert graph_shape(a, 8) != graph_shape(a, 16)  # another capture size: another graph


def test_a_row_outside_every_group_gets_a_group_that_reads_nothing():
    plan = make_batch([[1, 2, 9], [1, 2, 10], [5, 6, 11]], [40, 41, 38], [1] * 3,
                      page_size=16).plan()
    first = layout(plan, 4)[0]
    index = first.index.tolist()
    # Rows 0 and 1 share pages 1-2 with the padded row 3 in their group; row 2 reads nothing.
    assert index == [0, 1, 3, 2]
    assert first.cu_q.tolist()[:3] == [0, 3, 4] and first.kv_lens.tolist()[:2] == [32, 0]


def test_a_row_joining_or_leaving_a_group_keeps_the_key():
    """Row 2 first reads its 40-page document alone (all of it in the per-request level), then a
    new row shares that document with it (40 pages move to a shared level): the per-request
    level is as wide as the most pages a row reads, so its part of the key stays (the shared
    level's groups do change)."""
    doc_a, doc_b = list(range(1, 41)), list(range(101, 141))
    alone = make_batch([[*doc_a, 200], [*doc_a, 201], [*doc_b, 202], [*doc_a, 203]],
                       [650, 648, 645, 649], [1] * 4, page_size=16).plan()
    shared = make_batch([[*doc_a, 200], [*doc_a, 201], [*doc_b, 202], [*doc_b, 204]],
                        [651, 649, 646, 641], [1] * 4, page_size=16).plan()
    assert alone.num_levels == shared.num_levels == 2
    assert alone.levels[0].num_groups == 1 and shared.levels[0].num_groups == 2
    assert graph_shape(alone, 4)[-1] == graph_shape(shared, 4)[-1]


def test_rows_in_order_and_out_of_order_share_one_key():
    in_order = make_batch([[1, 2, 9], [1, 2, 10], [3, 4, 11], [3, 4, 12]], [40, 41, 38, 45],
                          [1] * 4, page_size=16).plan()
    shuffled = make_batch([[1, 2, 9], [3, 4, 11], [1, 2, 10], [3, 4, 12]], [40, 38, 41, 45],
                          [1] * 4, page_size=16).plan()
    assert in_order.levels[0].q_is_identity and not shuffled.levels[0].q_is_identity
    assert graph_shape(in_order, 4) == graph_shape(shuffled, 4)


@given(pages=st.integers(0, 100_000))
def test_table_widths_cover_the_pages_with_at_most_a_quarter_more(pages):
    from vllm_cascade_plugin.planning.graph_layout import _width

    width = _width(pages)
    assert width >= max(pages, 1) and width % GRAPH_PAGE_BUCKET == 0
    assert width <= max(1.25 * pages, 64)
    assert _width(width) == width  # a bucket is its own bucket: widths only grow in steps


def _own_rows(own_pages: list[int], first_page: int) -> tuple[list[list[int]], list[int]]:
    """Four decode rows on two 3-page prefixes, row ``r`` with ``own_pages[r]`` pages of its own
    (ids from ``first_page``) and one token in its last page."""
    prefixes = [[1, 2, 3], [4, 5, 6]]
    table, seq_lens, page = [], [], first_page
    for r, own in enumerate(own_pages):
        table.append([*prefixes[r % 2], *range(page, page + own)])
        page += own
        seq_lens.append(16 * (3 + own - 1) + 1)
    return table, seq_lens


def test_a_step_narrower_than_its_layout_so_far_is_laid_out_as_wide_and_reads_only_its_pages():
    """A long row widens the per-request table of its layout (70 pages: 80 wide); a later step
    of the same padded size and shared levels whose rows need 16 columns gets those 80 too, the
    same key, and its rows still read exactly their pages (zeros after, never read)."""
    wide = make_batch(*_own_rows([70, 2, 3, 2], 100), [1] * 4, page_size=16).plan()
    narrow = make_batch(*_own_rows([2, 3, 1, 4], 300), [1] * 4, page_size=16).plan()
    assert graph_shape(narrow, 8, book=None)[-1][3] == 16  # its own width: 7 pages, bucketed
    assert graph_shape(wide, 8)[-1][3] == 80
    assert graph_shape(narrow, 8) == graph_shape(wide, 8)
    own = layout(narrow, 8)[-1]
    assert own.key == graph_shape(wide, 8)[-1] and own.table.shape == (8, 80)
    level = narrow.levels[-1]
    for row in range(4):
        pages = level.kv_page_indices[level.kv_page_indptr[row]:level.kv_page_indptr[row + 1]]
        assert own.table[row, :len(pages)].tolist() == pages.tolist()
        assert not own.table[row, len(pages):].any()
    assert own.kv_lens[:4].tolist() == level.kv_lens(16).tolist() and not own.kv_lens[4:].any()
    # The width only grows: the wide step keeps its key after the narrow one.
    assert graph_shape(wide, 8) == graph_shape(narrow, 8)


def test_another_padded_size_or_other_shared_levels_keep_their_own_width():
    wide = make_batch(*_own_rows([70, 2, 3, 2], 100), [1] * 4, page_size=16).plan()
    narrow = make_batch(*_own_rows([2, 3, 1, 4], 300), [1] * 4, page_size=16).plan()
    one_prefix = make_batch([[1, 2, 3, 300 + r] for r in range(4)], [50] * 4, [1] * 4,
                            page_size=16).plan()
    assert graph_shape(wide, 8)[-1][3] == 80
    assert graph_shape(narrow, 16)[-1][3] == 16  # another capture size
    assert graph_shape(one_prefix, 8)[:-1] != graph_shape(wide, 8)[:-1]
    assert graph_shape(one_prefix, 8)[-1][3] == 16  # another shared layout


def test_the_book_forgets_everything_past_its_size(monkeypatch):
    from vllm_cascade_plugin.planning import graph_layout

    monkeypatch.setattr(graph_layout, "MAX_BOOKED", 2)
    book = graph_layout.LayoutBook()
    assert [book.width(("a",), 32), book.width(("a",), 16), book.width(("b",), 48)] == [32, 32, 48]
    assert book.width(("c",), 16) == 16  # a third layout: the book starts over
    assert book.width(("a",), 16) == 16
