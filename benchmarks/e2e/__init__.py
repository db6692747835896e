"""Offline end to end through vLLM's ``LLM``. Entry points: ``bench`` (output tokens/s per
configuration and workload, one engine process each), ``profile_step`` (a short generate under
``torch.profiler`` or ``cProfile``)."""
