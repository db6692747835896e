"""The cost model fitted to the committed results. Entry point: ``cost`` (``planning.cost``'s
models from the kernel grid and the per-step runs; ``step``: the per-step half)."""
