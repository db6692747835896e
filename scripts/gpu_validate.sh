#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/h200/, on a two-GPU H200 machine (device kind
# nvidia-h200-x2), in device commands of at most 10 minutes each, started back to back so the
# machine stays warm (longer work runs detached, in a new process session).
#
# Session 2 (grpo/serve examples, FlashInfer matrix; soak and kernel grid then replaced):
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh part1     # carry .devb, .whl
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh part2 .whl/flashinfer_python-*.whl
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh part3
# Session 3 (FA3 executor: kernel tests, engine tests, soak, kernel grid, offline example, e2e,
# tensor parallelism): `start` launches one pipeline per GPU, detached; `wait` (repeat) packs
# what is done so far; `tp` waits for both pipelines, then runs the TP=2 engine tests:
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh start [SECONDS]
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh wait [SECONDS]
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh tp
# Session 4 (fused decode kernel: kernel tests, engine tests, kernel grid, level breakdown on
# GPU 0; end to end with vLLM's default engine process on GPU 1), same pattern:
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh start4 [SECONDS]
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh wait [SECONDS]
# then, alone on the machine (no tests beside it), flat vs cascade in both engine-process modes:
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh e2e4
# Session 5 (CUDA graphs of cascade decode steps): kernel and engine tests on GPU 0, end to end
# with and without the graphs (CASCADE_CUDA_GRAPHS) on GPU 1; then the same three again with
# nothing else running, each GPU one configuration after another:
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh start5 [SECONDS]
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh wait [SECONDS]
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh e2e5
# and where a decode step's time goes (torch.profiler; flat, cascade, cascade without graphs):
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh prof5
# and the final table (all configurations; e2e.json), TP=2 engine tests with the graphs:
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh final5
#   source .devb/setup_device.sh && CASCADE_RESULTS_DIR=$OUT/tp python3 -m pytest -q \
#     -p no:cacheprovider tests/gpu/test_engine.py -k "tensor_parallel and v1"
# Session 6 (whole-step graphs, CASCADE_FULL_GRAPHS): first on their branch, `full6`; then on
# main with the knob on by default, GPU 0 the issue's table and a profile, GPU 1 the engine
# tests and the A/B configurations:
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh full6
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh start6 [SECONDS]
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh wait [SECONDS]
# and the engine's Python under cProfile, cascade vs flat; then the final table, alone:
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh pyprof6
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh final6
# Session 7 (one H200 only: vLLM's flat FlashInfer metadata deferred on cascade steps): the
# issue's end-to-end table, the engine tests, and where an interleaved step's time goes, one
# after another on GPU 0, detached; `wait` as before:
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh start7 [SECONDS]
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh wait [SECONDS]
# then, after a shared level that reorders every row stopped merging with an empty state: FA3
# kernel tests, interleaved prefixes flat vs cascade end to end, the engine tests' default case:
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh start7b [SECONDS]
# .whl holds truststore (the OpenAI client's httpx2 needs it; the bundle lacks it) and, for
# part2, the FlashInfer wheels of the GPU version matrix. Each part leaves its logs and JSON in
# $OUT/<part>.tar.xz (unpack into benchmarks/results/h200/ what belongs there).
set -uo pipefail
cd "$(dirname "$0")/.."
res=/tmp/gv
mkdir -p "$res"
if ! python3 -c 'import truststore' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/truststore-*.whl
fi
stamp() { echo "[gpu_validate $(date +%T)] $*"; }

part=${1:?part1, part2, part3, start, start4, e2e4, start5, prof5, e2e5, final5, full6, start6, pyprof6, final6, start7, start7b, wait or tp}

WORKLOADS=b128_16k_prefix_64_own,8_prefixes_8k_x16_interleaved,n16_sampling_32_prompts_4k,no_sharing_256_random_2k

e2e_per_config() {  # on GPU 1, one e2e_bench run (one engine) per configuration named
  local config
  for config in "$@"; do
    CUDA_VISIBLE_DEVICES=1 timeout 420 python3 benchmarks/e2e_bench.py --out "$res/e2e-$config" \
      --configs "$config" --workloads $WORKLOADS > "$res/e2e-$config.log" 2>&1
    stamp "e2e $config rc=$?"; tail -4 "$res/e2e-$config.log"
  done
}

