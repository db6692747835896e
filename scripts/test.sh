#!/usr/bin/env bash
# The test command (what CI runs: .ci/run). Builds (or reuses) the pinned virtual environments
# and runs, on CPU:
#   1. vLLM 0.26.0 + FlashInfer 0.6.14: ruff, mypy and the test suite;
#   2. vLLM 0.33.0 + FlashInfer 0.7.2.post1: the test suite;
#   3. the FlashInfer matrix beside vLLM 0.26.0 (scripts/flashinfer_matrix.sh).
# GPU tests (tests/gpu) skip without CUDA. Every stage runs; the command fails if any failed, and
# a pytest run that collects no test counts as failed.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

# Environments first: failing to build one stops everything (nothing ran in the wrong one).
source scripts/env.sh requirements/vllm-0.33.0.txt
venv_033=$VENV
source scripts/env.sh requirements/vllm-0.26.0.txt  # first on PATH: ruff, mypy, the matrix
venv_026=$VENV

suite() {  # requirements file, environment, then pytest args
  local req=$1 python=$2/bin/python rc
  shift 2
  "$python" - "$req" <<'PY' || return 1
import re, sys

import flashinfer, torch, vllm

pins = dict(re.findall(r"^([\w.-]+)==(\S+)", open(sys.argv[1]).read(), re.M))
print(f"[test] vLLM {vllm.__version__}, FlashInfer {flashinfer.__version__}, torch {torch.__version__}")
sys.exit(vllm.__version__ != pins["vllm"] or flashinfer.__version__ != pins["flashinfer-python"])
PY
  set +e
  "$python" -m pytest "$@"
  rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "[test] pytest collected no tests: that is a failure" >&2
  fi
  return "$rc"
}

failed=()
ruff check src tests benchmarks examples scripts || failed+=("ruff")
mypy || failed+=("mypy")
suite requirements/vllm-0.26.0.txt "$venv_026" "$@" || failed+=("vLLM 0.26.0 suite")
suite requirements/vllm-0.33.0.txt "$venv_033" "$@" || failed+=("vLLM 0.33.0 suite")
bash scripts/flashinfer_matrix.sh "$@" || failed+=("FlashInfer matrix")

if [ "${#failed[@]}" -gt 0 ]; then
  printf '[test] FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "[test] all stages passed"
