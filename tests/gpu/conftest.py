"""Every test in tests/gpu is marked ``gpu`` and skipped where CUDA is unavailable (CI, laptops)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest hook sees the whole session's items, so mark only those collected from here.
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
