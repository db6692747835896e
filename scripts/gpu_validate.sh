#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/h200/, on the H200 device machine. Every device command
# starts with `source .devb/setup_device.sh` (carry .devb). One command may run 10 minutes, so a
# list of parts runs detached and later commands wait for it:
#
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh start kernels serving e2e
#   source .devb/setup_device.sh && bash scripts/gpu_validate.sh wait [SECONDS]   # repeat
#
# or one short part in the foreground: `bash scripts/gpu_validate.sh kernels`. Parts:
#   kernels  tests/gpu/test_kernels.py (FA3 executor, graphed decode steps) and test_graphs.py
#   engine   tests/gpu/test_engine.py: plugin on vs off (and FlashAttention off, the reference),
#            both runners, whole-step graphs; the corrupted plans (~8 engines)
#   engine_graphs  the same with CASCADE_FULL_GRAPHS=0 (per-layer graphs; ~6 engines)
#   sliding  tests/gpu/test_sliding_window_engine.py: a model of sliding-window and full layers,
#            plugin on vs off (FLASH_ATTN; TRITON_ATTN the reference), both KV-cache layouts (4 engines)
#   engine_fa  tests/gpu/test_flash_attn_engine.py: the same through vLLM's default FLASH_ATTN
#            backend, a no-sharing workload, a corrupted plan, ngram speculative decoding
#   serving  tests/gpu/test_serving.py: the engine as `vllm serve` runs it, a changing batch
#            (also with gpu_memory_utilization=0.92: the graphs fit beside the KV cache)
#   e2e      benchmarks/e2e_bench.py: the offline end-to-end table (e2e.json)
#   e2e_fa   the same workloads, flash_attn vs cascade_flash_attn (the plugin in FLASH_ATTN)
#   serve    benchmarks/serve_bench.py, 8K x 4 prefixes, flashinfer vs cascade (serve.json)
#   soak     benchmarks/soak.py
#   demo     `vllm-cascade demo` and the three examples as a user runs them (demo.txt, examples.txt)
#   tp       tensor_parallel_size=2 engine tests (needs the two-GPU machine)
#   fp8      tests/gpu/test_kernels_fp8.py and test_engine.py -k fp8_kv_cache (FP8 KV cache)
# Logs and JSON go to /tmp/gv/<part>/; each command ends by packing them into $OUT/gv.tar.xz
# (unpack into benchmarks/results/h200/ what belongs there).
set -uo pipefail
cd "$(dirname "$0")/.."
res=/tmp/gv
mkdir -p "$res"
stamp() { echo "[gpu_validate $(date +%T)] $*"; }
E2E_WORKLOADS=b128_16k_prefix_64_own,8_prefixes_8k_x16_interleaved,n16_sampling_32_prompts_4k,no_sharing_256_random_2k

pytest_part() {  # name, timeout, pytest args...
  local name=$1 limit=$2
  shift 2
  mkdir -p "$res/$name"
  CASCADE_RESULTS_DIR="$res/$name" timeout "$limit" python3 -m pytest -q -p no:cacheprovider \
    --tb=short "$@" > "$res/$name/pytest.log" 2>&1
  stamp "$name rc=$?"; tail -5 "$res/$name/pytest.log"
}

part_kernels() {
  pytest_part kernels 420 tests/gpu/test_graphs.py tests/gpu/test_kernels.py \
    -k "graphs or fa3 or fp32_reference or graphed or corrupted"
}

# Each engine run takes ~45 s: detached parts (`start engine engine_graphs`) get 15 minutes.
part_engine() {
  pytest_part engine 900 tests/gpu/test_engine.py -k "cascade_engine_matches or corrupted or one_page"
}
part_engine_graphs() { pytest_part engine_graphs 900 tests/gpu/test_engine.py -k layer_graphs; }
part_sliding() { pytest_part sliding 900 tests/gpu/test_sliding_window_engine.py; }
part_engine_fa() { pytest_part engine_fa 900 tests/gpu/test_flash_attn_engine.py; }
part_serving() { pytest_part serving 900 tests/gpu/test_serving.py; }
part_tp() { pytest_part tp 900 tests/gpu/test_engine.py -k tensor_parallel; }
# FP8 KV cache (CASCADE_FP8_KV=1): kernels against vLLM's flat FP8 FA3 / FlashInfer and fp32 on
# the dequantised cache; engines with --kv-cache-dtype fp8, both backends (~6 engines).
part_fp8() {
  pytest_part fp8_kernels 420 tests/gpu/test_kernels_fp8.py
  pytest_part fp8_engine 900 tests/gpu/test_engine.py -k fp8_kv_cache
}

