"""Online serving: ``vllm serve`` driven by ``vllm bench serve``. Entry points: ``bench`` (the
serving grid's runs; its parts ``configs``, ``workloads``, ``processes``, ``metrics``,
``results``), ``profiler`` (summaries of the torch-profiler traces ``bench --profile`` takes).
``probes/<name>/sitecustomize.py``: what a config changes inside its server's processes."""
