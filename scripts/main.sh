#!/usr/bin/env bash
# The main job: builds (or reuses) the pinned virtual environment, installs this checkout and
# runs `vllm-cascade demo` with the plugin switched on. On a GPU: vLLM with and without the
# plugin on a shared-prefix workload (throughput, logprob agreement). Without a GPU: the
# cascade plan of that workload, its predicted saving, a numerical check against flat attention,
# and what the GPU run would do. Usage: bash scripts/main.sh [vllm-cascade demo arguments];
# CASCADE_VLLM=0.34.0 (or 0.33.0) runs it beside that vLLM (requirements/vllm-<release>.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh "requirements/vllm-${CASCADE_VLLM:-0.26.0}.txt"
CASCADE_ATTENTION=${CASCADE_ATTENTION:-1} vllm-cascade demo "$@"
