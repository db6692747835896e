"""Set up a servable model folder: a shipped config.json plus a tiny word-level tokenizer.

    python examples/serve/make_tokenizer.py examples/models/llama-tiny /tmp/vllm-cascade-serve/model

``vllm serve`` needs a tokenizer; the shipped configs come without one (and without weights:
``--load-format dummy``). Token ``i`` is the word ``t<i>`` (but ``<unk>``, ``<s>``, ``</s>``),
so text like "t17 t4051 t9" is exactly those token ids: a document of N words is N tokens. Uses
``tokenizers``, a vLLM dependency.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def main(source: str, target: str) -> None:
    out = Path(target)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(source) / "config.json", out / "config.json")
    config = json.loads((out / "config.json").read_text())
    # Special tokens get names no word starts with: transformers matches them anywhere in text.
    special = {0: "<unk>", config["bos_token_id"]: "<s>", config["eos_token_id"]: "</s>"}
    vocab = {special.get(i, f"t{i}"): i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }, indent=1))
    print(f"model folder ready: {out} (config.json, tokenizer.json, tokenizer_config.json)")


if __name__ == "__main__":
    main(*sys.argv[1:])
