#!/usr/bin/env bash
# `vllm serve` with the plugin, then many questions about one document from the OpenAI client,
# then the plugin's Prometheus metrics from /metrics. Needs a CUDA GPU, vLLM and the plugin.
#   bash examples/serve/serve.sh            # MODEL=examples/models/llama3-8b by default
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:-$here/../models/llama3-8b}
WORK=${WORK:-${TMPDIR:-/tmp}/vllm-cascade-serve}
PORT=${PORT:-8000}
VLLM=${VLLM:-vllm}   # e.g. VLLM="python -m vllm.entrypoints.cli.main"

# Setup: the config with a word-level tokenizer (vllm serve needs one; the weights are dummy).
python "$here/make_tokenizer.py" "$MODEL" "$WORK/model"

# The plugin's counters live in the engine's processes, /metrics is served by the API server:
# prometheus_client's multiprocess mode joins them. It needs an empty folder, named before start.
export PROMETHEUS_MULTIPROC_DIR=$WORK/prometheus
rm -rf "$PROMETHEUS_MULTIPROC_DIR" && mkdir -p "$PROMETHEUS_MULTIPROC_DIR"

CASCADE_ATTENTION=1 CASCADE_LOG_INTERVAL=${CASCADE_LOG_INTERVAL:-10} \
  $VLLM serve "$WORK/model" --served-model-name demo --load-format dummy \
    --attention-backend FLASHINFER --enable-prefix-caching --max-model-len 16384 \
    --port "$PORT" > "$WORK/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
echo "vllm serve started (log: $WORK/server.log); waiting for it to answer"

python "$here/ask_document.py" --base-url "http://localhost:$PORT/v1"

echo "--- the plugin's periodic log lines:"
grep "vllm-cascade-plugin: last" "$WORK/server.log" || echo "(none yet: CASCADE_LOG_INTERVAL=${CASCADE_LOG_INTERVAL:-10} s)"
echo "--- the plugin's metrics on /metrics:"
python - "$PORT" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://localhost:{sys.argv[1]}/metrics").read().decode()
print("\n".join(line for line in text.splitlines() if line.startswith("vllm_cascade_")))
PY
