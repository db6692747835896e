# Sourced by scripts/flashinfer_matrix.sh and scripts/test.sh, after scripts/env.sh has set up
# vLLM 0.26.0's environment (VENV): the FlashInfer matrix's cells, one per release in
# requirements/flashinfer-matrix.txt.
#   fi_cells                      the cells, one line each ("release [extra packages...]")
#   fi_base                       the environment's own release (its cell needs no overlay)
#   fi_build_overlays             build every missing overlay, side by side
#   fi_cell "LINE" [pytest args]  run one cell: check that the FlashInfer it finds is the
#                                 release it names, then the tests marked flashinfer (from
#                                 the files tests/matrix_files.py names)
# Overlays live next to the environments (${CASCADE_VENV_CACHE:-~/.cache/vllm-cascade-plugin}/
# fi-<release>-<hash>), keyed by their line and the Python version; each installs its line
# --no-deps into a folder that goes first on PYTHONPATH.
fi_cache=${CASCADE_VENV_CACHE:-$HOME/.cache/vllm-cascade-plugin}
fi_base=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("flashinfer-python"))')
mapfile -t fi_cells < <(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' \
  "$(dirname "${BASH_SOURCE[0]}")/../requirements/flashinfer-matrix.txt")

fi_overlay_dir() {  # release, then its extra packages; prints the overlay folder ("" for the base)
  local release=$1 key
  shift
  [ "$release" = "$fi_base" ] && return 0
  key=$( { echo "$release $*"; "$VENV/bin/python" -c 'import sys; print(sys.version)'; } \
         | sha256sum | cut -c1-16)
  echo "$fi_cache/fi-$release-$key"
}

fi_build_overlay() {  # release, then its extra packages
  local dir
  dir=$(fi_overlay_dir "$@")
  [ -z "$dir" ] || [ -f "$dir/.complete" ] && return 0
  echo "[fi-matrix] building $dir"
  rm -rf "$dir"
  # uv's cache of the environments (scripts/env.sh): a wheel an environment has too is linked.
  UV_CACHE_DIR="$fi_cache/uv" UV_LINK_MODE=hardlink \
    uv pip install -q --python "$VENV/bin/python" --no-deps --target "$dir" \
    "flashinfer-python==$1" "${@:2}" || return 1
  touch "$dir/.complete"
}

fi_build_overlays() {
  local cell pids=() failed=0 words
  for cell in "${fi_cells[@]}"; do
    read -r -a words <<< "$cell"
    fi_build_overlay "${words[@]}" & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  return "$failed"
}

fi_cell() {  # "release [extra packages...]", then pytest args
  local words overlay path
  read -r -a words <<< "$1"
  shift
  fi_build_overlay "${words[@]}" || return 1
  overlay=$(fi_overlay_dir "${words[@]}")
  path=${overlay:+$overlay${PYTHONPATH:+:$PYTHONPATH}}
  # Without importing anything heavy: the FlashInfer found first is the cell's (its package and
  # its distribution's metadata, from the overlay for every cell but the base). The tests marked
  # flashinfer then check that the module they import is that distribution's.
  PYTHONPATH=${path:-${PYTHONPATH:-}} "$VENV/bin/python" - "${words[0]}" "$overlay" <<'PY' || return 1
import importlib.util
import sys
from pathlib import Path

from vllm_cascade_plugin.integration.compat.releases import check_environment

release, overlay = sys.argv[1:]
spec = importlib.util.find_spec("flashinfer")
report = check_environment()
state = "supported" if report.supported else "refused: " + "; ".join(report.problems)
print(f"[fi-matrix] FlashInfer {report.flashinfer} ({spec and spec.origin}), vLLM {report.vllm}:",
      state)
where = Path(spec.origin).resolve() if spec and spec.origin else None
sys.exit(0 if report.flashinfer == release and where is not None
         and (not overlay or where.is_relative_to(Path(overlay).resolve())) else 1)
PY
  # Only the files with marked tests (tests/matrix_files.py). Any non-zero status fails the
  # cell, 5 (no test collected) included.
  local files
  mapfile -t files < <("$VENV/bin/python" tests/matrix_files.py)
  PYTHONPATH=${path:-${PYTHONPATH:-}} pytest_run "$VENV/bin/python" -q -p no:cacheprovider \
    -m flashinfer "${files[@]}" "$@"
}
