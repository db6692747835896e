"""The plugin's benchmarks, one package per subject; run every entry point as a module from the
repository's root (``python3 -m benchmarks.<subject>.<module> --help``):

- ``kernels``: one attention layer's decode step and its parts on the GPU (``bench``,
  ``fa3_levels``, ``split_step``)
- ``e2e``: offline end-to-end throughput through vLLM's ``LLM`` (``bench``, ``profile_step``)
- ``serve``: ``vllm serve`` driven by ``vllm bench serve`` (``bench``; ``profiler`` summarizes
  its traces; ``probes/``: the ``sitecustomize`` folders its configs put on a server's path)
- ``soak``: minutes of mixed load with aborts and preemption, judged (``bench``)
- ``host``: the plugin's host work per step on the CPU (``planner``, ``step``, ``step_compare``,
  ``step_toggle``, ``row_identity``)
- ``graphs``: the CUDA-graph layouts a decode run needs, counted on the CPU (``layout_count``)
- ``calibration``: the cost model fitted to the committed results (``cost``)

``common`` holds what several of them share; ``plot_results`` draws the result files. The results
themselves are under ``results/`` (``README.md`` says what each file is).
"""
