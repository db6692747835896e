"""``vllm_cascade_plugin.integration`` is the only code that reaches into vLLM's internals: it
may import every part below it and vLLM; no other part imports vLLM but the execution's kernel
module (the kernels vLLM ships) and the face's use of vLLM's public API. Read from the source by
``tests/layers.py``; every import counts, lazy ones included."""

import layers

ELSEWHERE = {  # vLLM outside the integration, module by module: all that each reaches
    "vllm_cascade_plugin.execution.vllm_kernels": {
        "vllm.vllm_flash_attn.flash_attn_varlen_func",
        "vllm.vllm_flash_attn.is_fa_version_supported",
        "vllm.vllm_flash_attn.fa_version_unsupported_reason",
        "vllm.v1.attention.ops.merge_attn_states.merge_attn_states"},
    "vllm_cascade_plugin.face.demo_engine": {"vllm.LLM", "vllm.SamplingParams",
                                             "vllm.inputs.TokensPrompt"},
}


def test_integration_imports_only_what_its_layer_allows():
    assert layers.violations("integration") == []


def test_vllm_is_imported_by_the_integration_and_nowhere_else_but_the_known_few():
    known = layers.modules()
    outside: dict[str, set[str]] = {}
    for module, path in known.items():
        if layers.part_of(module) == "integration":
            continue
        names = {name for name, _ in layers.imports(module, path, known)
                 if name.split(".")[0] == "vllm"}
        if names:
            outside[module] = names
    assert outside == ELSEWHERE