gpu0_pipeline() {  # FA3 kernel tests, engine tests, then the soak (>= 10 min of load + replay)
  CUDA_VISIBLE_DEVICES=0 CASCADE_RESULTS_DIR="$res/kernels" timeout 300 python3 -m pytest -q \
    -p no:cacheprovider tests/gpu/test_kernels.py -k "fa3 or fp32_reference" \
    > "$res/kernels.log" 2>&1
  local rc=$?
  stamp "kernel tests rc=$rc"; tail -3 "$res/kernels.log"
  # The soak and engine tests run what CASCADE_KERNEL=auto picks (FA3 here) unless its kernel
  # tests failed: then FlashInfer's executor, and the logs say so.
  local kernel=""
  if [ $rc -ne 0 ] && grep -q "FAILED.*fa3" "$res/kernels.log"; then kernel=flashinfer; fi
  echo "${kernel:-auto}" > "$res/kernel_used"
  CUDA_VISIBLE_DEVICES=0 CASCADE_TEST_KERNEL=$kernel CASCADE_RESULTS_DIR="$res/engine" \
    timeout 480 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine.py \
    > "$res/engine.log" 2>&1
  stamp "engine tests rc=$?"; tail -3 "$res/engine.log"
  CUDA_VISIBLE_DEVICES=0 ${kernel:+CASCADE_KERNEL=$kernel} python3 benchmarks/soak.py \
    --out "$res/soak" > "$res/soak.log" 2>&1
  stamp "soak rc=$?"; tail -5 "$res/soak.log"
}

gpu1_pipeline() {  # kernel grid, offline example, then the end-to-end benchmark config by config
  CUDA_VISIBLE_DEVICES=1 timeout 420 python3 benchmarks/kernel_bench.py --out "$res/kernel" \
    > "$res/kernel.log" 2>&1
  stamp "kernel bench rc=$?"; tail -30 "$res/kernel.log"
  CUDA_VISIBLE_DEVICES=1 timeout 240 python3 examples/offline_shared_prompt.py \
    > "$res/offline.log" 2>&1
  stamp "offline example rc=$?"; tail -8 "$res/offline.log"
  e2e_per_config cascade cascade_always flashinfer flash_attn
}

gpu0_tests() {  # $1: the kernel tests' -k expression; then the engine tests (both runners)
  CUDA_VISIBLE_DEVICES=0 CASCADE_RESULTS_DIR="$res/kernels" timeout 300 python3 -m pytest -q \
    -p no:cacheprovider tests/gpu/test_kernels.py -k "$1" > "$res/kernels.log" 2>&1
  stamp "kernel tests rc=$?"; tail -3 "$res/kernels.log"
  CUDA_VISIBLE_DEVICES=0 CASCADE_RESULTS_DIR="$res/engine" timeout 480 python3 -m pytest -q \
    -p no:cacheprovider tests/gpu/test_engine.py -k "not tensor_parallel" > "$res/engine.log" 2>&1
  stamp "engine tests rc=$?"; tail -3 "$res/engine.log"
}

gpu0_pipeline4() {  # FA3 kernel tests, engine tests (both runners), kernel grid, breakdown
  gpu0_tests "fa3 or fp32_reference or corrupted"
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/kernel_bench.py --out "$res/kernel" \
    > "$res/kernel.log" 2>&1
  stamp "kernel bench rc=$?"; tail -30 "$res/kernel.log"
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/fa3_levels.py --out "$res/levels" \
    > "$res/levels.log" 2>&1
  stamp "fa3 levels rc=$?"
}

gpu1_pipeline4() {  # end to end, one engine per configuration, flat configurations first
  e2e_per_config flashinfer cascade cascade_always flash_attn
}

gpu0_pipeline5() {  # FA3 kernel tests (graphed decode steps included), engine tests
  gpu0_tests "fa3 or fp32_reference or corrupted or graphed"
}

gpu1_pipeline5() {  # end to end: flat, cascade with and without the decode graphs
  e2e_per_config flashinfer cascade cascade_nographs
}

