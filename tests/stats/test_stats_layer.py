"""What ``vllm_cascade_plugin.stats`` may import: the standard library, ``prometheus_client``
(the exporter, imported on first use) and ``config``; every other part counts into it. Read from
the source by ``tests/layers.py``; every import counts, lazy ones included."""

import layers


def test_stats_import_only_what_their_layer_allows():
    assert layers.violations("stats") == []
