"""CUDA graphs of the plugin's own: capture into private pools and caches of graphs by key
(:mod:`.capture`: each layer's cascade kernels), and whole cascade decode steps captured in one
graph (:mod:`.fullgraph`). torch only; vLLM's objects are handed in, never imported.
"""
