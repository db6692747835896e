#!/usr/bin/env bash
# The FlashInfer matrix beside vLLM 0.26.0, on CPU: one cell per release in
# requirements/flashinfer-matrix.txt. A cell checks that the FlashInfer it imports is the release
# it names, then runs the tests that depend on FlashInfer: registration and the version gate,
# the API we call (compat.flashinfer_api_problems), the scale handling and the integration of our
# builder and impl subclasses with vLLM's, and the GPU tests' imports (they skip without CUDA).
# Overlays live next to the environments (${CASCADE_VENV_CACHE:-~/.cache/vllm-cascade-plugin}/
# fi-<release>-<hash>), keyed like them. Prints one result line per cell; fails if any cell fails.
# Usage: bash scripts/flashinfer_matrix.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh requirements/vllm-0.26.0.txt
cache=${CASCADE_VENV_CACHE:-$HOME/.cache/vllm-cascade-plugin}
base=$(python -c 'from vllm_cascade_plugin.compat import installed_version as v
print(v("flashinfer-python"))')
tests=(tests/test_registration.py tests/test_scale.py tests/test_integration_cpu.py
       tests/gpu/test_kernels.py)
mapfile -t cells < <(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' requirements/flashinfer-matrix.txt)

overlay_for() {  # release, then its extra packages; prints the overlay folder ("" for the base)
  local release=$1; shift
  [ "$release" = "$base" ] && return 0
  local key dir
  key=$( { echo "$release $*"; python -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
  dir="$cache/fi-$release-$key"
  if [ ! -f "$dir/.complete" ]; then
    echo "[fi-matrix] building $dir" >&2
    rm -rf "$dir"
    uv pip install -q --python "$VENV/bin/python" --no-deps --no-compile --target "$dir" \
      "flashinfer-python==$release" "$@" >&2 || return 1
    touch "$dir/.complete"
  fi
  echo "$dir"
}

# Called as an `if` condition, where errexit is off: every step returns its failure itself.
run_cell() {  # release, then its extra packages
  local release=$1 overlay
  overlay=$(overlay_for "$@") || return 1
  env ${overlay:+PYTHONPATH="$overlay"} python - "$release" <<'PY' || return 1
import sys

import flashinfer

from vllm_cascade_plugin.compat import check_environment

report = check_environment()
state = "supported" if report.supported else "refused: " + "; ".join(report.problems)
print(f"[fi-matrix] FlashInfer {report.flashinfer} ({flashinfer.__file__}), vLLM {report.vllm}:",
      state)
sys.exit(0 if flashinfer.__version__ == report.flashinfer == sys.argv[1] else 1)
PY
  # Any non-zero status fails the cell, 5 (no test collected) included.
  env ${overlay:+PYTHONPATH="$overlay"} python -m pytest -q -p no:cacheprovider "${tests[@]}" \
    "${pytest_args[@]}"
}

pytest_args=("$@")
results=() failed=0
for cell in "${cells[@]}"; do
  read -r -a words <<< "$cell"
  if run_cell "${words[@]}"; then
    results+=("[fi-matrix] FlashInfer ${words[0]} beside vLLM 0.26.0: passed")
  else
    results+=("[fi-matrix] FlashInfer ${words[0]} beside vLLM 0.26.0: FAILED")
    failed=1
  fi
done
printf '%s\n' "${results[@]}"
exit "$failed"
