"""CUDA-graph layouts, counted without a GPU. Entry point: ``layout_count`` (the layouts a
serving-like decode run needs and the whole-step graphs it captures)."""
