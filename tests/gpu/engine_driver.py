"""One vLLM engine, the correctness workloads, per-token logprobs out (run as a subprocess).

Usage: python engine_driver.py MODEL_DIR OUT_JSON [--workloads a,b,...] [--tp N]
    [--corrupt | --corrupt-one-page] [--backend FLASHINFER|FLASH_ATTN|TRITON_ATTN] [--ngram K]
    [--no-hybrid-kv-cache] [--kv-cache-dtype fp8] [--eager]

The plugin is on or off by the caller's ``CASCADE_ATTENTION``; the runner by
``VLLM_USE_V2_MODEL_RUNNER``; vLLM's attention backend by ``--backend`` (FLASH_ATTN with the
plugin off is the second correct kernel of the oracle's reference). A workload whose parameters
name a ``beam_width`` runs through ``LLM.beam_search`` and records its finished beams
(:func:`agreement.beam_record`); every other one records each request's completions
(:func:`agreement.record`). Workloads named ``x_...`` run only when asked for (``--workloads x_``).

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core and (TP=1) the worker in this
process, so ``--corrupt`` can shift every page id of every plan by one (the comparison must then
fail; ``--corrupt-one-page`` shifts one page of each shared prefix) and every call of the
plugin's per-step code (planner, executor plan and run) runs under
``torch.cuda.set_sync_debug_mode("error")``: a GPU->CPU synchronisation there is recorded in
``sync_violations``. The plugin's counters are read from the workers with ``collective_rpc``
(they live in the worker processes when ``--tp`` > 1). ``--ngram K``: vLLM's ``ngram``
speculative decoding with K draft tokens; the steps whose rows have 1 to 1 + K query tokens, some
more than one (verification steps), are counted, and how many ran cascade.
``--no-hybrid-kv-cache``: vLLM's ``disable_hybrid_kv_cache_manager`` (a model with sliding-window
and full layers then keeps one KV-cache group); TRITON_ATTN with the plugin off is the second
correct kernel where FlashInfer cannot run the model (sliding windows on SM90). ``--eager``:
vLLM's ``enforce_eager`` (no torch.compile, no CUDA graphs: vLLM's nor the plugin's).

The engine takes a fixed KV cache (``NUM_BLOCKS`` blocks, ``kv_cache_memory_bytes``) and asks
for a small share of the GPU, so several engines run side by side on one GPU
(``tests/gpu/engines.py``): vLLM then skips its memory profiling, which other processes'
allocations would disturb.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import threading

import numpy as np

from vllm_cascade_plugin.face import agreement

VOCAB = 32000
NUM_BLOCKS = 1536  # a small KV cache: workload (f) must be preempted
KV_CACHE_BYTES = 1 << 30  # at least NUM_BLOCKS blocks of the test models
GPU_SHARE = 0.05  # vLLM checks at start that this share of the GPU is free
SYNC_VIOLATIONS: list[str] = []


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(100, VOCAB - 100, size=n).tolist()


def workloads(seed: int = 0) -> dict[str, tuple[list[list[int]], dict]]:
    """name -> (prompts as token ids, SamplingParams keyword arguments)."""
    rng = np.random.default_rng(seed)
    greedy = {"temperature": 0.0, "max_tokens": 24, "logprobs": 2, "ignore_eos": True}
    w: dict[str, tuple[list[list[int]], dict]] = {}
    prefix = _tokens(rng, 8192)
    w["a_one_8k_prefix_x64"] = ([prefix + _tokens(rng, 16) for _ in range(64)], greedy)
    prefixes = [_tokens(rng, 2048) for _ in range(4)]
    w["b_4_prefixes_x16_interleaved"] = (
        [prefixes[i % 4] + _tokens(rng, 16) for i in range(64)], greedy)
    system, docs = _tokens(rng, 2048), [_tokens(rng, 4096) for _ in range(4)]
    w["c_tree_2k_system_4x4k_docs_x8"] = (
        [system + docs[d] + _tokens(rng, 16) for q in range(8) for d in range(4)], greedy)
    w["d_n8_sampling_16_prompts"] = (
        [_tokens(rng, 1024) for _ in range(16)],
        {**greedy, "n": 8, "temperature": 0.01, "seed": 1234})  # vLLM: n > 1 needs sampling
    shared = _tokens(rng, 1024)
    w["e_chunked_prefill_with_decodes"] = (
        [shared + _tokens(rng, 16) for _ in range(24)]
        + [_tokens(rng, int(rng.integers(3000, 6000))) for _ in range(6)],
        {**greedy, "max_tokens": 48})
    system = _tokens(rng, 512)
    w["f_preemption_small_kv_cache"] = (
        [system + _tokens(rng, int(rng.integers(800, 1600))) for _ in range(48)],
        {**greedy, "max_tokens": 96})
    # Drawn after the others, so that their prompts stay what they were.
    shared = _tokens(rng, 2048)
    w["g_beam_search_w4_2k_prefix_x8"] = (
        [shared + _tokens(rng, 16) for _ in range(8)],
        {"beam_width": 4, "max_tokens": 16, "ignore_eos": True})
    shared = _tokens(rng, 2048)
    w["h_n4_sampling_t08_2k_prefix_x8"] = (
        [shared + _tokens(rng, 16) for _ in range(8)],
        {**greedy, "n": 4, "temperature": 0.8, "seed": 7})
    # Not run by default. No two prompts share a page: every step must stay flat.
    w["x_no_sharing_32_random"] = ([_tokens(rng, 1024) for _ in range(32)], greedy)
    # A 2K prefix made of one 64-token phrase repeated, then 64 generated tokens: n-gram
    # lookup finds drafts in it (and in the repetitive text a random model generates).
    phrase = _tokens(rng, 64)
    w["x_ngram_repetitive_2k_prefix_x32"] = (
        [phrase * 32 + _tokens(rng, 16) for _ in range(32)], {**greedy, "max_tokens": 64})
    # For the sliding-window oracle (window 512): a cached 2K prefix, four windows long; for the
    # hybrid oracle (tests/oracle_hybrid.py), eight of its 256-token pages.
    shared = _tokens(rng, 2048)
    w["x_sliding_2k_prefix_x32"] = ([shared + _tokens(rng, 16) for _ in range(32)], greedy)
    return w


class _TokenIds:
    """What ``LLM.beam_search`` asks of a tokenizer (an EOS id, the largest token id, a decode),
    for an engine made
    with ``skip_tokenizer_init=True``: the test model has no tokenizer, its prompts are token
    ids. The engine's output processor took its tokenizer (none) at start; besides the beam
    search, vLLM's input checks read this one (prompt ids up to ``max_token_id``)."""

    bos_token_id, eos_token_id = 1, 2
    max_token_id = VOCAB - 1  # vLLM checks prompt ids against it

    def decode(self, ids, *args, **kwargs) -> str:
        return " ".join(map(str, ids))