part_e2e() {
  mkdir -p "$res/e2e"
  timeout 560 python3 benchmarks/e2e_bench.py --out "$res/e2e" --configs \
    flash_attn,flashinfer,cascade --workloads $E2E_WORKLOADS > "$res/e2e/e2e.log" 2>&1
  stamp "e2e rc=$?"; grep -h '"workload"' "$res/e2e/e2e.log" | cut -c1-140
}

part_e2e_fa() {
  mkdir -p "$res/e2e_fa"
  timeout 560 python3 benchmarks/e2e_bench.py --out "$res/e2e_fa" --configs \
    flash_attn,cascade_flash_attn --workloads $E2E_WORKLOADS > "$res/e2e_fa/e2e.log" 2>&1
  stamp "e2e_fa rc=$?"; grep -h '"workload"' "$res/e2e_fa/e2e.log" | cut -c1-140
}

part_serve() {  # a server start takes ~3.5 min: run it detached (`start serve`)
  mkdir -p "$res/serve"
  timeout 1500 python3 benchmarks/serve_bench.py --model examples/models/llama3-8b \
    --workloads prefix_8k_x4 --configs flashinfer,cascade --duration 30 \
    --out "$res/serve/serve.json" --plot > "$res/serve/serve.log" 2>&1
  stamp "serve rc=$?"; tail -20 "$res/serve/serve.log"
}

part_demo() {
  mkdir -p "$res/demo"
  (CASCADE_ATTENTION=1 timeout 400 python3 -m vllm_cascade_plugin.cli demo > "$res/demo/demo.txt" 2>&1; stamp "demo rc=$?"
   for ex in examples/offline_shared_prompt.py examples/grpo_rollouts.py; do
     echo "## python3 $ex"; CASCADE_ATTENTION=1 timeout 300 python3 "$ex" 2>&1 | grep -v ' INFO \| WARNING '
   done
   echo "## bash examples/serve/serve.sh"
   VLLM="python3 -m vllm.entrypoints.cli.main" timeout 400 bash examples/serve/serve.sh 2>&1
  ) > "$res/demo/examples.txt" 2>&1
  stamp "examples rc=$?"; tail -5 "$res/demo/demo.txt"
}

part_soak() {
  mkdir -p "$res/soak"
  timeout 1500 python3 benchmarks/soak.py --out "$res/soak" > "$res/soak/soak.log" 2>&1
  stamp "soak rc=$?"; tail -5 "$res/soak/soak.log"
}

pack() {
  tar -C "$res" -cJf "${OUT:-/tmp}/gv.tar.xz" --exclude='*.safetensors' --exclude='*.bin' .
  ls -la "${OUT:-/tmp}"
}

wait_parts() {  # until the detached list is done or $1 seconds have passed
  local deadline=$((SECONDS + ${1:-540}))
  while [ $SECONDS -lt $deadline ] && [ ! -e "$res/done" ]; do sleep 5; done
  tail -40 "$res/parts.log" 2>/dev/null
}

case ${1:?"a part (kernels, engine, engine_graphs, sliding, engine_fa, serving, e2e, e2e_fa, serve, soak, demo, tp, fp8), start PARTS..., or wait"} in
start)
  shift
  rm -f "$res/done"
  export -f stamp pytest_part pack "${@/#/part_}"
  export res E2E_WORKLOADS
  setsid nohup bash -c "for p in $*; do part_\$p; done > \"\$res/parts.log\" 2>&1; touch \"\$res/done\"" \
    < /dev/null > /dev/null 2>&1 &
  stamp "started: $*"
  wait_parts 520
  ;;
wait)
  wait_parts "${2:-540}"
  ;;
kernels|engine|engine_graphs|sliding|engine_fa|serving|e2e|e2e_fa|serve|soak|demo|tp|fp8)
  "part_$1"
  ;;
*)
  echo "unknown part $1" >&2
  exit 2
  ;;
esac
pack
