"""The plugin's CUDA-graph caches on a GPU: graphs come and go in one private pool.

Under ``vllm serve`` many step layouts filled the cache, which dropped every graph and captured
again into the same pool id; PyTorch then asserted (``use_count > 0``, in its pinned-host
allocator), since a pool whose graphs are all destroyed is released while it still exists. The
caches now keep an anchor graph in their pool and evict one graph at a time. The first test
shows the failure without an anchor (so the second has something to prove), the second that the
cache survives the same sequence and still computes the right values.
"""

from __future__ import annotations

import subprocess
import sys

import torch

from vllm_cascade_plugin.graphs.capture import LayerGraphs

BARE_HANDLE = """
import torch
from vllm_cascade_plugin.graphs.capture import capture_cuda

x = torch.ones(4096, device="cuda")
stream = torch.cuda.Stream()
pool = torch.cuda.graph_pool_handle()
replay, out = capture_cuda(lambda: x * 2, pool, stream)
del replay  # the pool's only graph is destroyed; its output still holds pool memory
capture_cuda(lambda: x * 3, pool, stream)
"""


def test_a_bare_pool_handle_fails_once_its_graphs_are_gone():
    """In a process of its own: the failed capture leaves PyTorch's allocator inconsistent."""
    proc = subprocess.run([sys.executable, "-c", BARE_HANDLE], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "use_count" in proc.stderr, proc.stderr[-3000:]


def test_a_cache_keeps_capturing_after_evicting_and_dropping_every_graph():
    x = torch.arange(4096, dtype=torch.float32, device="cuda")
    graphs = LayerGraphs(capture_after=1, max_graphs=2)
    results = {}
    for i in range(8):  # fills the cache, evicts one graph at a time
        results[i] = graphs.run((i,), lambda i=i: x * i + 1)
    graphs.clear()  # every graph destroyed at once, outputs of the last ones still alive
    for i in range(3):
        out = graphs.run(("again", i), lambda i=i: x * (10 + i))
        x.add_(1)  # replays must read the new values
        again = graphs.run(("again", i), lambda i=i: x * (10 + i))
        torch.testing.assert_close(again, x * (10 + i))
        assert again is out
    assert not graphs.failed and graphs.evictions >= 6 and graphs.replays >= 3
    assert graphs.pool_bytes() > 0
