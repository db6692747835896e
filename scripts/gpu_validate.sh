#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/h200/, on a two-GPU H200 machine (device kind
# nvidia-h200-x2), in three device commands of at most 10 minutes each, started back to back so
# the machine stays warm (the soak runs longer than one command, so it runs detached):
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh part1     # carry .devb, .whl
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh part2 .whl/flashinfer_python-*.whl
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh part3
# .whl holds truststore (the OpenAI client's httpx2 needs it; the bundle lacks it) and, for
# part2, the FlashInfer wheels of the GPU version matrix. Each part leaves its logs and JSON in
# $OUT/partN.tar.xz (unpack into benchmarks/results/h200/ what belongs there).
set -uo pipefail
cd "$(dirname "$0")/.."
res=/tmp/gv
mkdir -p "$res"
if ! python3 -c 'import truststore' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/truststore-*.whl
fi
stamp() { echo "[gpu_validate $(date +%T)] $*"; }

part=${1:?part1, part2 or part3}
case $part in
part1)
  # GPU 0: the soak (>= 10 min of load, then the replay without the plugin), detached.
  CUDA_VISIBLE_DEVICES=0 setsid nohup python3 benchmarks/soak.py --out "$res/soak" \
    > "$res/soak.log" 2>&1 < /dev/null &
  stamp "soak started (pid $!)"
  # GPU 1: engine-level correctness (V2, V1, corrupted plan), then the GRPO example.
  CUDA_VISIBLE_DEVICES=1 CASCADE_RESULTS_DIR="$res/engine" timeout 420 python3 -m pytest -q \
    -p no:cacheprovider tests/gpu/test_engine.py > "$res/engine.log" 2>&1
  stamp "engine tests rc=$?"; tail -3 "$res/engine.log"
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 examples/grpo_rollouts.py > "$res/grpo.log" 2>&1
  stamp "grpo example rc=$?"; tail -4 "$res/grpo.log"
  ;;
part2)
  shift
  (  # GPU 1: the kernel tests per FlashInfer release, then the kernel benchmark grid.
    CUDA_VISIBLE_DEVICES=1 timeout 330 python3 scripts/gpu_flashinfer_matrix.py \
      --out "$res/fi-matrix" "$@" > "$res/fi-matrix.log" 2>&1
    stamp "flashinfer matrix rc=$?"; cat "$res/fi-matrix.log"
    CUDA_VISIBLE_DEVICES=1 timeout 240 python3 benchmarks/kernel_bench.py --out "$res/kernel" \
      > "$res/kernel.log" 2>&1
    stamp "kernel bench rc=$?"; tail -25 "$res/kernel.log"
  ) &
  (  # GPU 0: wait for the soak, then `vllm serve` with the OpenAI-client example.
    while pgrep -f benchmarks/soak.py > /dev/null; do sleep 5; done
    stamp "soak done"; tail -5 "$res/soak.log"
    CUDA_VISIBLE_DEVICES=0 VLLM="python3 -m vllm.entrypoints.cli.main" WORK=/tmp/serve \
      timeout 300 bash examples/serve/serve.sh > "$res/serve.log" 2>&1
    stamp "serve example rc=$?"; tail -15 "$res/serve.log"; cp /tmp/serve/server.log "$res/"
  ) &
  wait
  ;;
part3)
  # Both GPUs: workloads (a) and (d) with tensor_parallel_size=2.
  CASCADE_RESULTS_DIR="$res/tp" timeout 400 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_engine.py -k tensor_parallel > "$res/tp.log" 2>&1
  stamp "tensor-parallel tests rc=$?"; tail -3 "$res/tp.log"
  ;;
esac
tar -C "$res" -cJf "${OUT:-/tmp}/$part.tar.xz" --exclude='*.safetensors' --exclude='*.bin' .
ls -la "${OUT:-/tmp}"