gpu0_pipeline6() {  # the issue's end-to-end table (e2e.json), then where a cascade step's time goes
  CUDA_VISIBLE_DEVICES=0 timeout 480 python3 benchmarks/e2e_bench.py --out "$res/e2e-final" \
    --configs flash_attn,flashinfer,cascade --workloads $WORKLOADS > "$res/e2e-final.log" 2>&1
  stamp "e2e rc=$?"; tail -n 12 "$res/e2e-final.log" | cut -c1-200
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/profile_step.py --config cascade \
    --out "$res/profile" > /dev/null 2>&1
  stamp "profile cascade rc=$?"; head -40 "$res/profile/profile-cascade.txt" | cut -c1-150
}

gpu1_pipeline6() {  # engine tests (both runners, both graph modes), then the A/B configurations
  CUDA_VISIBLE_DEVICES=1 CASCADE_RESULTS_DIR="$res/engine" timeout 480 python3 -m pytest -q \
    -p no:cacheprovider tests/gpu/test_engine.py -k "not tensor_parallel" > "$res/engine.log" 2>&1
  stamp "engine tests rc=$?"; tail -3 "$res/engine.log"
  CUDA_VISIBLE_DEVICES=1 timeout 420 python3 benchmarks/e2e_bench.py --out "$res/e2e-ab" \
    --configs cascade_layergraphs,cascade_always --workloads $WORKLOADS > "$res/e2e-ab.log" 2>&1
  stamp "e2e A/B rc=$?"
}

gpu0_pipeline7() {  # one GPU: the issue's table (e2e.json), engine tests, an interleaved profile
  CUDA_VISIBLE_DEVICES=0 timeout 480 python3 benchmarks/e2e_bench.py --out "$res/e2e-final7" \
    --configs flash_attn,flashinfer,cascade --workloads $WORKLOADS > "$res/e2e-final7.log" 2>&1
  stamp "e2e rc=$?"; grep -h '"workload"' "$res/e2e-final7.log" | cut -c1-130
  CUDA_VISIBLE_DEVICES=0 CASCADE_RESULTS_DIR="$res/engine" timeout 480 python3 -m pytest -q \
    -p no:cacheprovider tests/gpu/test_engine.py -k "not tensor_parallel" > "$res/engine.log" 2>&1
  stamp "engine tests rc=$?"; tail -3 "$res/engine.log"
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/profile_step.py --config cascade \
    --workload 8_prefixes_8k_x16_interleaved --out "$res/profile7" > /dev/null 2>&1
  stamp "profile cascade interleaved rc=$?"; head -30 "$res/profile7/profile-cascade.txt"
}

gpu0_pipeline7b() {
  CUDA_VISIBLE_DEVICES=0 CASCADE_RESULTS_DIR="$res/kernels" timeout 300 python3 -m pytest -q \
    -p no:cacheprovider tests/gpu/test_kernels.py -k "fa3 or fp32_reference or graphed" \
    > "$res/kernels.log" 2>&1
  stamp "kernel tests rc=$?"; tail -3 "$res/kernels.log"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/e2e_bench.py --out "$res/e2e-interleaved7" \
    --configs flashinfer,cascade --workloads 8_prefixes_8k_x16_interleaved \
    > "$res/e2e-interleaved7.log" 2>&1
  stamp "e2e rc=$?"; grep -h '"workload"' "$res/e2e-interleaved7.log" | cut -c1-130
  CUDA_VISIBLE_DEVICES=0 CASCADE_RESULTS_DIR="$res/engine7b" timeout 400 python3 -m pytest -q \
    -p no:cacheprovider tests/gpu/test_engine.py -k cascade_engine_matches > "$res/engine7b.log" 2>&1
  stamp "engine tests rc=$?"; tail -3 "$res/engine7b.log"
}

wait_pipelines() {  # until both pipelines are done or $1 seconds have passed
  local deadline=$((SECONDS + ${1:-540}))
  while [ $SECONDS -lt $deadline ] && { [ ! -e "$res/gpu0.done" ] || [ ! -e "$res/gpu1.done" ]; }
  do sleep 5; done
  cat "$res"/gpu*.log 2>/dev/null | tail -60
}

