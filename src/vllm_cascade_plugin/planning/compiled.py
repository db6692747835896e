"""The runner hooks' pre-checks of a step in one compiled pass (numba), with their numpy
originals as the reference.

Every engine step the plugin sees is first asked whether it can run cascade at all: whether its
block table holds every row's pages, whether two rows can share a page (judged from each row's
first block id: :func:`~.planner.nothing_shared`), and whether any cascade of its rows could
beat flat attention (the cost model's floor: :func:`~.cost.flat_floor`). Most steps of a
serving run stop there. In numpy these are some thirty small array operations, each a few µs of
interpreter and dispatch; :func:`row_facts` reads the rows once and returns what all three
need. numba is a dependency of every vLLM release the plugin supports; the functions compile
when the step session is configured (:func:`compile_once`, cached on disk by numba), and where
numba is missing or fails, :func:`row_facts_numpy` (the same facts, from the numpy originals'
expressions) answers instead. ``tests/planning/test_compiled.py`` holds the two to the same
answers on random steps.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from .planner import nothing_shared

__all__ = ["RowFacts", "compile_once", "compiled", "row_facts", "row_facts_numpy"]


class RowFacts(NamedTuple):
    """What the pre-checks need of a step's rows (rows with query tokens: *active*)."""

    short: bool  # some row's block table holds fewer pages than its tokens fill
    maybe_shared: bool  # two active rows with a shareable page have the same first block id
    requests: int  # active rows
    tokens: int  # their query tokens
    pages: int  # the pages they read
    pairs: int  # sum of query tokens x pages over them
    padding: int  # sum of (query tokens padded to whole ``tile``s - query tokens) x pages
    late_pages: int  # pages of the active rows more than ``l2_window_rows`` rows in
    decodes: int  # active rows of one query token

    def all_decode(self, rows: int) -> bool:
        """Whether each of the step's ``rows`` rows has exactly one query token (a decode
        step)."""
        return self.requests == self.tokens == rows


def row_facts_numpy(first_pages: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                    num_blocks: np.ndarray, page_size: int, tile: int,
                    l2_window_rows: int) -> RowFacts:
    """:class:`RowFacts` in numpy, as the hooks' pre-checks computed them before."""
    seq = np.asarray(seq_lens, dtype=np.int64)
    qry = np.asarray(query_lens, dtype=np.int64)
    pages_all = -(-seq // page_size)
    short = bool(np.any(np.asarray(num_blocks) < pages_all))
    active = qry > 0
    maybe_shared = not nothing_shared(first_pages, seq, qry, page_size)
    pages, queries = pages_all[active], qry[active]
    padded = np.where(queries > 1, -(-queries // tile) * tile, queries) if tile > 1 else queries
    late = active.nonzero()[0] > l2_window_rows
    return RowFacts(short, maybe_shared, int(active.sum()), int(queries.sum()),
                    int(pages.sum()), int(queries @ pages), int((padded - queries) @ pages),
                    int(pages[late].sum()), int((queries == 1).sum()))


def _row_facts_py(first_pages: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                  num_blocks: np.ndarray, page_size: int, tile: int,
                  l2_window_rows: int) -> tuple[bool, bool, int, int, int, int, int, int, int]:
    """One pass over the rows (compiled by numba as :func:`row_facts`)."""
    n = seq_lens.shape[0]
    candidates = np.empty(n, np.int64)
    found = 0
    short = False
    requests = tokens = pages = pairs = padding = late = decodes = 0
    for r in range(n):
        seq = np.int64(seq_lens[r])
        qry = np.int64(query_lens[r])
        row_pages = (seq + page_size - 1) // page_size
        if num_blocks[r] < row_pages:
            short = True
        if qry <= 0:
            continue
        requests += 1
        tokens += qry
        if qry == 1:
            decodes += 1
        pages += row_pages
        pairs += qry * row_pages
        if qry > 1 and tile > 1:
            padding += ((qry + tile - 1) // tile * tile - qry) * row_pages
        if r > l2_window_rows:
            late += row_pages
        if (seq - qry) // page_size >= 1 and first_pages[r] != 0:
            candidates[found] = first_pages[r]
            found += 1
    maybe_shared = False
    if found >= 2:
        ordered = np.sort(candidates[:found])
        for i in range(1, found):
            if ordered[i] == ordered[i - 1]:
                maybe_shared = True
                break
    return short, maybe_shared, requests, tokens, pages, pairs, padding, late, decodes


_compiled: Any = None  # the numba dispatcher once compiled; False: numba unavailable or failing
_compile_s = 0.0
_compile_error = ""


def compile_once() -> tuple[bool, float, str]:
    """Compile :func:`row_facts` (numba's on-disk cache makes it a load after the first run):
    (compiled, seconds it took, why not). Called when the step session is configured."""
    global _compiled, _compile_s, _compile_error
    if _compiled is None:
        start = time.perf_counter()
        _compiled, errors = False, []
        # Cached where numba can write its cache (beside this file, or a user cache folder);
        # where it can write none, compiled for this process only.
        for cache in (True, False):
            try:
                import numba

                jitted = numba.njit(cache=cache, nogil=True)(_row_facts_py)
                one = np.zeros(2, np.int32)
                jitted(one, one, one, one, 16, 1, 8)  # compiles (or loads) the one signature
                _compiled = jitted
                break
            except Exception as exc:  # numba missing or failing: numpy answers
                errors.append(f"{type(exc).__name__}: {exc}")
        _compile_error = "" if _compiled else errors[-1]
        _compile_s = time.perf_counter() - start
    return bool(_compiled), _compile_s, _compile_error


def compiled() -> bool:
    """Whether :func:`row_facts` runs compiled (after :func:`compile_once`)."""
    return bool(_compiled)


def _i32(array: np.ndarray) -> np.ndarray:
    """Block ids and lengths as vLLM holds them: int32 (they fit), contiguous."""
    return np.ascontiguousarray(array, dtype=np.int32)


def row_facts(first_pages: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
              num_blocks: np.ndarray, page_size: int, tile: int,
              l2_window_rows: int) -> RowFacts:
    """:class:`RowFacts` of a step's rows: compiled where :func:`compile_once` succeeded, else
    :func:`row_facts_numpy`. ``tile``: the flat prefill kernel's query tile (1: none)."""
    if _compiled:  # one signature: contiguous int32 arrays, vLLM's (others are copied)
        return RowFacts(*_compiled(_i32(first_pages), _i32(seq_lens), _i32(query_lens),
                                   _i32(num_blocks), int(page_size), int(tile),
                                   int(l2_window_rows)))
    return row_facts_numpy(first_pages, seq_lens, query_lens, num_blocks, page_size, tile,
                           l2_window_rows)
