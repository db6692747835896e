"""README.md's compatibility table: what each row is, and when its GPU checks last passed.

Rendered by ``scripts/readme_tables.py`` (block ``compatibility``). A row names the parts of
``scripts/gpu_validate.sh`` that check it on the GPU; its last column is read from
``benchmarks/results/gpu/gpu_validate.json`` (each part's ``last_passed``: the date, commit and
GPU of its latest run without a failure), so the table says, per row, when and on which GPU the
checks last agreed.
"""

from __future__ import annotations

import json
from pathlib import Path

GPU_VALIDATE = Path(__file__).resolve().parents[1] / "benchmarks/results/gpu/gpu_validate.json"

# (what, status, how it is checked, gpu_validate.sh parts that check it on the GPU)
ROWS: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("vLLM 0.26.0 + FlashInfer 0.6.14, `FLASHINFER` backend",
     "works",
     "GPU: kernels vs flat attention and fp32; engine on vs off vs a second kernel, both "
     "runners, whole-step and per-layer graphs; CPU suite",
     ("kernels", "engine_flashinfer", "engine_graphs")),
    ("`FLASH_ATTN` backend (vLLM's default on Hopper)", "works; as the row above",
     "GPU: engine on vs off (FlashInfer the second kernel), both runners, no sharing, a "
     "corrupted plan; CPU suite on 0.26.0, 0.33.0 and 0.34.0", ("engine_flash_attn",)),
    ("`vllm serve` (engine-core process, async scheduling), vLLM's CUDA graphs",
     "works; `enforce_eager`: CPU only",
     "GPU: a batch changing every step (graphs replayed, outputs agree), at "
     "`gpu_memory_utilization=0.92`, a soak", ("serving", "serving_memory", "soak")),
    ("vLLM 0.26.0 + FlashInfer 0.6.8.post1, 0.6.11.post3", "kernels work",
     "H200 kernel tests (`flashinfer_matrix.json`); engine not run", ()),
    ("vLLM 0.26.0 + FlashInfer 0.7.0.post1, 0.7.2.post1, 0.7.4; vLLM 0.33.0 + FlashInfer "
     "0.7.2.post1", "registers, plans",
     "CPU suite per release (hooks, registration, builder and impl on real vLLM objects)", ()),
    ("vLLM 0.34.0 + FlashInfer 0.7.4 (0.34 pins 0.7.3, never published), Model Runner V2 "
     "(0.34 has no other)", "registers, plans; no GPU run",
     "CPU suite as on 0.33.0 (hooks, registration, builders and impls on real vLLM objects, "
     "patched signatures); the GPU machine's torch 2.11 cannot run vLLM 0.34 (torch 2.14)", ()),
    ("vLLM 0.27 to 0.32", "accepted",
     "every vLLM symbol the plugin uses read in each release's source; not run", ()),
    ("FP8 KV cache (`fp8`/`fp8_e4m3`, per-layer scales)",
     "runs cascade (`CASCADE_FP8_KV=0`: flat); served faster than flat FP8 (four 8K-token "
     "documents, one run: [performance.md](performance.md), \"FP8 KV cache\" rows)",
     "GPU: kernels vs fp32 attention on the dequantised cache; engine vs two FP8 kernels, "
     "both backends",
     ("fp8",)),
    ("other quantised KV caches, `--calculate-kv-scales`", "run flat",
     "one INFO line naming the layout, `check` says so", ()),
    ("speculative decoding: `ngram`, `--no-async-scheduling`",
     "works; a verification step where some rows have no draft is planned whole (on FA3 "
     "split with `CASCADE_SPLIT_MIXED=1`)",
     "GPU: V1 engine on vs off (`CASCADE_SPLIT_MIXED=1`), verification steps run cascade",
     ("speculative",)),
    ("speculative decoding: `suffix`", "opt-in (`CASCADE_UNVERIFIED=1`), flat by default",
     "CPU suite (its drafter is not on the validation machine)", ()),
    ("speculative decoding: other methods or async scheduling (vLLM 0.34's default with "
     "every method: pass `--no-async-scheduling`)", "runs flat",
     "reason logged once and shown by `check`", ()),
    ("tensor parallelism", "opt-in (`CASCADE_UNVERIFIED=1`), flat by default",
     "needs two GPUs; whole-step graphs are off at TP > 1", ("tp",)),
    ("sliding-window attention", "those layers run flat; under vLLM's hybrid KV-cache manager "
     "(its default) the full layers' group runs cascade (Gemma 3; gpt-oss also needs "
     "`CASCADE_UNVERIFIED=1` for its sinks); served, Gemma 3's stack is faster than flat when "
     "busy and as fast at half load ([performance.md](performance.md), gemma3-12b rows)",
     "GPU: a model mixing sliding-window and full layers in both KV-cache layouts (V1 runner, "
     "vLLM 0.26-0.33: its full layers run cascade with `--disable-hybrid-kv-cache-manager`), and "
     "under the hybrid manager on V1 and V2 (the full layers' group runs cascade; engine vs two "
     "flat kernels); Gemma 3's stack (five sliding-window KV-cache groups and one full): its "
     "full group cascade on every step, within the tolerance of flat FLASH_ATTN (V1, V2) and "
     "its two flat kernels within it of each other, with the plugin's defaults (no switch)",
     ("sliding",)),
    ("attention sinks (gpt-oss)", "opt-in (`CASCADE_UNVERIFIED=1`), flat by default; served "
     "twice, gpt-oss-20b's stack (a dense stand-in for its experts) was faster than flat in one "
     "burst and slower in the other run at every point (TPOT p50 4-12% above flat's) "
     "([performance.md](performance.md), gpt-oss-20b-dense rows)",
     "GPU: every executor against fp32 softmax with sinks and FA3 with `s_aux` (`kernels`); "
     "the gpt-oss engine test runs a dense stand-in with gpt-oss's attention (vLLM's gpt-oss "
     "layers, a dense MLP for its experts: the validation machine's vLLM build has no "
     "fused-MoE kernels): cascade on every decode step, within the tolerance of flat "
     "FLASH_ATTN, V1 and V2, and the two flat kernels (FLASH_ATTN, TRITON_ATTN) within it of "
     "each other",
     ("kernels", "sliding")),
    ("`vllm-cascade demo`, `examples/`", "run", "GPU, as a user runs them",
     ("demo", "examples")),
    ("recurrent hybrids (Mamba or linear-attention layers beside full-attention ones)",
     "the recurrent layers run as without the plugin; the full-attention layers' group runs "
     "cascade with `CASCADE_UNVERIFIED=1` only (correct on a GPU; served, slower than flat). "
     "Without it the plugin stands down after the first step (no later step planned); before "
     "it did, the plugin with every step flat measured 3.6% slower on the TPOT mean in one "
     "paired run: [performance.md](performance.md)",
     "CPU suite (the group chosen, its plans; vLLM's layout of a Mamba2 hybrid); GPU: a Mamba2 "
     "hybrid (Granite 4.0-H's dense stack, 256-token pages) engine vs two flat kernels, V1 and "
     "V2", ("hybrid",)),
    ("prefix caching off; other attention backends; ALiBi, context or pipeline parallelism, "
     "microbatching, encoder-decoder models, mixed scales or soft-caps",
     "run as without the plugin", "one INFO line, `check` says so", ()),
]