start_pipelines() {  # $1 $2: the GPU 0 and GPU 1 pipelines, detached; $3: seconds to wait
  export -f "$1" "$2" stamp e2e_per_config gpu0_tests
  export res WORKLOADS
  local gpu fn
  for gpu in 0 1; do
    fn=$1; [ $gpu = 1 ] && fn=$2
    setsid nohup bash -c "$fn > \"\$res/gpu$gpu.log\" 2>&1; touch \"\$res/gpu$gpu.done\"" \
      < /dev/null > /dev/null 2>&1 &
  done
  stamp "pipelines started"
  wait_pipelines "${3:-540}"
}

case $part in
start)
  start_pipelines gpu0_pipeline gpu1_pipeline "${2:-540}"
  ;;
start4)
  start_pipelines gpu0_pipeline4 gpu1_pipeline4 "${2:-540}"
  ;;
wait)
  wait_pipelines "${2:-540}"
  ;;
tp)
  wait_pipelines 580
  # Both GPUs: workloads (a) and (d) with tensor_parallel_size=2 on the V1 runner (V2: part3).
  CASCADE_TEST_KERNEL=$(sed 's/auto//' "$res/kernel_used" 2>/dev/null) \
    CASCADE_RESULTS_DIR="$res/tp" timeout 400 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_engine.py -k "tensor_parallel and v1" > "$res/tp.log" 2>&1
  stamp "tensor-parallel tests rc=$?"; tail -3 "$res/tp.log"
  ;;
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
e2e4)
  # GPU 0 with vLLM's default engine process, GPU 1 in-process; same engines, same order.
  CUDA_VISIBLE_DEVICES=0 timeout 470 python3 benchmarks/e2e_bench.py --out "$res/e2e-mp" \
    --configs flashinfer,cascade --workloads $WORKLOADS > "$res/e2e-mp.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 470 python3 benchmarks/e2e_bench.py --out "$res/e2e-inproc" \
    --configs flashinfer,cascade --workloads $WORKLOADS --in-process > "$res/e2e-inproc.log" 2>&1 &
  wait
  stamp "e2e done"; tail -3 "$res"/e2e-*.log
  ;;
start5)
  start_pipelines gpu0_pipeline5 gpu1_pipeline5 "${2:-540}"
  ;;
start6)
  start_pipelines gpu0_pipeline6 gpu1_pipeline6 "${2:-540}"
  ;;
start7|start7b)  # one GPU: its pipeline detached; `wait` counts GPU 1's as done
  fn=gpu0_pipeline7; [ "$part" = start7b ] && fn=gpu0_pipeline7b
  export -f "$fn" stamp
  export res WORKLOADS
  touch "$res/gpu1.done"
  setsid nohup bash -c "$fn > \"\$res/gpu0.log\" 2>&1; touch \"\$res/gpu0.done\"" \
    < /dev/null > /dev/null 2>&1 &
  stamp "pipeline started"
  wait_pipelines "${2:-540}"
  ;;
final6)
  # The end-to-end table with nothing else on the machine: each GPU runs the issue's three
  # configurations in one e2e_bench run, in opposite orders (GPU 0's is e2e.json).
  CUDA_VISIBLE_DEVICES=0 timeout 450 python3 benchmarks/e2e_bench.py --out "$res/e2e-final6" \
    --configs flash_attn,flashinfer,cascade --workloads $WORKLOADS > "$res/e2e-final6.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 450 python3 benchmarks/e2e_bench.py --out "$res/e2e-final6-b" \
    --configs cascade,flashinfer,flash_attn --workloads $WORKLOADS \
    > "$res/e2e-final6-b.log" 2>&1 &
  wait
  stamp "e2e done"; grep -h '"workload"' "$res"/e2e-final6*.log | cut -c1-130
  ;;
pyprof6)
  # The engine's Python under cProfile (benchmarks/profile_step.py --python): cascade on GPU 0,
  # flat FlashInfer on GPU 1, the 128 x 16K workload.
  for gpu in 0 1; do
    config=cascade; [ $gpu = 1 ] && config=flashinfer
    CUDA_VISIBLE_DEVICES=$gpu timeout 280 python3 benchmarks/profile_step.py --python \
      --config $config --out "$res/pyprofile" > /dev/null 2>&1 &
  done
  wait
  for f in "$res"/pyprofile/pyprofile-*.txt; do head -75 "$f" | cut -c1-140; done
  ;;
