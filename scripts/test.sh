#!/usr/bin/env bash
# The test command: builds (or reuses) the pinned virtual environment, installs this checkout,
# then runs ruff, mypy and the test suite. GPU tests (tests/gpu) skip without CUDA.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh requirements/vllm-0.26.0.txt
python -c 'import vllm, flashinfer, torch; print(f"[test] vLLM {vllm.__version__}, FlashInfer {flashinfer.__version__}, torch {torch.__version__}")'
ruff check src tests benchmarks examples
mypy
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
