"""What ``vllm-cascade demo`` runs on a GPU: the demo's workload in vLLM, plugin off and on, and
plugin off on vLLM's other attention kernel.

Each engine runs in its own process (``python -m vllm_cascade_plugin.face.demo_engine``), one
process for engine core and worker so the child reads the plugin's counters. The model has vLLM's
dummy weights (no download), then transformers' initialisation (std 0.02, norms 1, seed 0), the
weights of the engine tests: vLLM's dummy weights give near-flat logits, whose top-2 margins
are all far below :data:`.agreement.MARGIN`, so the comparison would have nothing to judge.

The plugin's run is compared with the plugin-off FLASHINFER run by :mod:`.agreement`, and so is a
plugin-off FLASH_ATTN run: two correct kernels. A large random model's logits move with any
change in the order of a sum (32 layers of bf16 roundings), so the plugin must stay within
:data:`.agreement.RELATIVE` times what two correct kernels differ by
(:func:`.agreement.agrees_relative`).

No printing here: :mod:`vllm_cascade_plugin.face.cli` formats what these functions return.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import agreement
from .demo import PAGE_SIZE, Workload, model_config

BACKENDS = ("FLASHINFER", "FLASH_ATTN")  # the plugin's, and the second correct kernel


@dataclass(frozen=True)
class EngineRun:
    plugin: bool
    out_tok_per_s: float
    seconds: float
    output_tokens: int
    records: list[dict[str, list]]  # per request, :func:`.agreement.record` of its output
    steps_planned: int = 0
    steps_cascade: int = 0
    fallbacks: dict[str, int] | None = None
    backend: str = BACKENDS[0]


@dataclass(frozen=True)
class Agreement:
    """:func:`.agreement.measure` of one run against another, and how many sequences are
    identical."""

    deviation: agreement.Deviation
    identical_sequences: int
    sequences: int


def compare(run: EngineRun, base: EngineRun) -> Agreement:
    identical = sum(a["tokens"] == b["tokens"] for a, b in zip(run.records, base.records,
                                                                strict=True))
    return Agreement(agreement.measure(run.records, base.records), identical, len(run.records))


def engine_env(plugin: bool, policy: str) -> dict[str, str]:
    """The child's environment: the plugin on or off, counters readable in the child."""
    env = {k: v for k, v in os.environ.items() if k not in ("CASCADE_ATTENTION", "CASCADE_POLICY")}
    # One process for engine core and worker (TP=1), so the child reads the plugin's counters.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if plugin:
        env.update(CASCADE_ATTENTION="1", CASCADE_POLICY=policy)
    return env


def run_engine(model: str, workload: Workload, *, plugin: bool, policy: str,
               log: Path, backend: str = BACKENDS[0]) -> EngineRun:
    """One vLLM engine on attention ``backend`` in a child process; its output goes to ``log``."""
    with tempfile.TemporaryDirectory(prefix="vllm-cascade-demo-") as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(model_config(model)))
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "vllm_cascade_plugin.face.demo_engine", str(model_dir),
                   json.dumps(asdict(workload)), str(result), "1" if plugin else "0", backend]
        with log.open("w") as out:
            proc = subprocess.run(command, env=engine_env(plugin, policy), stdout=out,
                                  stderr=subprocess.STDOUT, check=False)
        if proc.returncode != 0 or not result.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"the vLLM engine failed (exit status {proc.returncode}); the end "
                               f"of its log {log}:\n{tail}")
        return EngineRun(**json.loads(result.read_text()))


def init_weights(model: Any, seed: int = 0) -> None:
    """transformers' initialisation in place: weights N(0, 0.02), norm weights 1, biases 0.

    In place, so vLLM's CUDA graphs and compiled code keep reading the same tensors; the same
    order and seed in every engine's process give each the same weights.
    """
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            norm = "norm" in type(module).__name__.lower()
            for name, param in module.named_parameters(recurse=False):
                if not param.is_floating_point():
                    continue
                if norm:
                    param.fill_(1.0)
                elif name == "bias":
                    param.zero_()
                else:
                    param.normal_(0.0, 0.02)


