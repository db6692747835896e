#!/usr/bin/env bash
# Every GPU check of the plugin, on the H200 device machine. Every device command starts with
# `source .devb/setup_device.sh` (carry .devb). One command may run 10 minutes, so the pipeline
# runs detached and later commands wait for it:
#
#   source .devb/setup_device.sh && CASCADE_COMMIT=<sha> bash scripts/gpu_validate.sh start all
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh wait [SECONDS]   # repeat
#
# A machine idle for about 30 s between commands is given back with the run on it: `wait` on a
# fresh machine exits at once with status 3 and says so (issue the next `wait` right away).
#
# Each waiting command packs what has finished into $OUT (gv.tar.xz; the compiled-kernel caches
# once the run is done), so a run cut short keeps its finished parts. `start PART...` runs the
# named parts one after another instead; `PART` alone runs one in the foreground.
#
# `all` runs, in the order users meet the paths, first side by side on the one GPU (the tests'
# engines take a small share of it each, at most CASCADE_ENGINE_SLOTS at a time, and every
# engine configuration runs once for all the tests that need it: tests/gpu/engines.py):
#   engine_flash_attn  tests/gpu/test_flash_attn_engine.py: the plugin in vLLM's default
#                      FLASH_ATTN backend vs FLASH_ATTN off (FlashInfer the second kernel), both
#                      runners (mixed steps split; on V2 also planned whole, the default), a
#                      no-sharing workload on both runners, a corrupted plan
#   engine_flashinfer  tests/gpu/test_engine.py: the same in FLASHINFER, both runners, whole-step
#                      graphs; a corrupted plan and a one-page error must fail
#   engine_graphs      the same with CASCADE_FULL_GRAPHS=0 (the per-layer graphs)
#   kernels            tests/gpu/test_kernels.py, test_kernels_split.py, test_graphs.py,
#                      test_staging.py, test_merge_empty_levels.py, test_kernels_sinks.py:
#                      executors vs flat attention and an fp32 reference; graphed decode
#                      steps; mixed steps split; attention sinks (gpt-oss) in every executor;
#                      the graph pools; uploads staged through the pinned ring; every merge on
#                      levels that saw no key (FlashInfer 0.7's -inf rows); the serving
#                      benchmark's step-timeline probe on real CUDA events (test_step_timeline_probe.py)
#   serving            tests/gpu/test_serving.py: the engine as `vllm serve` runs it, a batch
#                      that changes every step (graphs replay, outputs agree)
#   fp8                tests/gpu/test_kernels_fp8.py and the FP8 engine tests (CASCADE_FP8_KV=1)
#   speculative        ngram speculative decoding, plugin on vs off (V1 runner)
#   sliding            tests/gpu/test_sliding_window_engine.py: sliding-window layers run flat;
#                      under the hybrid KV cache the full layers' group runs cascade: a
#                      Mistral-style oracle, Gemma 3's stack, gpt-oss's attention with sinks
#                      (CASCADE_UNVERIFIED=1; a dense stand-in: vLLM's gpt-oss layers with a
#                      dense MLP, no fused-MoE kernels needed)
#   hybrid             tests/gpu/test_hybrid_engine.py: a Mamba2 / attention hybrid (Granite
#                      4.0-H's dense stack, 256-token pages): under CASCADE_UNVERIFIED=1 the
#                      attention layers' group runs cascade beside the Mamba state (V1 and V2),
#                      flat without it; one wrong page must fail
#   soak               tests/gpu/test_soak.py: benchmarks/soak/bench.py shortened to SOAK_SECONDS
# then alone (they take most of the GPU, or time what they run):
#   serving_memory     tests/gpu/test_serving.py at gpu_memory_utilization=0.92
#   demo               `vllm-cascade demo` (Llama-3-8B shapes: plugin off, on, off on FLASH_ATTN)
#   examples           the three examples as a user runs them (llama-tiny: they check that it
#                      runs; their speed is the demo's and the benchmarks' business)
# Each part's outcome becomes a row of gpu_validate.json (scripts/gpu_validate_rows.py): the
# parts a run did not run keep their rows of benchmarks/results/gpu/gpu_validate.json, so a run
# of some parts (GV_SIDE_BY_SIDE, GV_ALONE: the lists to run) completes the committed table.
# Logs and result JSON go to /tmp/gv/<part>/: benchmarks/results/gpu/gpu_validate/<part>/.
# Other parts, each alone: e2e, e2e_fa (offline end-to-end tables), split_bench (a mixed
# prefill+decode step's attention split vs flat: benchmarks/kernels/split_step.py), serve (the serving
# benchmark once, SERVE_ARGS its arguments), serve_grid (the serving grid: each backend's
# plugin against the same backend flat, `vllm serve` driven by `vllm bench serve`;
# SERVE_DURATION seconds of Poisson arrivals per run; SERVE_GRID names the slices to run, each
# one session's device time at most), tp (tensor parallelism: two GPUs).
set -uo pipefail
cd "$(dirname "$0")/.."
res=${CASCADE_GV_DIR:-/tmp/gv}
export CASCADE_GV_DIR=$res CASCADE_ENGINE_CACHE=$res/engines CASCADE_MODEL_CACHE=$res/models
export CASCADE_ENGINE_SLOTS=${CASCADE_ENGINE_SLOTS:-12}
mkdir -p "$res"
# Pure-Python wheels the device bundle lacks (e.g. truststore, which the OpenAI client's HTTP
# stack imports): put in .devb/wheels/, they are imported from the wheel files directly.
for w in .devb/wheels/*.whl; do [ -f "$w" ] && export PYTHONPATH="$PWD/$w${PYTHONPATH:+:$PYTHONPATH}"; done
# CUPTI for the torch profiler's GPU events (serve/bench.py --profile): the device's CUDA
# toolkit has it (/usr/local/cuda-13.0/.../libcupti.so.13), torch's wheel does not bring it.
for d in /usr/local/cuda*/targets/x86_64-linux/lib; do
  [ -e "$d/libcupti.so.13" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && break
done
SIDE_BY_SIDE=${GV_SIDE_BY_SIDE-"engine_flash_attn engine_flashinfer engine_graphs kernels serving fp8 speculative sliding hybrid soak"}
ALONE=${GV_ALONE-"serving_memory demo examples"}
ORDER="engine_flash_attn engine_flashinfer engine_graphs kernels serving serving_memory fp8 speculative sliding hybrid soak demo examples"
SOAK_SECONDS=${SOAK_SECONDS:-90}
E2E_WORKLOADS=b128_16k_prefix_64_own,8_prefixes_8k_x16_interleaved,n16_sampling_32_prompts_4k,no_sharing_256_random_2k
stamp() { echo "[gpu_validate $(date +%T)] $*"; }
row() { python3 scripts/gpu_validate_rows.py row "$@"; }

pytest_part() {  # name, time limit (s), pytest args...
  local name=$1 limit=$2 rc start=$SECONDS
  shift 2
  mkdir -p "$res/$name"
  stamp "$name: started"
  CASCADE_RESULTS_DIR="$res/$name" timeout -k 20 "$limit" python3 -m pytest -q \
    -p no:cacheprovider -p no:benchmark --tb=short --durations=15 --junitxml="$res/$name/junit.xml" "$@" \
    > "$res/$name/pytest.log" 2>&1
  rc=$?
  python3 scripts/gpu_validate_rows.py join "$res/$name" > /dev/null
  row "$name" $((SECONDS - start)) --junit "$res/$name/junit.xml" --rc "$rc"
  stamp "$name: exit status $rc"; tail -3 "$res/$name/pytest.log"
}

part_engine_flash_attn() {
  pytest_part engine_flash_attn 900 -n 4 tests/gpu/test_flash_attn_engine.py -k "not ngram"
}
part_engine_flashinfer() {
  pytest_part engine_flashinfer 900 -n 4 tests/gpu/test_engine.py \
    -k "cascade_engine_matches or corrupted or one_page"
}
part_engine() { part_engine_flashinfer; }
part_engine_graphs() { pytest_part engine_graphs 900 -n 2 tests/gpu/test_engine.py -k layer_graphs; }
part_kernels() {
  pytest_part kernels 600 -n 4 tests/gpu/test_graphs.py tests/gpu/test_kernels.py \
    tests/gpu/test_kernels_split.py tests/gpu/test_staging.py tests/gpu/test_merge_empty_levels.py \
    tests/gpu/test_kernels_sinks.py tests/gpu/test_step_timeline_probe.py \
    -k "graphs or fa3 or fp32_reference or graphed or corrupted or staging or split or empty or sink or probe"
}
part_serving() { pytest_part serving 720 tests/gpu/test_serving.py -k changing_batch; }
part_serving_memory() { pytest_part serving_memory 420 tests/gpu/test_serving.py -k 0_92; }
# FP8 KV cache (CASCADE_FP8_KV=1): kernels against the fp32 reference on the dequantised cache
# (flat FP8 FA3 the yardstick), engines with --kv-cache-dtype fp8 on both backends.
part_fp8() {
  pytest_part fp8 900 -n 4 tests/gpu/test_kernels_fp8.py tests/gpu/test_engine.py -k fp8
}
part_speculative() {
  pytest_part speculative 900 tests/gpu/test_flash_attn_engine.py -k ngram
}
part_sliding() { pytest_part sliding 900 -n 2 tests/gpu/test_sliding_window_engine.py; }
part_hybrid() { pytest_part hybrid 900 -n 2 tests/gpu/test_hybrid_engine.py; }
part_soak() {
  CASCADE_SOAK_SECONDS=$SOAK_SECONDS CASCADE_SOAK_REQUESTS=$(( SOAK_SECONDS * 4 )) \
    pytest_part soak $(( 2 * SOAK_SECONDS + 600 )) tests/gpu/test_soak.py
}
part_tp() { pytest_part tp 900 tests/gpu/test_engine.py -k tensor_parallel; }

part_demo() {
  local start=$SECONDS rc
  mkdir -p "$res/demo"
  stamp "demo: started"
  # Three engines: ~200 s after the other parts, over 420 s alone on a fresh machine (the first
  # engine compiles for 200-300 s).
  CASCADE_ATTENTION=1 timeout -k 20 600 python3 -m vllm_cascade_plugin.face.cli demo \
    > "$res/demo/demo.txt" 2>&1
  rc=$?
  row demo $((SECONDS - start)) --checks $((rc == 0)) $((rc != 0)) --rc "$rc"
  stamp "demo: exit status $rc"; tail -4 "$res/demo/demo.txt"
}

part_examples() {  # each example as its docstring says to run it, on the tiny model
  local start=$SECONDS passed=0 failed=0 rc tiny=examples/models/llama-tiny
  mkdir -p "$res/examples"
  stamp "examples: started"
  for ex in "examples/offline_shared_prompt.py --model $tiny --system-tokens 2048" \
            "examples/grpo_rollouts.py --model $tiny"; do
    echo "## python3 $ex"
    # shellcheck disable=SC2086  # the example's arguments
    CASCADE_ATTENTION=1 timeout -k 20 300 python3 $ex 2>&1 | grep -v '^INFO \|^WARNING \| INFO \| WARNING '
    rc=${PIPESTATUS[0]}
    echo "## exit status $rc"
    if [ "$rc" -eq 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
  done >> "$res/examples/examples.txt"
  {
    echo "## MODEL=$tiny bash examples/serve/serve.sh"
    MODEL=$tiny WORK=/tmp/gv-serve VLLM="python3 -m vllm.entrypoints.cli.main" \
      timeout -k 20 400 bash examples/serve/serve.sh 2>&1
    rc=$?
    echo "## exit status $rc"
    cp /tmp/gv-serve/server.log "$res/examples/serve-server.log" 2>/dev/null
  } >> "$res/examples/examples.txt"
  if [ "$rc" -eq 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
  row examples $((SECONDS - start)) --checks "$passed" "$failed"
  stamp "examples: $passed passed, $failed failed"
}

part_split_bench() {  # a mixed step's attention run split vs flat, all layers (cost model)
  mkdir -p "$res/split_bench"
  timeout 400 python3 -m benchmarks.kernels.split_step --out "$res/split_bench/split_step.json" \
    > "$res/split_bench/split_bench.log" 2>&1
  stamp "split_bench rc=$?"; tail -3 "$res/split_bench/split_bench.log" | cut -c1-200
}

part_e2e() {
  mkdir -p "$res/e2e"
  timeout 560 python3 -m benchmarks.e2e.bench --out "$res/e2e" --configs \
    flash_attn,flashinfer,cascade --workloads $E2E_WORKLOADS > "$res/e2e/e2e.log" 2>&1
  stamp "e2e rc=$?"; grep -h '"workload"' "$res/e2e/e2e.log" | cut -c1-140
}

part_e2e_fa() {
  mkdir -p "$res/e2e_fa"
  timeout 560 python3 -m benchmarks.e2e.bench --out "$res/e2e_fa" --configs \
    flash_attn,cascade_flash_attn --workloads $E2E_WORKLOADS > "$res/e2e_fa/e2e.log" 2>&1
  stamp "e2e_fa rc=$?"; grep -h '"workload"' "$res/e2e_fa/e2e.log" | cut -c1-140
}

# One serving benchmark, SERVE_ARGS its arguments (default: the FlashInfer pair on 8K x 4). A
# server start takes ~3.5 min on a fresh machine: run it detached.
part_serve() {
  mkdir -p "$res/serve"
  # shellcheck disable=SC2086  # SERVE_ARGS: several arguments
  timeout 1500 python3 -m benchmarks.serve.bench --model examples/models/llama3-8b \
    ${SERVE_ARGS:---workloads prefix_8k_x4 --configs flashinfer,cascade --duration 30 --plot} \
    --out "$res/serve/serve.json" > "$res/serve/serve.log" 2>&1
  stamp "serve rc=$?"; tail -20 "$res/serve/serve.log"
}

# The serving grid, part serve_grid: its slices in scripts/serve_grid.sh (SERVE_GRID names them).
# shellcheck source=scripts/serve_grid.sh
source scripts/serve_grid.sh

part_all() {
  local p
  for p in $SIDE_BY_SIDE; do "part_$p" & sleep 2; done
  wait
  for p in $ALONE; do "part_$p"; done
  python3 scripts/gpu_validate_rows.py table "$res/gpu_validate.json" $ORDER \
    --previous benchmarks/results/gpu/gpu_validate.json
}

restore_caches() {  # compiled kernels and graphs from an earlier machine (.devb/*-cache.tar.xz)
  [ -f .devb/vllm-compile-cache.tar.xz ] && [ ! -d "$HOME/.cache/vllm/torch_compile_cache" ] &&
    mkdir -p "$HOME/.cache" && xz -dc .devb/vllm-compile-cache.tar.xz | tar -C "$HOME" -xf -
  return 0
}

save_caches() {  # for the next fresh machine: .devb/ (see ../shared/device/README.md)
  mkdir -p "$res/caches"
  tar -C "$HOME" -cf - .cache/flashinfer 2>/dev/null | xz -T0 -6 > "$res/caches/fi-jit-cache.tar.xz"
  tar -C "$HOME" -cf - .triton/cache 2>/dev/null | xz -T0 -6 > "$res/caches/triton-cache.tar.xz"
  tar -C "$HOME" -cf - .cache/vllm 2>/dev/null | xz -T0 -6 > "$res/caches/vllm-compile-cache.tar.xz"
  du -sh "$HOME/.cache/flashinfer" "$HOME/.triton/cache" "$HOME/.cache/vllm" \
    /tmp/torchinductor_* "$res/caches"/* 2>/dev/null
}

pack() {  # what has finished, into $OUT
  [ -n "${OUT:-}" ] || return 0
  # The serve bench's client logs so far, under client-logs/<run>/ (every pack: a machine given
  # back mid-run keeps them): they say why a request failed, the server logs only that one did.
  local d
  for d in /tmp/vllm-cascade-serve-bench/*/client-logs; do
    [ -d "$d" ] && mkdir -p "$res/client-logs" &&
      cp -r "$d/." "$res/client-logs/$(basename "$(dirname "$d")")/" 2>/dev/null
  done
  python3 scripts/gpu_validate_rows.py table "$res/gpu_validate.json" $ORDER \
    --previous benchmarks/results/gpu/gpu_validate.json > /dev/null
  tar -C "$res" -cJf "$OUT/gv.tar.xz" --exclude=./engines --exclude=./models --exclude=./caches \
    --exclude='*.safetensors' --exclude='*.bin' .
  [ -e "$res/done" ] && cp "$res"/caches/*.tar.xz "$OUT"/ 2>/dev/null
  ls -la "$OUT"
}

running() {  # whether the detached run started on this machine is still alive
  local pid
  pid=$(cat "$res/pipeline.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null
}

wait_parts() {  # until the detached run is done or $1 seconds have passed; packs every 30 s
  local deadline=$((SECONDS + ${1:-540})) packed=$SECONDS
  while [ $SECONDS -lt $deadline ] && [ ! -e "$res/done" ]; do
    if ! running; then
      stamp "the detached run ended without finishing (see $res/pipeline.log)"
      break
    fi
    sleep 5
    if [ $((SECONDS - packed)) -ge 30 ]; then pack > /dev/null; packed=$SECONDS; fi
  done
  grep -h "gpu_validate\|\"part\"" "$res/parts.log" 2>/dev/null | tail -40
}

PARTS="all engine engine_flash_attn engine_flashinfer engine_graphs kernels serving serving_memory fp8 speculative sliding hybrid soak demo examples tp e2e e2e_fa split_bench serve serve_grid"
case ${1:?"a part ($PARTS), start PARTS..., or wait [SECONDS]"} in
start)
  shift
  rm -f "$res/done" "$res/pipeline.pid"
  restore_caches
  setsid nohup bash "$0" run "$@" < /dev/null > "$res/pipeline.log" 2>&1 &
  for _ in 1 2 3 4 5 6 7 8 9 10; do [ -e "$res/pipeline.pid" ] && break; sleep 0.5; done
  stamp "started: $*"
  wait_parts "${GV_WAIT:-520}"
  ;;
run)  # the detached list (`start`)
  shift
  echo $$ > "$res/pipeline.pid"
  for p in "$@"; do "part_$p"; done >> "$res/parts.log" 2>&1
  save_caches >> "$res/parts.log" 2>&1
  touch "$res/done"
  exit 0
  ;;
wait)
  # A machine left idle (about 30 s between commands) is given back, and the next command gets
  # a fresh one without the run: say so at once instead of waiting out the seconds.
  if [ ! -e "$res/pipeline.pid" ]; then
    echo "gpu_validate: no run was started on this machine (a fresh machine: the one that ran" \
      "'start' was given back, and its run with it); nothing to wait for: 'start' again" >&2
    exit 3
  fi
  wait_parts "${2:-540}"
  ;;
*)
  [[ " $PARTS " == *" $1 "* ]] || { echo "unknown part $1" >&2; exit 2; }
  restore_caches
  "part_$1"
  ;;
esac
pack
