#!/usr/bin/env bash
# The main job: builds (or reuses) the pinned virtual environment, installs this checkout and
# runs `vllm-cascade check` with the plugin switched on. Usage: bash scripts/main.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh requirements/vllm-0.26.0.txt
CASCADE_ATTENTION=${CASCADE_ATTENTION:-1} vllm-cascade check
