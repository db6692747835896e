# The serving grid of scripts/gpu_validate.sh (its part serve_grid), sourced by it: each slice
# is one `python3 -m benchmarks.serve.bench` invocation, run from the repository's root with
# gpu_validate.sh's environment ($res, stamp).
# The serving grid in slices that each fit one session's 30 minutes of device time (a server
# start is ~1.5 min once compiled, ~4 min on a fresh machine; a run ~1 min): SERVE_GRID names
# them, run in its order. Slices serve Llama-3-8B's shapes (examples/models/llama3-8b) unless
# they name a --model of their own (after serve_slice's, so theirs wins; rows name the model).
#   flash_attn_shared  vLLM's default backend: shared documents at two loads (90% twice: the
#                      spread) and a burst; a chat service. About 22 min (measured: 8K x 4
#                      took 9.5 min on a fresh machine's first server, 5.7 on the next; the chat
#                      pair 7.3 min for both servers).
#   flash_attn_long    vLLM's default backend: one long document, many short ones, no sharing.
#   flashinfer         the FlashInfer pair: shared documents and chat.
#   flashinfer_burst   the FlashInfer pair on shared documents only: a burst and 90% (about
#                      7 min after the verification parts on the same machine).
#   host_delay         vLLM's default backend flat, the plugin, and the plugin with 1 and 4 ms
#                      of host time added to each step's planning, on 8K x 4 at 90% (rates
#                      from the committed flat burst): how much host time a step hides.
#   api_servers        vLLM's default backend flat and the plugin, each with 4 API server
#                      processes (--api-server-count 4: prompts tokenized in parallel), on an
#                      8K x 4 burst: the burst without the single frontend's queue.
#   flash_attn_moderate vLLM's default backend flat and the plugin at 90% of flat's burst rate
#                      on the sharing workloads whose decode batches sit near the cost model's
#                      break-even (2K x 16, chat, 8K x 4); rates from the committed flat bursts.
#                      About 9 min on a fresh machine.
#   flash_attn_policy  vLLM's default backend flat, the plugin, and the plugin with cascade on
#                      every step that shares (CASCADE_POLICY=always), at the loads where the
#                      cost model keeps most decode steps flat; rates from the committed flat
#                      bursts (the slices start from benchmarks/results/gpu/serve.json).
#   split              vLLM's default backend flat, the plugin with every mixed prefill+decode
#                      step flat (cascade_flash_attn_split_off: without the split) and with
#                      every one split where its decode rows' kernels win (_split_free), on
#                      8K x 4 and 2K x 16 at 90%; rates from the committed flat bursts.
#   split_gated        vLLM's default backend flat, the plugin (mixed steps flat) and the
#                      plugin with them split (CASCADE_SPLIT_MIXED=1: where the cost model, its
#                      host term included, says so and the layout came before), on 8K x 4 in
#                      a burst and at 90%: whether splitting helps a burst's mixed steps.
#                      About 10 min after the verification parts on the same machine.
#   pow2_graphs        vLLM's default backend flat and the plugin, both with vLLM's CUDA-graph
#                      capture sizes in powers of two (fewer whole-step graphs for the plugin
#                      to capture while a burst's batch grows), on 8K x 4 in a burst and at
#                      90% of that flat burst's rate.
#   host_delay_2k      vLLM's default backend flat, the plugin, and the plugin with 1 ms of host
#                      time added to each step's planning, on 2K x 16 at 90% (its decode
#                      batches are the largest of the grid's, ~140 rows): whether host time
#                      per step sets the pace there. About 9 min on a fresh machine.
#   burst_pair         vLLM's default backend flat and the plugin on 8K x 4 and 32K x 1 bursts:
#                      the bursts' output and TTFT side by side with the defaults.
#   mixed_bursts       vLLM's default backend flat and the plugin two ways on the mixed
#                      prefill+decode steps of 32K x 1 and 8K x 4 bursts: planned whole as one
#                      cascade step (the default) and flat (cascade_flash_attn_split_off).
#                      About 12 min after the verification parts (15 min) on the same machine.
#   chat_burst         vLLM's default backend flat and the plugin on a burst of the chat workload
#                      (one 1.5K-token system prompt, long own turns): whether a burst of short
#                      shared prefixes costs the plugin output or TPOT.
#   chat               vLLM's default backend flat and the plugin on the chat workload, a burst
#                      and 90% of that flat burst's rate: the chat pair in one run, each flat
#                      step's reason (a single request apart from no shared level). About 7 min
#                      on a fresh machine.
#   capture_bursts     vLLM's default backend flat, the plugin capturing each CUDA graph the
#                      second time its key comes (cascade_flash_attn_capture_second) and the
#                      plugin (the first time), in that order, on 8K x 4 and 32K x 1 bursts:
#                      whether a burst's one-use layouts are cheaper run eagerly than captured.
#                      About 12 min (as mixed_bursts).
#   policy_moderate    vLLM's default backend flat, the plugin, and the plugin with cascade on
#                      every step that shares (CASCADE_POLICY=always), on 2K x 16 and chat at
#                      90% (rates from the committed flat bursts): what the decode steps the
#                      cost model keeps flat would cost as cascade. About 14 min on a fresh
#                      machine.
#   flashinfer_chat    the FlashInfer pair on chat at 90% (rates from the committed flat
#                      burst): the chat point's TTFT p99 again.
#   chat_capacity      vLLM's default backend flat and the plugin on prefill-heavy chat at
#                      50%, 90% and 110% of flat's burst rate, then 110% once more under vLLM's
#                      torch profiler (serve_profile/: the GPU's idle gaps, the host's waits).
#   never_slower       vLLM's default backend flat and the plugin, each server with the
#                      step-timeline probe (the GPU's wait for the host per step): prefill-heavy
#                      chat at 50% (twice), 90% and 110% and two bursts; no sharing; a long
#                      shared document at 50% and a burst. About 14 min on a fresh machine.
#   never_slower_chat  the same on prefill-heavy chat only, once per load (about 9 min on a
#                      fresh machine at SERVE_DURATION=15).
#   never_slower_paired  prefill-heavy chat (a burst, 50%, 90%, 110%) on three servers with the
#                      step-timeline probe: flat, the plugin, then a second flat one
#                      (flash_attn_again: how far two identical servers are apart in this run);
#                      the plugin is judged against that spread. About 13 min on a fresh
#                      machine; a run cut short keeps the plugin's pair.
#   fp8_kv             the plugin on an FP8 KV cache (--kv-cache-dtype fp8, CASCADE_FP8_KV=1)
#                      against flat on the same cache (flash_attn_fp8), 8K x 4 in a burst, at
#                      50% and 90% of that flat server's burst rate. About 9 min on a fresh
#                      machine.
#   hybrid_gemma3      Gemma 3 12B's text stack (examples/models/gemma3-12b: 40 sliding-window
#                      layers of 1,024 tokens, 8 full-attention ones, head_dim 256) flat and
#                      the plugin (its defaults: the full layers' KV-cache group as cascade) on
#                      chat_6k_system (one 6K-token system prompt) in a burst, at 50% and 90%:
#                      the served pair of a sliding-window family, each server with the
#                      step-timeline probe (GPU ms per step of cascade and flat steps apart).
#                      Expected TPOT ratios: benchmarks/results/cpu/served_expected.json. About
#                      7 min on a fresh machine (a new model: its first server compiles).
#   hybrid_gemma3_policy  the same model flat, the plugin, and the plugin with cascade on every
#                      step that shares (CASCADE_POLICY=always) at 50% and 90% (rates from the
#                      committed Gemma 3 flat burst): what the decode steps the cost model keeps
#                      flat would cost as cascade, with per-layer graphs (a hybrid engine has
#                      no whole-step graphs). About 9 min on a fresh machine.
#   hybrid_gpt_oss     the same pair on gpt-oss-20b's attention stack with a dense MLP
#                      (examples/models/gpt-oss-20b-dense: 12 sliding-window layers of 128
#                      tokens and 12 full-attention ones, all with sinks, head_dim 64; the MLP
#                      reads what gpt-oss-20b's experts read at a serving batch), the plugin
#                      with CASCADE_UNVERIFIED=1 (sinks), each server with the step-timeline
#                      probe. About 8 min on a fresh machine (a new model: its first server
#                      compiles).
#   hybrid_gpt_oss_paired  whether the plugin's servers of that stack are slower than flat
#                      where few steps run cascade: flat, the plugin (CASCADE_UNVERIFIED=1),
#                      flat again (flash_attn_again: the run's own spread) in a burst and at
#                      50%, each with the step-timeline probe (its host times tell a long
#                      preparation, a late start and a step the host launches slower than the
#                      GPU runs it apart; its decode steps by batch size compare the plugin's
#                      flat and cascade steps with flat's at equal batches). About 11 min on a
#                      fresh machine.
#   hybrid_bamba       the same pair on a Mamba2 hybrid without MoE (examples/models/bamba-9b:
#                      Bamba-9B's shapes as vLLM's GraniteMoeHybridForCausalLM, 29 Mamba2
#                      layers and 3 full-attention ones, 768-token pages). About 12 min on a
#                      fresh machine (Mamba's Triton kernels compile in the first server).
#   hybrid_bamba_paired  why the plugin was slower on that model even where no step ran cascade:
#                      chat_6k_system in a burst and at 50% of flat's burst rate in this run
#                      (a rate from another machine's run can be near this one's capacity) on
#                      four servers, in this order: flat, the plugin as shipped
#                      (cascade_flash_attn: the several-groups fallback, then no step planned),
#                      the plugin with CASCADE_UNVERIFIED=1, flat again (flash_attn_again: two
#                      identical servers around the plugin's, the run's drift). About 13 min
#                      on a fresh machine.
#   never_slower_flashinfer_paired  never_slower_paired on the FLASHINFER backend: flat
#                      FlashInfer, the plugin (cascade), flat FlashInfer again
#                      (flashinfer_again). About 13 min on a fresh machine.
#   never_slower_flashinfer_half_paired  the same three servers in a burst (this run's
#                      capacity) and at 50% only: a repeat of the point that load decides.
#                      About 8 min on a fresh machine.
#   never_slower_flashinfer_plugin_first  whether the plugin's server is slower at 50% for
#                      being the plugin's or for running second: the same three servers at
#                      50% of the FlashInfer flat burst on record, the plugin's first
#                      (--servers-as-listed). About 6 min on a warm machine.
#   hybrid_gpt_oss_plugin_first  the same on gpt-oss's stack (hybrid_gpt_oss_paired's
#                      servers at 50% of its flat burst on record, the plugin's first). About
#                      6 min on a warm machine.
#   no_sharing_pair    vLLM's default backend flat and the plugin on random_2k (every prompt
#                      its own) in a burst and at 50%: the plugin's host time per step where
#                      nothing is shared, from its own counters. About 5 min on a warm machine.
#   flashinfer_flat_burst, hybrid_gpt_oss_flat_burst  the flat server's burst alone
#                      (chat_1k_prefill_heavy on FLASHINFER; chat_6k_system on gpt-oss's stack):
#                      this machine's capacity, from which a plugin-first slice after it in the
#                      same SERVE_GRID takes its 50% (the latest flat burst on record is the
#                      one relative rates come from). About 3 min on a fresh machine.
#   docs_and_no_sharing_paired  8K x 4 and random_2k (every prompt its own), each in a
#                      burst, at 50% and 90%, on three servers with the step-timeline probe:
#                      flat, the plugin, flat again. The long-shared-prefix figures and the
#                      no-sharing ones with the run's own spread, and the GPU ms per step of
#                      the plugin's steps by kind. About 12 min on a fresh machine.
#   shared_docs_pair   vLLM's default backend flat and the plugin on 8K x 4 (four 8K-token
#                      documents, many questions each) in a burst, at 50% and 90% of this run's
#                      flat burst rate: the long-shared-prefix figures. About 6 min on a warm
#                      machine.
#   hybrid_bamba_graphs  what a step without vLLM's FULL graphs costs that model, as every
#                      cascade step runs (its 29 Mamba mixers are splitting ops, so eager
#                      then): flat against flat with piecewise graphs only
#                      (flash_attn_piecewise), chat_6k_system in a burst and at 50%. About 6
#                      min on a fresh machine.
serve_slice() {  # name, timeout (s), serve/bench.py arguments...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  # The committed rows: a slice without a flat burst takes its rates from them.
  [ -f "$res/serve_grid/serve.json" ] || cp benchmarks/results/gpu/serve.json \
    benchmarks/results/gpu/serve.meta.json "$res/serve_grid/"  # the runs' provenance too
  timeout "$limit" python3 -m benchmarks.serve.bench --model examples/models/llama3-8b \
    --duration "${SERVE_DURATION:-20}" --out "$res/serve_grid/serve.json" "$@" \
    > "$res/serve_grid/$name.log" 2>&1
  local rc=$?
  # Each point's plugin against flat, and flat again's spread where the slice has it.
  python3 -m benchmarks.serve.verdict --file "$res/serve_grid/serve.json" --latest \
    >> "$res/serve_grid/$name.log" 2>&1
  stamp "serve_grid $name rc=$rc in $((SECONDS - start)) s"
}

