"""The vLLM integration: the only code that imports vLLM's internals, so the code to read when a
vLLM release changes.

The entry point's registration (:mod:`.registration`), the two backends' subclasses
(:mod:`.flashinfer_backend`, :mod:`.flash_attn_backend`) and what their metadata builders and
impls share (:mod:`.builder`), the runner patches (:mod:`.hooks`, :mod:`.hooks_step`,
:mod:`.hooks_dispatch`, :mod:`.hooks_graphs`), every vLLM and FlashInfer release difference
(:mod:`.compat`) and the engine settings the cascade cannot serve (:mod:`.support`).
"""
