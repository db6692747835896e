"""The compiled pre-checks (planning/compiled.py) against the numpy functions they replace:
``nothing_shared`` and ``flat_floor`` of the planner and the cost model, and the block-table
check, on random steps; and the same facts where numba is not there."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_cascade_plugin.planning import compiled
from vllm_cascade_plugin.planning.cost import (
    AttentionShape,
    CostModel,
    cost_model_for,
    flash_attn_flat,
    flat_floor,
    flat_floor_from_facts,
)
from vllm_cascade_plugin.planning.planner import nothing_shared

SHAPE = AttentionShape(num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2,
                       num_layers=32)
MODELS = {"flashinfer": CostModel(), "fa3": flash_attn_flat(cost_model_for("fa3")),
          "fa3 eager": flash_attn_flat(cost_model_for("fa3", decode_graphs=False))}


def random_step(rng: np.random.Generator, page: int):
    """Rows of a step: first block ids drawn from a small pool (some shared, some 0), lengths
    from decode to prefill chunks, some padding rows, block tables sometimes a page short."""
    n = int(rng.integers(1, 300))
    seq = rng.integers(1, 4000, n)
    query = np.where(rng.random(n) < 0.7, 1, rng.integers(0, 600, n))
    query = np.minimum(query, seq)
    pool = int(rng.integers(1, 2 * n + 2))
    first = rng.integers(0, pool, n)
    blocks = -(-seq // page) - (rng.random(n) < 0.02)
    dtype = rng.choice([np.int32, np.int64])
    return (first.astype(dtype), seq.astype(np.int32), query.astype(np.int32),
            blocks.astype(np.int32))


@pytest.fixture(params=["compiled", "numpy"])
def facts(request, monkeypatch):
    if request.param == "compiled":
        ok, _, why = compiled.compile_once()
        if not ok:
            pytest.fail(f"numba did not compile the pre-checks: {why}")
    else:
        monkeypatch.setattr(compiled, "_compiled", False)
    return compiled.row_facts


def test_facts_agree_with_the_numpy_pre_checks(facts):
    rng = np.random.default_rng(7)
    for _ in range(400):
        page = int(rng.choice([16, 32]))
        first, seq, query, blocks = random_step(rng, page)
        f = facts(first, seq, query, blocks, page, 1, 8)
        assert f.short == bool(np.any(blocks < -(-seq.astype(np.int64) // page)))
        assert f.maybe_shared == (not nothing_shared(first, seq, query, page))
        assert f.decodes == int(np.sum(query == 1))  # rows of one query token
        for name, model in MODELS.items():
            got = flat_floor_from_facts(facts(first, seq, query, blocks, page,
                                              model.flat_prefill_tile, model.l2_window_rows),
                                        len(seq), page, SHAPE, model)
            want = flat_floor(seq, query, page, SHAPE, model)
            assert (got is None) == (want is None), name
            if want is not None:
                assert got is not None
                assert got.flat_us == pytest.approx(want.flat_us, rel=1e-12), name
                assert got.cascade_us == pytest.approx(want.cascade_us, rel=1e-12), name


def test_facts_of_hand_made_rows(facts):
    """Two rows share first block 5 past a whole page; the third is padding; 0 never shares."""
    first = np.array([5, 5, 9, 0, 0])
    seq = np.array([40, 33, 20, 40, 40])
    query = np.array([1, 1, 0, 1, 1])
    blocks = np.array([3, 3, 2, 3, 2])
    f = facts(first, seq, query, blocks, 16, 1, 2)
    assert f.short and f.maybe_shared
    assert (f.requests, f.tokens, f.pages) == (4, 4, 3 + 3 + 3 + 3)
    assert f.late_pages == 3 + 3  # the active rows past row 2: rows 3 and 4
    assert f.decodes == 4  # the padding row (no query token) is not one
    f = facts(np.array([5, 5]), np.array([17, 40]), np.array([2, 1]), np.array([2, 3]), 16, 1, 8)
    assert not f.maybe_shared  # row 0 has no whole page before its queries
    assert f.decodes == 1
    f = facts(np.array([5, 6]), np.array([300, 40]), np.array([200, 1]), np.array([19, 3]), 16,
              128, 8)
    assert f.pairs == 200 * 19 + 3 and f.padding == (256 - 200) * 19


def test_without_a_writable_cache_it_compiles_for_the_process(monkeypatch):
    """numba raises where it can write no cache: the pre-checks are compiled uncached."""
    import numba

    njit = numba.njit

    def no_cache(*args, **kwargs):
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return njit(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", no_cache)
    monkeypatch.setattr(compiled, "_compiled", None)
    done, _, why = compiled.compile_once()
    assert done and why == "" and compiled.compiled()


def test_without_numba_the_numpy_facts_answer(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    monkeypatch.setattr(compiled, "_compiled", None)
    done, _, why = compiled.compile_once()
    assert not done and why.startswith("ModuleNotFoundError") and not compiled.compiled()
    f = compiled.row_facts(np.array([5, 5]), np.array([40, 40]), np.array([1, 1]),
                           np.array([3, 3]), 16, 1, 8)
    assert f.maybe_shared and f.requests == 2
