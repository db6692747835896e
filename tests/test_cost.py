"""The analytic cost model: measured winners, no cascade without sharing, sane trends."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from test_planner import run_python
from vllm_cascade_plugin.cost import AttentionShape, CostModel, decide
from vllm_cascade_plugin.planner import plan_cascade

H200_LAYER = AttentionShape(num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)


def shared_prefix_decode(requests: int, prefix: int, own: int = 128, page_size: int = 16):
    """Decode step of ``requests`` rows sharing ``prefix`` tokens, each with ``own`` more."""
    shared, own_pages = prefix // page_size, -(-own // page_size)
    table = np.zeros((requests, shared + own_pages), np.int32)
    table[:, :shared] = np.arange(1, shared + 1)
    table[:, shared:] = shared + 1 + np.arange(requests * own_pages).reshape(requests, own_pages)
    seq_lens = np.full(requests, prefix + own)
    return plan_cascade(table, seq_lens, np.ones(requests, np.int32), page_size)


# (B, P): FlashInfer decode ms, FlashInfer MultiLevelCascade ms, one H200 layer (DESIGN.md).
MEASURED = {
    (8, 512): (0.064, 0.105),
    (64, 2048): (0.119, 0.196),
    (256, 2048): (0.351, 0.441),
    (128, 8192): (0.561, 0.368),
    (256, 8192): (1.062, 0.539),
    (64, 32768): (0.949, 0.585),
    (256, 32768): (3.697, 0.807),
}


@pytest.mark.parametrize(("requests", "prefix"), list(MEASURED))
def test_model_picks_the_measured_winner(requests, prefix):
    flat_ms, cascade_ms = MEASURED[requests, prefix]
    decision = decide(shared_prefix_decode(requests, prefix), H200_LAYER)
    assert decision.use_cascade == (cascade_ms < flat_ms), decision.reason


def test_single_level_plan_is_always_flat():
    table = np.arange(1, 256 * 2048 + 1).reshape(256, 2048).astype(np.int32)  # nothing shared
    plan = plan_cascade(table, np.full(256, 2048 * 16), np.ones(256, np.int32), 16)
    assert plan.num_levels == 1
    eager = CostModel(margin=-0.99, level_fixed_us=0.0, request_us=0.0)
    decision = decide(plan, H200_LAYER, eager)
    assert not decision.use_cascade and decision.cascade_us == decision.flat_us


def test_empty_step_is_flat():
    plan = plan_cascade(np.zeros((2, 1), np.int32), [0, 0], [0, 0], 16)
    assert not decide(plan, H200_LAYER).use_cascade


def test_cascade_must_win_by_the_margin():
    plan = shared_prefix_decode(128, 8192)
    decision = decide(plan, H200_LAYER)
    assert decision.use_cascade
    just_short = decision.flat_us / decision.cascade_us - 1 + 0.01
    assert not decide(plan, H200_LAYER, CostModel(margin=just_short)).use_cascade


@pytest.mark.parametrize("requests", [64, 256])
def test_longer_shared_prefix_only_helps_the_cascade(requests):
    decisions = [decide(shared_prefix_decode(requests, 512 * 2**i), H200_LAYER) for i in range(8)]
    advantage = [d.flat_us - d.cascade_us for d in decisions]
    assert advantage == sorted(advantage)
    chosen = [d.use_cascade for d in decisions]
    assert chosen == sorted(chosen) and chosen[-1] and not chosen[0]
    for field in ("flat_us", "cascade_us"):
        costs = [getattr(d, field) for d in decisions]
        assert costs == sorted(costs)


def test_cost_model_is_frozen_and_documented():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CostModel().margin = 0.5  # type: ignore[misc]
    for field in dataclasses.fields(CostModel):
        assert field.name in CostModel.__doc__


def test_cost_imports_numpy_only():
    code = "import sys, vllm_cascade_plugin.cost; print('torch' in sys.modules)"
    assert run_python("-c", code).strip() == "False"
