"""Execution: a cascade plan run on the GPU, level by level, and merged.

The executors (:mod:`.kernels` picks one: FlashAttention 3, :mod:`.fa3` and its per-level
launches :mod:`.fa3_levels`; FlashInfer, :mod:`.flashinfer`), what they share (:mod:`.common`),
the Triton decode kernel (:mod:`.decode_level`) and the pure-torch reference (:mod:`.reference`).
torch, Triton and FlashInfer over :mod:`~vllm_cascade_plugin.planning`; of vLLM only the kernels
it ships (:mod:`.vllm_kernels`).
"""