prof5)
  # GPU 0: the graphed-decode kernel tests, then a profiled cascade run; GPU 1: profiled runs
  # of flat FlashInfer and cascade without the graphs (benchmarks/profile_step.py).
  (
    CUDA_VISIBLE_DEVICES=0 CASCADE_RESULTS_DIR="$res/kernels-graphed" timeout 150 python3 -m \
      pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k graphed > "$res/graphed.log" 2>&1
    stamp "graphed kernel tests rc=$?"; tail -3 "$res/graphed.log"
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/profile_step.py --config cascade \
      --out "$res/profile" > /dev/null 2>&1
    stamp "profile cascade rc=$?"
  ) &
  for config in flashinfer cascade_nographs; do
    CUDA_VISIBLE_DEVICES=1 timeout 170 python3 benchmarks/profile_step.py --config $config \
      --out "$res/profile" > /dev/null 2>&1
    stamp "profile $config rc=$?"
  done
  wait
  cat "$res"/profile/*.txt 2>/dev/null | cut -c1-150
  ;;
e2e5)
  # Nothing else on the machine: each GPU runs the three configurations one after another, in
  # opposite orders of the two cascade ones (two repeats of each, order effects visible).
  seq() {
    local gpu=$1 config; shift
    for config in "$@"; do
      CUDA_VISIBLE_DEVICES=$gpu timeout 190 python3 benchmarks/e2e_bench.py \
        --out "$res/e2e5-gpu$gpu-$config" --configs "$config" --workloads $WORKLOADS \
        > "$res/e2e5-gpu$gpu-$config.log" 2>&1
      stamp "e2e gpu$gpu $config rc=$?"
    done
  }
  seq 0 cascade cascade_nographs flashinfer &
  seq 1 cascade_nographs cascade flashinfer &
  wait
  tail -n 4 "$res"/e2e5-*.log
  ;;
final5)
  # The end-to-end table: GPU 0 runs the issue's three configurations in one e2e_bench run
  # (e2e.json); GPU 1 at the same time the cost model's calibration runs (cascade on every
  # step) and cascade without the graphs.
  CUDA_VISIBLE_DEVICES=0 timeout 420 python3 benchmarks/e2e_bench.py --out "$res/e2e-final" \
    --configs flash_attn,flashinfer,cascade --workloads $WORKLOADS > "$res/e2e-final.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 420 python3 benchmarks/e2e_bench.py --out "$res/e2e-final-b" \
    --configs cascade_always,cascade_nographs --workloads $WORKLOADS \
    > "$res/e2e-final-b.log" 2>&1 &
  wait
  stamp "e2e done"; tail -n 3 "$res"/e2e-final*.log
  ;;
full6)
  # The first GPU run of whole-step graphs (then on a branch, knob off; here with the knob's
  # later names): GPU 0 their engine tests, GPU 1 flat vs per-layer graphs vs whole-step graphs.
  CUDA_VISIBLE_DEVICES=0 CASCADE_RESULTS_DIR="$res/engine-full" timeout 480 python3 -m pytest -q \
    -p no:cacheprovider tests/gpu/test_engine.py -k cascade_engine_matches \
    > "$res/engine-full.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 480 python3 benchmarks/e2e_bench.py --out "$res/e2e-full" \
    --configs flashinfer,cascade_layergraphs,cascade --workloads $WORKLOADS \
    > "$res/e2e-full.log" 2>&1 &
  wait
  stamp "done"; tail -n 5 "$res"/engine-full.log "$res"/e2e-full.log
  ;;
part3)
  # Both GPUs: workloads (a) and (d) with tensor_parallel_size=2.
  CASCADE_RESULTS_DIR="$res/tp" timeout 400 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_engine.py -k tensor_parallel > "$res/tp.log" 2>&1
  stamp "tensor-parallel tests rc=$?"; tail -3 "$res/tp.log"
  ;;
esac
tar -C "$res" -cJf "${OUT:-/tmp}/$part.tar.xz" --exclude='*.safetensors' --exclude='*.bin' \
  --exclude='*.done' .
ls -la "${OUT:-/tmp}"
