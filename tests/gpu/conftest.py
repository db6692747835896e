"""Every test in tests/gpu is marked ``gpu`` and skipped where CUDA is unavailable (CI, laptops)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
TINY_CONFIG = HERE.parents[1] / "examples" / "models" / "llama-tiny" / "config.json"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest hook sees the whole session's items, so mark only those collected from here.
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama config with transformers' normal random initialisation (std 0.02), saved
    once: vLLM's dummy weights (~1e-3) make attention nearly uniform, so a wrong page would go
    unnoticed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("llama-tiny-std002")
    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(TINY_CONFIG.parent)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def sharp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The engine oracle's model (tests/oracle_model.py, proven to have teeth on the CPU by
    tests/test_oracle_model.py), saved once: sharp attention and spread logits, so a one-page KV
    error moves the chosen-token logprobs far beyond the tolerance."""
    import oracle_model

    return oracle_model.save(tmp_path_factory.mktemp("oracle-model"))


@pytest.fixture(scope="session")
def sliding_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The sliding-window oracle (``oracle_model.save_mixed``: layers 0 and 2 attend to the last
    512 tokens, 1 and 3 to all; its teeth and vLLM's layout of it are checked on the CPU by
    tests/test_sliding_window_model.py), saved once."""
    import oracle_model

    return oracle_model.save_mixed(tmp_path_factory.mktemp("sliding-oracle"))
