"""Staging the executors' uploads: the clock that tells staging and launches apart from the
rest of a builder's time, and the uploads' CPU path (the GPU path, through the pinned ring, is
tests/gpu/test_staging.py's)."""

from __future__ import annotations

import numpy as np
import torch


def test_staging_nested_in_staging_counts_once_and_launches_are_a_part_of_it(monkeypatch):
    """The ring's event record is timed as staging inside uploads that are timed already:
    the clock counts the outermost block only, and launches inside it as a part of it."""
    from vllm_cascade_plugin.execution import common

    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    clock = common.StagingClock()
    with clock.timed():
        now[0] += 2.0
        with clock.timed(), clock.launching():
            now[0] += 1.0
    with clock.timed(), clock.launching():
        now[0] += 0.5
    assert (clock.seconds, clock.launch_seconds) == (3.5, 1.5)


def test_uploads_on_a_cpu_copy_the_values_in_the_dtype_asked():
    from vllm_cascade_plugin.execution import common

    dest = torch.full((6,), -1, dtype=torch.int32)
    common.copy_to_device(dest, np.array([[1, 2], [3, 4]], np.int64), np.int32)
    assert dest.tolist() == [1, 2, 3, 4, -1, -1]
    up = common.upload(np.arange(5, dtype=np.int64)[::2], np.int32, torch.device("cpu"))
    assert up.dtype == torch.int32 and up.tolist() == [0, 2, 4]
