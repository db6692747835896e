"""What ``vllm_cascade_plugin.graphs`` may import: torch, over planning, the step session, stats
and config; never vLLM (the runner hands in its forward context and graph mode). Read from the
source by ``tests/layers.py``; every import counts, lazy ones included."""

import layers


def test_graphs_import_only_what_their_layer_allows():
    assert layers.violations("graphs") == []
