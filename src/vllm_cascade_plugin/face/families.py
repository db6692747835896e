"""What the plugin does with a model's attention layers, read from its ``config.json`` alone
(``vllm-cascade check MODEL``): which layers can run cascade and which run flat, and why.

The kinds of layer come from the Hugging Face config as vLLM reads them: ``layer_types``
(Gemma 3, gpt-oss, Qwen3-Next, Granite 4 hybrids), Gemma 3's ``sliding_window_pattern``,
NemotronH's ``hybrid_override_pattern``, Jamba's ``attn_layer_period``/``attn_layer_offset``,
else one ``sliding_window`` for every layer (Mistral's first models) or none. Under vLLM's
default hybrid KV-cache manager, sliding-window layers and recurrent (Mamba, linear-attention)
layers are KV-cache groups of their own beside the full-attention layers'
(``integration/kv_groups.py``: the full-attention layers run cascade beside sliding-window ones,
beside recurrent ones only with ``CASCADE_UNVERIFIED=1``; beside chunked local-attention ones,
Llama 4's, never). Pure Python: no vLLM, no network.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FULL, SLIDING, RECURRENT = "full attention", "sliding window", "recurrent"
CHUNKED = "chunked local attention"  # Llama 4's: a KV-cache group the plugin does not plan beside
_KINDS = {"full_attention": FULL, "attention": FULL, "global": FULL,
          "sliding_attention": SLIDING, "chunked_attention": CHUNKED, "local": SLIDING}
NOT_ATTENTION = ("mlp", "moe")  # NemotronH's layers without a token mixer
SINK_MODELS = ("gpt_oss",)  # model types whose attention layers have sinks


def _hub_cache() -> Path:
    """The Hugging Face hub cache, where huggingface_hub puts it."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def read_config(model: str) -> dict[str, Any] | None:
    """``model``'s config.json from a local folder or the Hugging Face cache's snapshot of
    ``main`` (never the network), or None."""
    path = Path(model).expanduser() / "config.json"
    if not path.is_file() and model.count("/") == 1:
        repo = _hub_cache() / f"models--{model.replace('/', '--')}"
        try:
            revision = (repo / "refs" / "main").read_text().strip()
        except OSError:
            return None
        path = repo / "snapshots" / revision / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def layer_kinds(config: dict[str, Any]) -> list[str]:
    """Each decoder layer's kind: :data:`FULL`, :data:`SLIDING`, :data:`CHUNKED` or
    :data:`RECURRENT`."""
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    n = int(text.get("num_hidden_layers") or 0)
    for key in ("layer_types", "layers_block_type"):  # any other kind (mamba, linear
        if isinstance(text.get(key), list):           # attention, ...) is recurrent
            return [_KINDS.get(str(t), RECURRENT) for t in text[key]
                    if str(t) not in NOT_ATTENTION]
    if isinstance(pattern := text.get("hybrid_override_pattern"), str):  # NemotronH
        return [FULL if c == "*" else RECURRENT for c in pattern if c in "*M"]
    if text.get("attn_layer_period"):  # Jamba: attention every period-th layer
        period, offset = int(text["attn_layer_period"]), int(text.get("attn_layer_offset", 0))
        return [FULL if i % period == offset else RECURRENT for i in range(n)]
    if (every := text.get("sliding_window_pattern")) and text.get("sliding_window"):
        return [FULL if (i + 1) % int(every) == 0 else SLIDING for i in range(n)]
    if text.get("sliding_window") and text.get("use_sliding_window", True):
        return [SLIDING] * n
    return [FULL] * n


def model_lines(model: str, unverified: bool) -> tuple[list[str], bool | None]:
    """What ``vllm-cascade check`` says of ``model``'s layers, and whether any of them can run
    cascade (None: its config was not found)."""
    config = read_config(model)
    if config is None:
        return [f"Model {model}: its config.json is not in that folder nor in the Hugging Face "
                "cache, so its layers were not read (check again once it is downloaded)."], None
    kinds = layer_kinds(config)
    full, sliding, recurrent = (kinds.count(k) for k in (FULL, SLIDING, RECURRENT))
    model_type = config.get("model_type", "unknown")
    head = (f"Model {model} ({model_type}): {full} full-attention, {sliding} sliding-window and "
            f"{recurrent} recurrent layer(s)")
    if not full:
        return [f"{head}. Every layer runs flat: only full-attention layers run cascade."], False
    if chunked := kinds.count(CHUNKED):
        return [f"{head}, and {chunked} chunked local-attention layer(s). Every layer runs flat: "
                "the plugin plans no step beside chunked local-attention layers (Llama 4)."], False
    unverified_parts = [part for applies, part in (
        (recurrent > 0, "attention layers beside recurrent ones (hybrid KV cache: they agree "
                        "with flat attention on a GPU, but served slower than flat)"),
        (model_type in SINK_MODELS, "attention sinks (they agree with flat attention on a GPU, "
                                    "but no engine has served them faster yet)")) if applies]
    flat = "".join(f"; the {n} {kind} layer(s) run {how}" for n, kind, how in (
        (sliding, "sliding-window", "flat"), (recurrent, "recurrent", "as vLLM runs them"))
        if n)
    if unverified_parts and not unverified:
        return [f"{head}. Every layer runs flat: {' and '.join(unverified_parts)} are off "
                "by default in this release; "
                f"CASCADE_UNVERIFIED=1 runs the {full} full-attention layer(s) as "
                f"cascade{flat}."], False
    return [f"{head}. The {full} full-attention layer(s) can run cascade{flat}."], True
