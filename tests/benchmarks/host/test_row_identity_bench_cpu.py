"""``benchmarks.host.row_identity`` on the CPU: each variant's step passes the check it times
(its planned rows are the batch's), and a row moved makes the same check fail."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.host import row_identity as bench
from vllm_cascade_plugin.integration import hooks_step


@pytest.mark.parametrize("variant", ["v2_req_idx", "v2_decode_order", "v2_mixed_order", "v1"])
def test_each_variant_times_a_check_that_passes_and_fails_when_rows_move(variant):
    step, cm = bench.steps(8)[variant]
    assert bench.time_check(step, cm, number=2, repeat=1) > 0
    if isinstance(step.rows, np.ndarray):
        step.rows = step.rows[::-1].copy()
    else:
        step.rows = step.rows[::-1]
    try:
        assert not hooks_step.runs_as_planned(cm)
    finally:
        hooks_step.pending = None