def _beam_search(llm, prompts: list[list[int]], params: dict) -> list[dict]:
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    renderer = llm.renderer
    saved, renderer.tokenizer = renderer.tokenizer, _TokenIds()
    try:
        outputs = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                  BeamSearchParams(**params))
    finally:
        renderer.tokenizer = saved
    return [agreement.beam_record(o, len(p)) for o, p in zip(outputs, prompts, strict=True)]


def _next_block(ids: np.ndarray) -> np.ndarray:
    # Next block id, wrapping inside the cache (NUM_BLOCKS) so no kernel reads out of bounds.
    return ids % (NUM_BLOCKS - 1) + 1


def _one_page_shifted(level):
    """A shared level whose groups each read their middle page's neighbour instead."""
    ids, indptr = level.kv_page_indices.copy(), level.kv_page_indptr
    for start, end in itertools.pairwise(indptr):
        if end - start >= 2:
            middle = (start + end) // 2
            ids[middle:middle + 1] = _next_block(ids[middle:middle + 1])
    return dataclasses.replace(level, kv_page_indices=ids)


def _corrupt_planner(one_page: bool) -> None:
    """Every plan's page ids shifted by one (``one_page``: only the middle page of each shared
    prefix, the error the CPU test of the oracle model measures)."""
    from vllm_cascade_plugin.planning import planner

    real = planner.CascadePlanner.plan

    def shifted(self, *args, **kwargs):
        plan = real(self, *args, **kwargs)
        if one_page:
            levels = tuple(level if level.causal else _one_page_shifted(level)
                           for level in plan.levels)
        else:
            levels = tuple(dataclasses.replace(level, kv_page_indices=_next_block(
                level.kv_page_indices)) for level in plan.levels)
        return dataclasses.replace(plan, levels=levels)

    planner.CascadePlanner.plan = shifted


