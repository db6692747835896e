"""The pinned ring that stages the executors' uploads, on a GPU: every upload arrives intact
while the GPU is far behind the host (each buffer comes round again before the copy that read
it has run, so the ring must wait for it), buffers grow for larger uploads, and FlashInfer-style
staging (several arrays, copied inside the block) is guarded the same way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from vllm_cascade_plugin.execution import common  # noqa: E402


def test_uploads_arrive_intact_while_the_gpu_lags_far_behind():
    ring = common.PinnedRing()
    rng = np.random.default_rng(0)
    device = torch.device("cuda")
    sent, dests = [], []
    for i in range(3 * ring.SLOTS):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time ahead of each copy
        size = int(rng.integers(1, 300_000)) if i % 5 else 600_000  # some need a larger buffer
        dtype = (np.int32, np.int64)[i % 2]
        array = rng.integers(-2**31, 2**31 - 1, size).astype(dtype)
        dest = torch.full((size + 3,), 7, dtype=common._TORCH_DTYPES[np.dtype(dtype)],
                          device=device)
        ring.copy(dest, array)
        sent.append(array)
        dests.append(dest)
    # The ring came round twice over copies queued behind the sleeps: it waited for them.
    assert ring.waits >= ring.SLOTS
    torch.cuda.synchronize()
    for array, dest in zip(sent, dests, strict=True):
        got = dest.cpu().numpy()
        np.testing.assert_array_equal(got[:array.size], array)
        assert (got[array.size:] == 7).all()  # nothing written past the upload


def test_staged_arrays_are_pinned_aligned_and_guarded_until_their_copies_ran():
    ring = common.PinnedRing()
    device = torch.device("cuda")
    arrays = [np.arange(n, dtype=np.int32) * (n + 1) for n in (3, 1, 17, 0, 5)]
    # ~0.5 s of GPU time ahead of the copies: still running when the ring comes round to the
    # first buffer, even on a host busy with other test processes (~50 ms was not, once).
    torch.cuda._sleep(1_000_000_000)
    outs = []
    with ring.staged(arrays, torch.int32) as host:
        for view, array in zip(host, arrays, strict=True):
            assert view.is_pinned() and view.data_ptr() % 16 == 0
            np.testing.assert_array_equal(view.numpy(), array)
            outs.append(view.to(device, non_blocking=True))
    for _ in range(ring.SLOTS):  # every buffer once more: the first must wait for its copies
        with ring.staged([np.full(40, 9, np.int32)], torch.int32) as (view,):
            outs.append(view.to(device, non_blocking=True))
    assert ring.waits >= 1
    torch.cuda.synchronize()
    for out, array in zip(outs, arrays, strict=False):
        np.testing.assert_array_equal(out.cpu().numpy(), array)
    assert all((o.cpu().numpy() == 9).all() for o in outs[len(arrays):])


def test_copy_to_device_and_upload_use_the_devices_ring():
    device = torch.device("cuda")
    before = common.STAGING.seconds, common.STAGING.launch_seconds
    up = common.upload(np.arange(10, dtype=np.int64), np.int32, device)
    dest = torch.zeros(4, dtype=torch.int64, device=device)
    common.copy_to_device(dest, np.array([5, 6, 7]), np.int64)
    torch.cuda.synchronize()
    assert up.dtype == torch.int32 and up.cpu().tolist() == list(range(10))
    assert dest.cpu().tolist() == [5, 6, 7, 0]
    assert common.STAGING.seconds > before[0]
    assert common.STAGING.launch_seconds > before[1]
    assert common.ring_for(device) is common.ring_for(torch.device("cuda", 0))


def test_an_upload_captured_in_a_cuda_graph_is_staged_outside_the_ring():
    """While a capture is underway the ring records no event (a capture cannot): the upload is
    staged in a pinned block of its own, which the graph copies from on every replay."""
    device = torch.device("cuda")
    ring = common.ring_for(device)
    dest = torch.zeros(6, dtype=torch.int32, device=device)
    common.upload(np.zeros(1, np.int64), np.int32, device)  # the ring's first staging: eager
    torch.cuda.synchronize()
    turn = ring._next
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        common.copy_to_device(dest, np.array([4, 5, 6], np.int64), np.int32)
        graph.capture_end()
    torch.cuda.synchronize()
    assert ring._next == turn  # no slot taken during the capture
    dest.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert dest.cpu().tolist() == [4, 5, 6, 0, 0, 0]
