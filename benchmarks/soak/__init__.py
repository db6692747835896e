"""The soak: minutes of ``AsyncLLM`` load with aborts and preemption, then judged. Entry point:
``bench`` (the orchestrator; its parts ``mix``, ``drive``, ``worker``, ``judge``)."""
