#!/usr/bin/env bash
# The test command (what CI runs: .ci/run). Builds (or reuses) the pinned virtual environments
# and the FlashInfer matrix's overlays, then runs these stages on CPU, side by side
# (scripts/stages.sh: as many at a time as there are CPUs, up to 4):
#   - ruff and mypy;
#   - vLLM 0.26.0 + FlashInfer 0.6.14: the test suite in two runs. The tests not marked
#     flashinfer run with FlashInfer unusable (tests/hide_flashinfer): one that touches it fails,
#     so every test whose outcome can depend on the FlashInfer release beside the matrix's vLLM
#     is marked. The marked ones run beside them, and are the FlashInfer matrix's cell for 0.6.14;
#   - vLLM 0.33.0 + FlashInfer 0.7.2.post1: the test suite, in two runs side by side (unmarked,
#     marked; FlashInfer usable in both: 0.33's own imports read FlashInfer's files);
#   - vLLM 0.34.0 + FlashInfer 0.7.4 (Model Runner V2 only; 0.34 pins FlashInfer 0.7.3, which the
#     package index never served: requirements/vllm-0.34.0.overrides.txt): the same two runs;
#   - the FlashInfer matrix's other cells beside vLLM 0.26.0: the marked tests under each
#     release (scripts/flashinfer_matrix.sh, scripts/fi_cells.sh).
# GPU tests (tests/gpu) skip without CUDA. Every stage runs; the command fails if any failed, and
# a pytest run that collects no test counts as failed. pytest args go to every pytest run.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

# Environments first, one after the other: the second links the wheels it shares with the first
# (the same files in uv's cache, ~3 GB) where two builds side by side would each unpack their
# own. Failing to build one stops everything (nothing ran in the wrong one).
source scripts/env.sh requirements/vllm-0.34.0.txt
venv_034=$VENV
source scripts/env.sh requirements/vllm-0.33.0.txt
venv_033=$VENV
source scripts/env.sh requirements/vllm-0.26.0.txt  # first on PATH: ruff, mypy, the matrix
venv_026=$VENV
source scripts/fi_cells.sh
fi_build_overlays
source scripts/stages.sh

lint() {
  local failed=0
  ruff check src tests benchmarks examples scripts || failed=1
  mypy || failed=1
  return "$failed"
}

pins() {  # requirements file, environment: the installed vLLM and FlashInfer are the pinned ones
  "$2/bin/python" - "$1" <<'PY'
import importlib.metadata as m, re, sys

pins = dict(re.findall(r"^([\w.-]+)==(\S+)", open(sys.argv[1]).read(), re.M))
have = {d: m.version(d) for d in ("vllm", "flashinfer-python", "torch")}
print(f"[test] vLLM {have['vllm']}, FlashInfer {have['flashinfer-python']}, torch {have['torch']}")
sys.exit(have["vllm"] != pins["vllm"] or have["flashinfer-python"] != pins["flashinfer-python"])
PY
}

suite() {  # requirements file, environment, then pytest args
  local req=$1 venv=$2
  shift 2
  pins "$req" "$venv" && pytest_run "$venv/bin/python" "$@"
}

unmarked() {  # requirements file, environment, then pytest args: with FlashInfer unusable
  local req=$1 venv=$2
  shift 2
  pins "$req" "$venv" && PYTHONPATH=tests/hide_flashinfer${PYTHONPATH:+:$PYTHONPATH} \
    pytest_run "$venv/bin/python" -m "not flashinfer" "$@"
}

# Longest first: the table at the end shows each stage's time.
stage "vLLM 0.33.0 suite, tests not marked flashinfer" \
  suite requirements/vllm-0.33.0.txt "$venv_033" -m "not flashinfer" "$@"
stage "vLLM 0.34.0 suite, tests not marked flashinfer" \
  suite requirements/vllm-0.34.0.txt "$venv_034" -m "not flashinfer" "$@"
stage "vLLM 0.26.0 suite, tests not marked flashinfer (FlashInfer unusable)" \
  unmarked requirements/vllm-0.26.0.txt "$venv_026" "$@"
stage "ruff and mypy" lint
stage "vLLM 0.33.0 suite, tests marked flashinfer" \
  suite requirements/vllm-0.33.0.txt "$venv_033" -m flashinfer "$@"
stage "vLLM 0.34.0 suite, tests marked flashinfer (FlashInfer 0.7.4)" \
  suite requirements/vllm-0.34.0.txt "$venv_034" -m flashinfer "$@"
for cell in "${fi_cells[@]}"; do
  [ "${cell%% *}" = "$fi_base" ] && continue
  stage "FlashInfer ${cell%% *} beside vLLM 0.26.0: tests marked flashinfer" fi_cell "$cell" "$@"
done
stage "vLLM 0.26.0 suite, tests marked flashinfer (FlashInfer $fi_base: its matrix cell)" \
  suite requirements/vllm-0.26.0.txt "$venv_026" -m flashinfer "$@"

if run_stages; then
  echo "[test] all stages passed"
else
  echo "[test] FAILED: see the stages marked FAILED above" >&2
  exit 1
fi
