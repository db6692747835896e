#!/usr/bin/env bash
# The FlashInfer matrix beside vLLM 0.26.0, on CPU: one cell per release in
# requirements/flashinfer-matrix.txt, side by side (scripts/stages.sh). A cell checks that the
# FlashInfer it finds is the release it names, then runs the tests marked flashinfer: those whose
# outcome can depend on the installed FlashInfer (registration and the version gate, the API we
# call, the scale handling and the integration of our builder and impl subclasses with vLLM's,
# the GPU tests' imports, which skip without CUDA). scripts/test.sh runs every other test with
# FlashInfer unusable (tests/hide_flashinfer), where a test that touches it fails: the marks
# cannot miss one. Overlays: scripts/fi_cells.sh. Fails if any cell fails.
# Usage: bash scripts/flashinfer_matrix.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh requirements/vllm-0.26.0.txt
source scripts/stages.sh
source scripts/fi_cells.sh
fi_build_overlays
for cell in "${fi_cells[@]}"; do
  stage "FlashInfer ${cell%% *} beside vLLM 0.26.0" fi_cell "$cell" "$@"
done
run_stages