def _engine_main(model_dir: str, workload_json: str, result: str, plugin: str,
                 backend: str) -> None:
    """In the child: build the engine, warm the prefix cache, time one generate call."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from .. import stats

    workload = Workload(**json.loads(workload_json))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload.prompts(config["vocab_size"])]
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
              attention_backend=backend, enable_prefix_caching=True,
              max_model_len=workload.prompt_tokens + workload.max_tokens + PAGE_SIZE,
              gpu_memory_utilization=0.85, seed=0, enable_flashinfer_autotune=False)
    llm.apply_model(init_weights)
    # Untimed: fills the prefix cache (so the timed requests share its blocks) and warms kernels.
    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate(prompts[:: workload.questions], warm, use_tqdm=False)
    llm.generate(prompts, warm, use_tqdm=False)
    # Greedy, with the top-2 logprobs agreement.record needs for the margins.
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=2)
    before = stats.snapshot()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = stats.snapshot()
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    run = EngineRun(plugin=plugin == "1", out_tok_per_s=output_tokens / seconds, seconds=seconds,
                    output_tokens=output_tokens, records=[agreement.record(o) for o in outputs],
                    steps_planned=after.steps_planned - before.steps_planned,
                    steps_cascade=after.steps_cascade - before.steps_cascade,
                    fallbacks=dict(after.fallbacks - before.fallbacks), backend=backend)
    Path(result).write_text(json.dumps(asdict(run)))


def describe_runs(on: EngineRun, off: EngineRun,
                  second: EngineRun) -> tuple[list[str], bool]:
    """Report lines, and whether the plugin's run agrees with the plugin-off run as closely as
    two correct kernels do (``second``: plugin off, the other backend;
    :func:`.agreement.agrees_relative`)."""
    plugin, kernels = compare(on, off), compare(second, off)
    passed = agreement.agrees_relative(plugin.deviation, kernels.deviation)
    fallbacks = ", ".join(f"{k} {n}" for k, n in sorted((on.fallbacks or {}).items()))

    def deviation(result: Agreement) -> str:
        d = result.deviation
        return (f"max |d| {d.worst:.4f}, mean {d.mean:.4f} over {d.compared:,} tokens, "
                f"{result.identical_sequences} of {result.sequences} sequences identical")

    lines = [
        f"  throughput: plugin off {off.out_tok_per_s:,.0f} tok/s, plugin on "
        f"{on.out_tok_per_s:,.0f} tok/s ({on.out_tok_per_s / off.out_tok_per_s:.2f}x); "
        f"{on.output_tokens:,} tokens each",
        f"  cascade ran on {on.steps_cascade} of {on.steps_planned} engine steps; fallbacks: "
        f"{fallbacks or 'none'}",
        f"  chosen-token logprobs against plugin off ({off.backend}), each pair compared up to "
        f"its first differing token where both top-2 margins exceed {agreement.MARGIN}:",
        f"    plugin on: {deviation(plugin)}",
        f"    plugin off, {second.backend} (two correct kernels): {deviation(kernels)}",
        f"  the plugin within {agreement.RELATIVE}x of two correct kernels (mean, and max or "
        f"{agreement.MAX_TOL}): " + ("PASS" if passed else "FAIL"),
        "  (random weights, transformers' init as in tests/gpu; realistic logits, not a trained "
        "model's.)",
    ]
    if on.steps_cascade == 0:
        lines.append("  no step ran cascade: under CASCADE_POLICY=auto the cost model predicted no "
                     "gain for this batch (--policy always forces cascade), or see the fallbacks.")
    return lines, passed


if __name__ == "__main__":
    _engine_main(*sys.argv[1:])
