"""The examples' CPU-side parts: the word-level tokenizer that `vllm serve` loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("model", ["llama-tiny", "llama3-8b"])
def test_make_tokenizer_maps_word_t_i_to_token_i_for_vllm(model, tmp_path):
    subprocess.run([sys.executable, str(ROOT / "examples" / "serve" / "make_tokenizer.py"),
                    str(ROOT / "examples" / "models" / model), str(tmp_path)],
                   check=True, capture_output=True, timeout=120)
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(tmp_path))
    # t1x / t2x would be split by special tokens spelled t1 / t2: the ids of <s> and </s>.
    assert tokenizer.encode("t17 t4051 t29 t100") == [17, 4051, 29, 100]
    assert tokenizer.decode([17, 4051, 9]) == "t17 t4051 t9"
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
