"""What ``vllm_cascade_plugin.face`` may import: any part of the package (it sits on top), and
of vLLM only its public API (``vllm.LLM``, ``vllm.SamplingParams``, ``vllm.inputs``), as a
user's program drives it; vLLM's internals only through the integration. Read from the source
by ``tests/layers.py``; every import counts, lazy ones included."""

import layers


def test_face_imports_only_what_its_layer_allows():
    assert layers.violations("face") == []
