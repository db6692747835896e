"""What a served pair should show before it runs: the bytes one decode step reads, flat and with
the plugin, from a model's ``config.json`` and a serving workload (``workloads.py``), and the
ratio of decode-step times flat ÷ plugin they imply where steps are memory-bound.

Per decode step of B requests, each at its mean decode position (context: the shared prefix P,
the request's own tokens, half of its output):

* weights: every matrix a step reads once (the LM head included; the embedding table is only
  gathered, B rows, and left out; norms and biases, under 0.1%, too);
* full-attention layers' KV: flat, each request reads its whole context; with the cascade, the
  pages its prefix fills (⌊P / page⌋ pages) once per group of the batch, the rest per request;
* sliding-window layers' KV: the window, or the context where shorter, per request, in both;
* recurrent (Mamba2) layers' state (conv + SSM): read and written per request, in both.

Time ∝ bytes (every kernel at the same bandwidth, host time hidden, no prefill chunk in the
step): the ratio is an upper bound of what a server shows where kernels reach less of the
bandwidth, or the host or prefill chunks set a step's pace. Flat decode's shared pages partly
hit in L2 where rows beside each other read them: the ``flat_l2`` variant charges them at the
plugin's cost-model fit of FlashAttention 3 (:func:`flat_l2`), a lower bound of the ratio where
steps are memory-bound. The merge of the cascade's partial outputs (a few KiB per request and
layer) is left out.

Batch sizes. A burst decodes its ``burst_prompts`` requests together (vLLM's default
``max_num_seqs`` on an H100/H200, 1,024, is above every burst here) where its KV cache holds them
(Gemma 3's sliding windows hold ~0.36 GB a request: about 130 fit an H100 at vLLM's defaults;
:data:`EQUAL_BATCHES` gives the ratio at smaller batches). At a load x of flat's burst
rate (serve/bench.py's ``90%``), Little's law: B = λ · output · TPOT(B), λ = x · B_burst /
(output · TPOT_flat(B_burst)) (the burst's rate without its prefill), TPOT(B) ∝ a + k·B bytes, so
B = c·a / (1 - c·k), c = x · B_burst / bytes_flat(B_burst): the bandwidth cancels. A fixed λ
makes a faster step a smaller batch too, so the ratio at a load exceeds the one at equal B.
:func:`at_rate` takes a measured rate and a bandwidth instead (the Llama anchor's rows).

    python3 -m benchmarks.serve.expected        # -> benchmarks/results/cpu/served_expected.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, command_line, use_checkout
from benchmarks.serve import workloads as sw
from benchmarks.serve.pairs import DEFAULT_MODEL, ratios, serve_runs

DTYPE_BYTES = 2  # bf16 weights, KV cache and Mamba state (vLLM's "auto" for these configs)
PAGE = 16  # vLLM's FLASH_ATTN page on CUDA for a model without recurrent layers
KERNEL_PAGE = 16  # the FLASH_ATTN kernels' page granularity (a hybrid's page is a multiple)
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # peak HBM bandwidth, for at_rate
MODELS = ROOT / "examples" / "models"
# The served pairs, and the Llama anchor.
FAMILIES = ("gemma3-12b", "bamba-9b", "gpt-oss-20b-dense", "llama3-8b")
# The Llama anchor: workloads of serve.json whose measured ratios the model is held against.
ANCHOR = ("prefix_8k_x4", "chat_1k5_system")
HYBRID = "cascade_flash_attn_hybrid"  # the plugin's config of the other families' pairs


@dataclasses.dataclass(frozen=True)
class Model:
    """What a decode step of one model reads, per layer kind."""

    name: str
    weight_bytes: float
    kv_token_bytes: int  # one token's K and V in one attention layer
    full_layers: int
    sliding_layers: int
    window: int  # sliding-window tokens (0: none)
    recurrent_layers: int
    state_bytes: int  # one recurrent layer's state of one request (conv + SSM)
    page: int  # tokens per KV page of the full-attention layers


@dataclasses.dataclass(frozen=True)
class Traffic:
    """A workload's decode-time shape: shared prefix tokens and groups, mean own tokens (prompt
    beyond the prefix), output tokens, and how many requests a burst decodes together."""

    shared: int
    groups: int
    own: float
    output: int
    burst: int

    @classmethod
    def of(cls, w: sw.Workload) -> Traffic:
        if w.kind == "tree":
            raise ValueError("a tree's two levels are not modelled here")
        shared = 0 if w.kind == "random" else w.prefix_len
        own = w.input_len if w.kind == "random" else w.suffix_len  # chat: the mean of its range
        return cls(shared, w.groups, float(own), w.output_len, w.burst_prompts)

    @property
    def context(self) -> float:
        """A request's context at its mean decode position."""
        return self.shared + self.own + (self.output - 1) / 2


