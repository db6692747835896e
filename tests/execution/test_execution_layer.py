"""What ``vllm_cascade_plugin.execution`` may import: torch, Triton, FlashInfer and numpy, over
planning, graphs, the step session, stats and config; of vLLM only the kernels it ships (its
FlashAttention 3 build and its attention-state merge), and only in ``execution/vllm_kernels.py``.
Read from the source by ``tests/layers.py``; every import counts, lazy ones included."""

import layers


def test_execution_imports_only_what_its_layer_allows():
    assert layers.violations("execution") == []
