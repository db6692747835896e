"""Every test in tests/gpu is marked ``gpu`` and skipped where CUDA is unavailable (CI, laptops).

The test models are saved once: in ``CASCADE_MODEL_CACHE`` when set (shared, under a lock, by
the pytest processes that ``scripts/gpu_validate.sh`` runs side by side, so that their engine
runs are the same runs: ``tests/gpu/engines.py``), else in the session's temporary folder.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
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


def _saved(name: str, tmp_path_factory: pytest.TempPathFactory,
           save: Callable[[Path], object]) -> str:
    """The folder of model ``name``, saved by ``save(folder)`` unless it already was."""
    shared = os.environ.get("CASCADE_MODEL_CACHE")
    if not shared:
        folder = tmp_path_factory.mktemp(name)
        save(folder)
        return str(folder)
    folder = Path(shared) / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".saved").exists():
            folder.mkdir(exist_ok=True)
            save(folder)
            (folder / ".saved").touch()
    return str(folder)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama config with transformers' normal random initialisation (std 0.02), saved
    once: vLLM's dummy weights (~1e-3) make attention nearly uniform, so a wrong page would go
    unnoticed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def save(out: Path) -> None:
        torch.manual_seed(0)
        config = LlamaConfig.from_pretrained(TINY_CONFIG.parent)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)

    return _saved("llama-tiny-std002", tmp_path_factory, save)


@pytest.fixture(scope="session")
def sharp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The engine oracle's model (tests/oracle_model.py, proven to have teeth on the CPU by
    tests/test_oracle_model.py), saved once: sharp attention and spread logits, so a one-page KV
    error moves the chosen-token logprobs far beyond the tolerance."""
    import oracle_model

    return _saved("oracle-model", tmp_path_factory, oracle_model.save)


@pytest.fixture(scope="session")
def sliding_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The sliding-window oracle (``oracle_model.save_mixed``: layers 0 and 2 attend to the last
    512 tokens, 1 and 3 to all; its teeth and vLLM's layout of it are checked on the CPU by
    tests/test_sliding_window_model.py), saved once."""
    import oracle_model

    return _saved("sliding-oracle", tmp_path_factory, oracle_model.save_mixed)


@pytest.fixture(scope="session")
def gemma3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Gemma 3 oracle (``oracle_model.save_gemma3``: Gemma 3's text stack at a small
    size), saved once."""
    import oracle_model

    return _saved("gemma3-oracle", tmp_path_factory, oracle_model.save_gemma3)


@pytest.fixture(scope="session")
def gpt_oss_dense_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The dense gpt-oss oracle (``oracle_model.save_gpt_oss_dense``: gpt-oss's attention stack
    with sinks at a small size, one dense MLP per layer; vLLM runs it as GptOssDenseForCausalLM,
    which the engines' path registers: ``oracle_model.GPT_OSS_DENSE_SITE``; its teeth and
    vLLM's reading of it are checked on the CPU by tests/test_gpt_oss_dense_model.py), saved
    once."""
    import oracle_model

    return _saved("gpt-oss-dense-oracle", tmp_path_factory, oracle_model.save_gpt_oss_dense)


@pytest.fixture(scope="session")
def hybrid_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The recurrent-hybrid oracle (``oracle_hybrid.save``: Granite 4.0-H's dense Mamba2 and
    attention stack at a small size; its teeth and vLLM's layout of it are checked on the CPU by
    tests/test_hybrid_model.py), saved once."""
    import oracle_hybrid

    return _saved("hybrid-oracle", tmp_path_factory, oracle_hybrid.save)