def _forbid_syncs() -> None:
    """Raise (and record) on any GPU->CPU synchronisation inside the plugin's per-step code.

    The debug mode is process-wide; with the engine in this process (TP=1, no multiprocessing)
    only this thread drives the GPU, so it catches nothing but our own calls. Catches what goes
    through torch's CUDA API (``.item()``, ``.cpu()``, blocking copies, stream syncs).
    """
    import torch

    from vllm_cascade_plugin import step
    from vllm_cascade_plugin.execution import kernels

    def guard(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            except RuntimeError as exc:
                if "synchroniz" in str(exc):
                    SYNC_VIOLATIONS.append(f"{fn.__qualname__}: {exc}")
                raise
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        return wrapper

    for owner, name in ((step.StepSession, "plan_step"),
                        (kernels.FlashInferCascadeExecutor, "plan"),
                        (kernels.FlashInferCascadeExecutor, "run"),
                        (kernels.FlashAttnCascadeExecutor, "plan"),
                        (kernels.FlashAttnCascadeExecutor, "run")):
        setattr(owner, name, guard(getattr(owner, name)))


VERIFICATION = {"steps": 0, "cascade": 0}


def _count_verification_steps(drafts: int) -> None:
    """Count the planned steps of speculative decoding's verification (every row 1 to
    1 + ``drafts`` query tokens, some more than one) and those that ran cascade."""
    from vllm_cascade_plugin import step

    real = step.StepSession.plan_step

    @functools.wraps(real)
    def counted(self, block_table, seq_lens, query_lens, *rest, **named):
        planned = real(self, block_table, seq_lens, query_lens, *rest, **named)
        if int(query_lens.max()) > 1 and int(query_lens.max()) <= 1 + drafts:
            VERIFICATION["steps"] += 1
            VERIFICATION["cascade"] += bool(planned is not None and planned.decision.use_cascade)
        return planned

    step.StepSession.plan_step = counted


def _worker_counters(worker) -> dict:
    """Runs in each worker (collective_rpc): the plugin's counters there, as plain data."""
    from vllm_cascade_plugin import stats

    counters = stats.snapshot()
    try:  # which executor ran the cascade steps (CASCADE_KERNEL); none before a cascade step
        from vllm_cascade_plugin.execution import kernels
        from vllm_cascade_plugin.graphs import fullgraph

        alive = list(kernels.EXECUTORS)
        # The FA3 executor's per-layer CUDA graphs and the whole-step graphs of decode steps.
        graphs = {**kernels.graph_stats(), **fullgraph.graph_stats()}
    except ImportError:
        alive, graphs = [], {}
    return {**stats.plain(counters),
            "executors": sorted({e.kernel for e in alive}),
            **{k: graphs.get(k, 0) for k in ("graph_captures", "graph_replays",
                                              "full_graph_captures", "full_graph_replays",
                                              "full_graphs_held", "full_graph_pool_bytes",
                                              "graph_pool_bytes", "graph_captures_skipped",
                                              "full_graph_captures_skipped")},
            "device_free_bytes": _free_bytes()}


def _free_bytes() -> int:
    """The GPU's free memory as this worker sees it (0 where it cannot be read)."""
    try:
        import torch

        return int(torch.cuda.mem_get_info()[0])
    except Exception:
        return 0


COUNTERS_TIMEOUT_S = 300.0  # reading the counters takes well under a second


def _counters(llm) -> dict:
    """The plugin's counters in the engine's worker. An answer that never comes (an engine
    client that died: its output handler stops, and vLLM's call waits for ever) ends this
    process with exit status 3 after COUNTERS_TIMEOUT_S, rather than a GPU run's time."""
    answer: list = []
    reader = threading.Thread(target=lambda: answer.append(llm.collective_rpc(_worker_counters)),
                              daemon=True)
    reader.start()
    reader.join(COUNTERS_TIMEOUT_S)
    if not answer:
        print(f"engine_driver: the plugin's counters did not come within {COUNTERS_TIMEOUT_S:g}"
              " s (the engine's log says why); giving up", file=sys.stderr, flush=True)
        os._exit(3)
    per_worker = answer[0]
    # Every tensor-parallel rank plans the same steps: rank 0 speaks for all, the others agree.
    assert all(c == per_worker[0] for c in per_worker), per_worker
    return per_worker[0]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--workloads", default="")
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument("--corrupt-one-page", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--backend", default="FLASHINFER",
                        choices=("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN"))
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype")
    parser.add_argument("--ngram", type=int, default=0, metavar="K",
                        help="ngram speculative decoding with K draft tokens")
    parser.add_argument("--no-hybrid-kv-cache", action="store_true",
                        help="disable_hybrid_kv_cache_manager=True")
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True")
    parser.add_argument("--num-blocks", type=int, default=NUM_BLOCKS,
                        help="num_gpu_blocks_override: KV-cache blocks (a model of many "
                             "sliding-window layers needs more for one max_model_len request)")
    args = parser.parse_args()
    if args.corrupt or args.corrupt_one_page:
        _corrupt_planner(one_page=args.corrupt_one_page)
    if args.ngram:
        _count_verification_steps(args.ngram)
    if args.tp == 1 and os.environ.get("CASCADE_ATTENTION"):
        _forbid_syncs()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tp_args = {}
    if args.tp > 1:
        # Plain NCCL all-reduce (NVLink multicast off, as the machine requires): vLLM 0.26's
        # all-reduce+RMSNorm fusion pass defaults to FlashInfer's "mnnvl" backend, which creates
        # NVLink multicast objects; it crashed the engine (illegal address) on the H200 pair.
        os.environ.setdefault("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "trtllm")
        tp_args = {"disable_custom_all_reduce": True,
                   "compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
    if args.no_hybrid_kv_cache:
        tp_args["disable_hybrid_kv_cache_manager"] = True
    if args.ngram:
        tp_args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram,
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM(model=args.model, skip_tokenizer_init=True, attention_backend=args.backend,
              enable_prefix_caching=True, max_model_len=9216, max_num_batched_tokens=2048,
              max_num_seqs=128, num_gpu_blocks_override=args.num_blocks,
              kv_cache_memory_bytes=KV_CACHE_BYTES, gpu_memory_utilization=GPU_SHARE,
              seed=0, enable_flashinfer_autotune=False, kv_cache_dtype=args.kv_cache_dtype,
              enforce_eager=args.eager, tensor_parallel_size=args.tp, **tp_args)
    chosen = [w for w in args.workloads.split(",") if w]
    results = {}
    for name, (prompts, params) in workloads().items():
        if not any(name.startswith(c) for c in chosen) and (chosen or name.startswith("x_")):
            continue
        before = _counters(llm)
        if "beam_width" in params:
            ran = {"beams": _beam_search(llm, prompts, params)}
        else:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                   SamplingParams(**params), use_tqdm=False)
            ran = {"requests": [agreement.record(o) for o in outputs]}
        after = _counters(llm)
        results[name] = {
            **ran,
            **{key: after[key] - before[key] for key in (
                "steps_planned", "steps_cascade", "decode_steps_planned", "decode_steps_cascade")},
            "fallbacks": {reason: count - before["fallbacks"].get(reason, 0)
                          for reason, count in after["fallbacks"].items()
                          if count > before["fallbacks"].get(reason, 0)},
        }
    final = _counters(llm)
    with open(args.out, "w") as f:
        json.dump({"plugin": os.environ.get("CASCADE_ATTENTION", ""), "backend": args.backend,
                   "runner": "v1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else "v2",
                   "tensor_parallel_size": args.tp, "sync_violations": SYNC_VIOLATIONS,
                   "verification_steps": VERIFICATION["steps"],
                   "verification_steps_cascade": VERIFICATION["cascade"],
                   **{k: final[k] for k in ("executors", "graph_captures", "graph_replays",
                                             "full_graph_captures", "full_graph_replays")},
                   "workloads": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
