# Sourced by scripts/test.sh, scripts/main.sh and scripts/flashinfer_matrix.sh: builds (or
# reuses) the virtual environment for one pinned requirements file and installs this checkout
# into it. Usage:
#   source scripts/env.sh [requirements/vllm-0.26.0.txt]
# A file <name>.overrides.txt beside the requirements file, where there is one, replaces what a
# dependency declares (uv's --override: vLLM 0.34.0 pins a FlashInfer the index never served).
# The environment lives outside the clone, under ${CASCADE_VENV_CACHE:-~/.cache/vllm-cascade-plugin},
# keyed by the hash of the requirements file, its overrides and the Python version; a missing or half-built one
# is (re)built from PyPI (~4.5 GB of downloads, ~10 min cold). Exports VENV and puts its bin/
# first on PATH. All that the test environments take on disk is in that one folder (README,
# Development): uv's cache of the downloads is its uv/ (the FlashInfer overlays' too), on the
# same file system as the environments, so their files are hard links into it and every
# environment links the same copy of a wheel it shares with another; the user's own uv cache is
# left alone, and pip keeps no cache.
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_req=${1:-$_root/requirements/vllm-0.26.0.txt}
_py=${CASCADE_PYTHON:-python3}
_overrides=${_req%.txt}.overrides.txt
[ -f "$_overrides" ] || _overrides=
_key=$( { cat "$_req" ${_overrides:+"$_overrides"}; "$_py" -c 'import sys; print(sys.version)'; } \
        | sha256sum | cut -c1-16)
_cache=${CASCADE_VENV_CACHE:-$HOME/.cache/vllm-cascade-plugin}
VENV="$_cache/venv-$(basename "$_req" .txt)-$_key"
_uv=(env UV_CACHE_DIR="$_cache/uv" UV_LINK_MODE=hardlink "$VENV/bin/uv")
if [ ! -f "$VENV/.complete" ]; then
  echo "[env] building $VENV from $(basename "$_req") (first time only: downloads ~4.5 GB)"
  rm -rf "$VENV"; mkdir -p "$_cache"
  "$_py" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --no-cache-dir --upgrade pip uv
  "${_uv[@]}" pip install -q --python "$VENV/bin/python" -r "$_req" \
    ${_overrides:+--override "$_overrides"}
  touch "$VENV/.complete"
else
  echo "[env] reusing $VENV"
fi
# The checkout itself: editable, without dependencies (they are pinned above), so a fresh clone
# in another folder takes over the cached environment in seconds.
"${_uv[@]}" pip install -q --python "$VENV/bin/python" --no-deps -e "$_root"
# Bytecode caches: written, next to the environments (never into the clone), and read by every
# later process, even where PYTHONDONTWRITEBYTECODE is set (compiling vLLM's import from source
# costs each process ~18 s of CPU, ~7 s compiled).
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$_cache/pycache"
export VENV PATH="$VENV/bin:$PATH"