def _text(config: dict[str, Any]) -> dict[str, Any]:
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def _mamba(text: dict[str, Any]) -> tuple[int, int, int]:
    """A Mamba2 layer's (inner width, conv channels, SSM state elements)."""
    inner = int(text["mamba_expand"]) * int(text["hidden_size"])
    conv = inner + 2 * int(text["mamba_n_groups"]) * int(text["mamba_d_state"])
    ssm = int(text["mamba_n_heads"]) * int(text["mamba_d_head"]) * int(text["mamba_d_state"])
    return inner, conv, ssm


def weight_params(config: dict[str, Any], kinds: list[str]) -> int:
    """Parameters a decode step reads: each layer's mixer (attention, or Mamba2's projections
    and convolution) and gated MLP, and the LM head. Dense models only."""
    text = _text(config)
    if int(text.get("num_local_experts") or 0) > 1 or int(text.get("num_experts") or 0) > 1:
        raise ValueError("a mixture of experts reads the experts its batch routes to: not "
                         "modelled here")  # one expert (gpt-oss's dense stand-in) is an MLP
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    kv_heads = int(text["num_key_value_heads"])
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * int(text.get("shared_intermediate_size") or text["intermediate_size"])
    mixer = {"attention": attention, "recurrent": 0}
    if "recurrent" in kinds:
        inner, conv, _ = _mamba(text)
        heads_m = int(text["mamba_n_heads"])
        mixer["recurrent"] = (hidden * (inner + conv + heads_m) + conv * int(text["mamba_d_conv"])
                              + inner * hidden)
    layers = sum(mixer["recurrent" if k == "recurrent" else "attention"] + mlp for k in kinds)
    return layers + int(text["vocab_size"]) * hidden