part_serve_grid() {  # run it detached, alone; the slices in SERVE_GRID's order
  local slice
  mkdir -p "$res/serve_grid"
  for slice in ${SERVE_GRID:-flash_attn_shared}; do
    case $slice in
    flash_attn_shared) serve_slice flash_attn_shared 1500 \
      --configs flash_attn,cascade_flash_attn --workloads prefix_8k_x4,chat_1k5_system \
      --rates "prefix_8k_x4=burst,50%,90%*2;*=burst,90%" ;;
    flash_attn_long) serve_slice flash_attn_long 1500 \
      --configs flash_attn,cascade_flash_attn --workloads prefix_32k_x1,prefix_2k_x16,random_2k \
      --rates "burst,90%" ;;
    flashinfer) serve_slice flashinfer 1200 --configs flashinfer,cascade \
      --workloads prefix_8k_x4,chat_1k5_system --rates "burst,90%" --plot ;;
    flashinfer_burst) serve_slice flashinfer_burst 900 \
      --configs flashinfer,cascade --workloads prefix_8k_x4 --rates "burst,90%" ;;
    host_delay) serve_slice host_delay 1200 \
      --configs flash_attn,cascade_flash_attn,cascade_flash_attn_host_delay_1ms,cascade_flash_attn_host_delay_4ms \
      --workloads prefix_8k_x4 --rates 90% ;;
    api_servers) serve_slice api_servers 900 \
      --configs flash_attn_api_servers_4,cascade_flash_attn_api_servers_4 \
      --workloads prefix_8k_x4 --rates burst ;;
    flash_attn_moderate) serve_slice flash_attn_moderate 1200 \
      --configs flash_attn,cascade_flash_attn \
      --workloads prefix_2k_x16,chat_1k5_system,prefix_8k_x4 --rates 90% ;;
    flash_attn_policy) serve_slice flash_attn_policy 1500 \
      --configs flash_attn,cascade_flash_attn,cascade_flash_attn_always \
      --workloads prefix_8k_x4,chat_1k5_system --rates "prefix_8k_x4=50%,90%;*=90%" ;;
    split) serve_slice split 1200 \
      --configs flash_attn,cascade_flash_attn_split_off,cascade_flash_attn_split_free \
      --workloads prefix_8k_x4,prefix_2k_x16 --rates 90% ;;
    split_gated) serve_slice split_gated 1200 \
      --configs flash_attn,cascade_flash_attn,cascade_flash_attn_split_mixed \
      --workloads prefix_8k_x4 --rates burst,90% ;;
    pow2_graphs) serve_slice pow2_graphs 900 \
      --configs flash_attn_pow2_graphs,cascade_flash_attn_pow2_graphs \
      --workloads prefix_8k_x4 --rates burst,90% ;;
    host_delay_2k) serve_slice host_delay_2k 1200 \
      --configs flash_attn,cascade_flash_attn,cascade_flash_attn_host_delay_1ms \
      --workloads prefix_2k_x16 --rates 90% ;;
    burst_pair) serve_slice burst_pair 1200 --configs flash_attn,cascade_flash_attn \
      --workloads prefix_8k_x4,prefix_32k_x1 --rates burst ;;
    mixed_bursts) serve_slice mixed_bursts 1500 \
      --configs flash_attn,cascade_flash_attn,cascade_flash_attn_split_off \
      --workloads prefix_32k_x1,prefix_8k_x4 --rates burst ;;
    capture_bursts) serve_slice capture_bursts 1500 \
      --configs flash_attn,cascade_flash_attn_capture_second,cascade_flash_attn \
      --workloads prefix_8k_x4,prefix_32k_x1 --rates burst ;;
    chat_burst) serve_slice chat_burst 900 --configs flash_attn,cascade_flash_attn \
      --workloads chat_1k5_system --rates burst ;;
    chat) serve_slice chat 900 --configs flash_attn,cascade_flash_attn \
      --workloads chat_1k5_system --rates burst,90% ;;
    policy_moderate) serve_slice policy_moderate 1200 \
      --configs flash_attn,cascade_flash_attn,cascade_flash_attn_always \
      --workloads prefix_2k_x16,chat_1k5_system --rates 90% ;;
    flashinfer_chat) serve_slice flashinfer_chat 900 --configs flashinfer,cascade \
      --workloads chat_1k5_system --rates 90% ;;
    chat_capacity) serve_slice chat_capacity 1200 --configs flash_attn,cascade_flash_attn \
      --workloads chat_1k_prefill_heavy --rates burst,50%,90%,110% --profile 110% ;;
    never_slower_chat) serve_slice never_slower_chat 900 --configs flash_attn,cascade_flash_attn \
      --workloads chat_1k_prefill_heavy --step-timeline --rates burst,50%,90%,110% ;;
    never_slower_paired) serve_slice never_slower_paired 1200 \
      --configs flash_attn,cascade_flash_attn,flash_attn_again --workloads chat_1k_prefill_heavy \
      --step-timeline --rates burst,50%,90%,110% ;;
    never_slower) serve_slice never_slower 1500 --configs flash_attn,cascade_flash_attn \
      --workloads chat_1k_prefill_heavy,random_2k,prefix_8k_x4 --step-timeline \
      --rates "chat_1k_prefill_heavy=burst*2,50%*2,90%,110%;random_2k=burst,90%;prefix_8k_x4=burst,50%" ;;
    hybrid_gemma3) serve_slice hybrid_gemma3 1500 --model examples/models/gemma3-12b \
      --configs flash_attn,cascade_flash_attn --workloads chat_6k_system --step-timeline \
      --rates burst,50%,90% ;;
    hybrid_gemma3_policy) serve_slice hybrid_gemma3_policy 1200 \
      --model examples/models/gemma3-12b \
      --configs flash_attn,cascade_flash_attn,cascade_flash_attn_always \
      --workloads chat_6k_system --step-timeline --rates 50%,90% ;;
    hybrid_gpt_oss) serve_slice hybrid_gpt_oss 1500 --model examples/models/gpt-oss-20b-dense \
      --configs flash_attn,cascade_flash_attn_hybrid --workloads chat_6k_system \
      --step-timeline --rates burst,50%,90% ;;
    hybrid_gpt_oss_paired) serve_slice hybrid_gpt_oss_paired 1500 \
      --model examples/models/gpt-oss-20b-dense \
      --configs flash_attn,cascade_flash_attn_hybrid,flash_attn_again \
      --workloads chat_6k_system --step-timeline --rates burst,50% ;;
    hybrid_bamba) serve_slice hybrid_bamba 1500 --model examples/models/bamba-9b \
      --configs flash_attn,cascade_flash_attn_hybrid --workloads chat_6k_system \
      --rates burst,50%,90% ;;
    hybrid_bamba_paired) serve_slice hybrid_bamba_paired 1500 --model examples/models/bamba-9b \
      --configs flash_attn,cascade_flash_attn,cascade_flash_attn_hybrid,flash_attn_again \
      --workloads chat_6k_system --rates burst,50% ;;
    fp8_kv) serve_slice fp8_kv 1200 --configs flash_attn_fp8,cascade_flash_attn_fp8 \
      --workloads prefix_8k_x4 --rates burst,50%,90% ;;
    shared_docs_pair) serve_slice shared_docs_pair 900 --configs flash_attn,cascade_flash_attn \
      --workloads prefix_8k_x4 --rates burst,50%,90% ;;
    never_slower_flashinfer_paired) serve_slice never_slower_flashinfer_paired 1200 \
      --configs flashinfer,cascade,flashinfer_again --workloads chat_1k_prefill_heavy \
      --step-timeline --rates burst,50%,90%,110% ;;
    never_slower_flashinfer_half_paired) serve_slice never_slower_flashinfer_half_paired 900 \
      --configs flashinfer,cascade,flashinfer_again --workloads chat_1k_prefill_heavy \
      --step-timeline --rates burst,50% ;;
    never_slower_flashinfer_plugin_first) serve_slice never_slower_flashinfer_plugin_first 900 \
      --configs cascade,flashinfer,flashinfer_again --workloads chat_1k_prefill_heavy \
      --step-timeline --servers-as-listed --rates 50% ;;
    no_sharing_pair) serve_slice no_sharing_pair 900 --configs flash_attn,cascade_flash_attn \
      --workloads random_2k --step-timeline --rates burst,50% ;;
    flashinfer_flat_burst) serve_slice flashinfer_flat_burst 600 --configs flashinfer \
      --workloads chat_1k_prefill_heavy --step-timeline --rates burst ;;
    hybrid_gpt_oss_flat_burst) serve_slice hybrid_gpt_oss_flat_burst 600 \
      --model examples/models/gpt-oss-20b-dense --configs flash_attn \
      --workloads chat_6k_system --step-timeline --rates burst ;;
    hybrid_gpt_oss_plugin_first) serve_slice hybrid_gpt_oss_plugin_first 900 \
      --model examples/models/gpt-oss-20b-dense \
      --configs cascade_flash_attn_hybrid,flash_attn,flash_attn_again \
      --workloads chat_6k_system --step-timeline --servers-as-listed --rates 50% ;;
    docs_and_no_sharing_paired) serve_slice docs_and_no_sharing_paired 1500 \
      --configs flash_attn,cascade_flash_attn,flash_attn_again \
      --workloads prefix_8k_x4,random_2k --step-timeline --rates burst,50%,90% ;;
    hybrid_bamba_graphs) serve_slice hybrid_bamba_graphs 900 --model examples/models/bamba-9b \
      --configs flash_attn,flash_attn_piecewise --workloads chat_6k_system --rates burst,50% ;;
    *) stamp "serve_grid: no slice named $slice (see the list above part_serve_grid)"; return 1 ;;
    esac
  done
  return 0
}