def _when(run: dict) -> str:
    """A run's date, commit and GPU (its model: ``H200``, ``H100``; "GPU unknown" where the row
    does not say)."""
    gpu = run.get("gpu") or "unknown"
    where = ", GPU unknown" if gpu == "unknown" else f" on {gpu.removeprefix('NVIDIA ').split()[0]}"
    return f"{run['date']}, {run['commit']}{where}"


def _cell(parts: tuple[str, ...], results: dict[str, dict]) -> str:
    if not parts:
        return "—"
    cells = []
    for part in parts:
        row = results.get(part)
        last = None if row is None else row.get("last_passed")
        if row is None:
            cells.append(f"`{part}`: not run")
        elif last is None:
            cells.append(f"`{part}`: not yet ({row['failed']} failed {_when(row)})")
        elif row["failed"]:  # passed before, failed in its latest run
            cells.append(f"`{part}` {_when(last)} ({row['failed']} failed {_when(row)})")
        else:
            cells.append(f"`{part}` {_when(last)}")
    return "; ".join(cells)


def block_compatibility() -> list[str]:
    results = {r["part"]: r for r in json.loads(GPU_VALIDATE.read_text())}
    lines = ["| what | status | how it is checked | last passed on the GPU |",
             "|---|---|---|---|"]
    lines += [f"| {what} | {status} | {how} | {_cell(parts, results)} |"
              for what, status, how, parts in ROWS]
    return lines