def hybrid_page(kv_token_bytes: int, state_bytes: int, chunk: int) -> int:
    """The attention page vLLM gives a Mamba hybrid with prefix caching (its mamba cache mode
    "all"): whole Mamba chunks (``lcm(chunk, kernel page)``) holding at least one layer's state
    (``Platform._align_hybrid_block_size``)."""
    step = math.lcm(chunk, KERNEL_PAGE)
    tokens = -(-state_bytes // kv_token_bytes)  # attention tokens of one state's bytes
    return step * -(-tokens // step)


def model_of(folder: Path | str, name: str = "") -> Model:
    """A model folder's :class:`Model` (its layers' kinds as ``vllm-cascade check`` reads
    them)."""
    use_checkout()
    from vllm_cascade_plugin.face import families

    config = json.loads((Path(folder) / "config.json").read_text())
    text = _text(config)
    kinds = {families.FULL: "attention", families.SLIDING: "attention",
             families.RECURRENT: "recurrent"}
    layer_kinds = families.layer_kinds(config)
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    kv = 2 * int(text["num_key_value_heads"]) * int(text.get("head_dim") or hidden // heads)
    kv_token = kv * DTYPE_BYTES
    recurrent = layer_kinds.count(families.RECURRENT)
    state = 0
    if recurrent:
        _, conv, ssm = _mamba(text)
        state = ((int(text["mamba_d_conv"]) - 1) * conv + ssm) * DTYPE_BYTES
    page = hybrid_page(kv_token, state, int(text.get("mamba_chunk_size") or 256)) if state \
        else PAGE
    return Model(name or Path(folder).resolve().name,
                 float(weight_params(config, [kinds[k] for k in layer_kinds]) * DTYPE_BYTES),
                 kv_token, layer_kinds.count(families.FULL), layer_kinds.count(families.SLIDING),
                 int(text.get("sliding_window") or 0), recurrent, state, page)


def shared_pages_tokens(m: Model, t: Traffic) -> int:
    """The prefix tokens in whole pages: what the cascade reads once per group."""
    return t.shared // m.page * m.page


def _full_per_request(m: Model, t: Traffic, cascade: bool, l2: float) -> tuple[float, float]:
    """Full-attention KV bytes of a step as (once per group, per request)."""
    shared, full = shared_pages_tokens(m, t), m.full_layers * m.kv_token_bytes
    if cascade:
        return full * shared, full * (t.context - shared)
    return 0.0, full * (shared / l2 + t.context - shared)


def step_bytes(m: Model, t: Traffic, batch: float, cascade: bool,
               l2: float = 1.0) -> dict[str, float]:
    """A decode step's bytes by part, for ``batch`` requests (at least ``t.groups``). ``l2``:
    flat decode's shared pages cost 1 / ``l2`` of their bytes (rows beside each other hit them
    in L2; 1: every byte from HBM)."""
    once, each = _full_per_request(m, t, cascade, l2)
    return {"weights": m.weight_bytes, "full_kv": t.groups * once + batch * each,
            "sliding_kv": m.sliding_layers * m.kv_token_bytes * batch
            * min(t.context, m.window or t.context),
            "recurrent_state": 2.0 * m.recurrent_layers * m.state_bytes * batch}


def coefficients(m: Model, t: Traffic, cascade: bool, l2: float = 1.0) -> tuple[float, float]:
    """A decode step's bytes as a + k·B for B requests (every group in the batch)."""
    a = sum(step_bytes(m, t, 0, cascade, l2).values())
    return a, sum(step_bytes(m, t, 1, cascade, l2).values()) - a


def batch_at_load(m: Model, t: Traffic, load: float, cascade: bool, l2: float = 1.0) -> float:
    """Requests decoding together at ``load`` x flat's burst rate (Little's law)."""
    a_flat, k_flat = coefficients(m, t, False, l2)
    c = load * t.burst / (a_flat + k_flat * t.burst)
    a, k = coefficients(m, t, cascade, l2)
    return c * a / (1 - c * k) if c * k < 1 else math.inf


def at_rate(m: Model, t: Traffic, rate: float, bandwidth: float, cascade: bool,
            l2: float = 1.0) -> tuple[float, float]:
    """(requests decoding together, TPOT in s) at ``rate`` req/s on ``bandwidth`` bytes/s."""
    a, k = coefficients(m, t, cascade, l2)
    demand = rate * t.output / bandwidth  # the batch each byte of a step's time holds
    if demand * k >= 1:
        return math.inf, math.inf
    batch = demand * a / (1 - demand * k)
    return batch, (a + k * batch) / bandwidth


EQUAL_BATCHES = (16, 64, 128, 256)


def flat_l2() -> float:
    """How much less flat FLASH_ATTN decode pays for a shared page than its bytes from HBM: the
    plugin's cost model's fit of FlashAttention 3 streaming KV that rows beside each other share
    (``cost.FLASH_ATTN_FLAT``, 6.99 TB/s on the H200's 4.8)."""
    use_checkout()
    from vllm_cascade_plugin.planning.cost import FLASH_ATTN_FLAT

    return float(FLASH_ATTN_FLAT["flat_bandwidth"]) / HBM_BYTES_PER_S["H200"]


def ratio_at(m: Model, t: Traffic, batch: float, l2: float = 1.0) -> float:
    """Flat ÷ plugin bytes of a decode step of ``batch`` requests each."""
    return (sum(step_bytes(m, t, batch, False, l2).values())
            / sum(step_bytes(m, t, batch, True, l2).values()))


def _points(m: Model, t: Traffic, loads: tuple[float, ...], l2: float) -> dict[str, Any]:
    points: dict[str, Any] = {}
    for label, load in [("burst", None), *((f"{round(100 * x)}%", x) for x in loads)]:
        b_flat = t.burst if load is None else batch_at_load(m, t, load, False, l2)
        b_plugin = t.burst if load is None else batch_at_load(m, t, load, True, l2)
        flat = sum(step_bytes(m, t, b_flat, False, l2).values())
        plugin = sum(step_bytes(m, t, b_plugin, True, l2).values())
        points[label] = {"batch_flat": round(b_flat, 1), "batch_plugin": round(b_plugin, 1),
                         "step_gb_flat": round(flat / 1e9, 2),
                         "step_gb_plugin": round(plugin / 1e9, 2),
                         "tpot_flat_over_plugin": round(flat / plugin, 2)}
    return points


def expected(m: Model, t: Traffic, loads: tuple[float, ...] = (0.5, 0.9)) -> dict[str, Any]:
    """The ratio flat ÷ plugin of a decode step's time (TPOT) at equal batches (by bytes, and
    with flat's shared pages at :func:`flat_l2`) and the ms a step saves; the burst's bytes by
    part and the full-attention layers' shares of flat's; the burst and each load of flat's
    modelled burst rate (decode only: an upper bound of the batch where prefill or host time
    lowers the real burst rate): batches, bytes and ratio."""
    l2 = flat_l2()
    flat, plugin = (step_bytes(m, t, t.burst, c) for c in (False, True))
    total = sum(flat.values())
    saved = {b: sum(step_bytes(m, t, b, False).values()) - sum(step_bytes(m, t, b, True)
                                                               .values()) for b in EQUAL_BATCHES}
    return {"equal_batch_tpot_flat_over_plugin": {
                str(b): round(ratio_at(m, t, b), 2) for b in EQUAL_BATCHES},
            "equal_batch_tpot_flat_over_plugin_flat_l2": {
                str(b): round(ratio_at(m, t, b, l2), 2) for b in EQUAL_BATCHES},
            "flat_l2": round(l2, 3),
            "equal_batch_ms_saved_per_step": {gpu: {str(b): round(1e3 * v / bw, 2)
                                                    for b, v in saved.items()}
                                              for gpu, bw in HBM_BYTES_PER_S.items()},
            "burst_step_gb_flat": {k: round(v / 1e9, 2) for k, v in flat.items()},
            "burst_step_gb_plugin": {k: round(v / 1e9, 2) for k, v in plugin.items()},
            "full_attention_share_of_flat_step": round(flat["full_kv"] / total, 3),
            "share_the_cascade_removes": round((flat["full_kv"] - plugin["full_kv"]) / total, 3),
            "points": _points(m, t, loads, 1.0), "points_flat_l2": _points(m, t, loads, l2)}


def shapes(m: Model) -> dict[str, Any]:
    return {**dataclasses.asdict(m), "weight_gb": round(m.weight_bytes / 1e9, 2)}


def on_gpu(m: Model, t: Traffic, flat: dict[str, Any], plugin: dict[str, Any],
           bandwidth: float, l2: float = 1.0) -> dict[str, Any]:
    """A measured pair beside the model in ms on the GPU's peak bandwidth: a burst's step of
    ``t.burst`` requests, a Poisson run's at its measured rate (:func:`at_rate`); and the
    measured TPOT p50 less the model's, flat and plugin (what the model leaves out)."""
    if flat["request_rate"] == "burst":
        found = [(float(t.burst), sum(step_bytes(m, t, t.burst, c, l2).values()) / bandwidth)
                 for c in (False, True)]
    else:
        found = [at_rate(m, t, float(flat["request_rate"]), bandwidth, c, l2)
                 for c in (False, True)]
    (bf, tf), (bp, tp) = found
    if math.isinf(tf) or math.isinf(tp):  # JSON has no infinity: say what it means instead
        which = " and ".join(n for n, t in (("flat", tf), ("the plugin", tp)) if math.isinf(t))
        return {"saturated": f"at this rate {which} would need more than the GPU's peak "
                             "bandwidth by bytes alone: the model gives no batch or TPOT"}
    return {"batch": [round(bf, 1), round(bp, 1)],
            "tpot_ms": [round(1e3 * tf, 2), round(1e3 * tp, 2)],
            "tpot_flat_over_plugin": round(tf / tp, 2),
            "measured_less_model_ms": [round(flat["tpot_ms_p50"] - 1e3 * tf, 2),
                                       round(plugin["tpot_ms_p50"] - 1e3 * tp, 2)]}


def measured(m: Model, rows: list[dict[str, Any]], plugin: str,
             workloads: tuple[str, ...]) -> list[dict[str, Any]]:
    """The model against serve.json's pairs of ``m`` (flash_attn and ``plugin``): each point's
    measured TPOT p50 ratios flat ÷ plugin over its runs, and the model on the run's GPU
    (:func:`on_gpu`) by bytes and with flat's shared pages at :func:`flat_l2`."""
    out = []
    for name in workloads:
        t = Traffic.of(sw.WORKLOADS[name])
        for spec, runs in serve_runs(rows, "flash_attn", plugin, name, model=m.name).items():
            flat, on = runs[-1]
            gpus = [str(f.get("gpu", "")).removeprefix("NVIDIA ").split(" ")[0] for f, _ in runs]
            gpu = gpus[-1]  # the latest run's, which the model is put on
            point: dict[str, Any] = {
                "workload": name, "rate_spec": spec, "request_rate": flat["request_rate"],
                "gpu": gpu, "runs": len(runs), "gpus": gpus,
                "measured_tpot_flat_over_plugin": [round(r, 2) for r in ratios(
                    runs, "tpot_ms_p50", lower_is_better=True)],
                "measured_tpot_ms_latest": [round(flat["tpot_ms_p50"], 2),
                                            round(on["tpot_ms_p50"], 2)]}
            if gpu in HBM_BYTES_PER_S:
                bw = HBM_BYTES_PER_S[gpu]
                point["model_bytes"] = on_gpu(m, t, flat, on, bw)
                point["model_flat_l2"] = on_gpu(m, t, flat, on, bw, flat_l2())
            out.append(point)
    return out


ASSUMPTIONS = [
    "decode steps memory-bound: time proportional to the bytes read, every kernel at one "
    "bandwidth; host time, prefill chunks and the merge of partial outputs left out",
    "*_flat_l2: flat decode's shared pages at the plugin's FlashAttention 3 fit (6.99 TB/s "
    "where the H200 streams 4.8: rows beside each other hit them in L2); the plain figures read "
    "every byte from HBM",
    "bf16 weights, KV cache and Mamba state; each request at its mean decode position (shared "
    "prefix + mean own tokens + half its output)",
    "the cascade reads the prefix's whole pages once per group in the batch (every group "
    "present); sliding-window layers and Mamba state are read alike flat and with the plugin",
    "burst: all burst_prompts requests decode together; N%: Little's law at N% of the burst's "
    "modelled rate (decode only), so a faster step also holds a smaller batch",
    "pages: 16 tokens, or vLLM's enlarged page of a Mamba hybrid with prefix caching",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(FAMILIES),
                   help="folders under examples/models (or paths)")
    p.add_argument("--workload", default="chat_6k_system", choices=sorted(sw.WORKLOADS))
    p.add_argument("--serve", type=Path, default=ROOT / "benchmarks/results/gpu/serve.json",
                   help="the measured rows the Llama anchor is held against")
    p.add_argument("--out", type=Path,
                   default=ROOT / "benchmarks/results/cpu/served_expected.json")
    args = p.parse_args(argv)
    t = Traffic.of(sw.WORKLOADS[args.workload])
    result: dict[str, Any] = {"command": command_line(), "workload": args.workload,
                              "traffic": dataclasses.asdict(t), "assumptions": ASSUMPTIONS,
                              "models": {}}
    for name in args.models.split(","):
        folder = MODELS / name if (MODELS / name).is_dir() else Path(name)
        m = model_of(folder)
        result["models"][m.name] = {"shapes": shapes(m), **expected(m, t)}
        points = result["models"][m.name]["points"]
        equal = result["models"][m.name]["equal_batch_tpot_flat_over_plugin"]
        print(f"{m.name}: at equal B " + ", ".join(f"{b} {r}x" for b, r in equal.items())
              + "; " + ", ".join(f"{k} {v['tpot_flat_over_plugin']}x (B {v['batch_flat']} -> "
                                 f"{v['batch_plugin']})" for k, v in points.items()))
        rows = json.loads(args.serve.read_text()) if args.serve.is_file() else []
        if m.name == DEFAULT_MODEL:  # the anchor: Llama's measured pairs
            result["llama_anchor"] = measured(m, rows, "cascade_flash_attn", ANCHOR)
        elif found := measured(m, rows, HYBRID, (args.workload,)):  # once the pair has run
            result["models"][m.name]["measured"] = found
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
