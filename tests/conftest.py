"""Session setup for every test module.

The plugin's Triton kernel (``vllm_cascade_plugin.decode_level``) runs in the CPU tests under
Triton's interpreter, which must be chosen before Triton is first imported (its ``tl.max`` and
``tl.sum`` are bound at import time). On a machine with a GPU (``tests/gpu`` on the H200) the
kernel compiles for real and the CPU tests of it skip.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def fresh_builder_registry():
    """Every metadata builder a test makes registers with the process's planning session; each
    test starts without the builders of tests before it (whatever order they run in) and leaves
    the session as it found it."""
    from vllm_cascade_plugin.step import session

    saved = dict(vars(session))
    session._builders = {}
    yield
    vars(session).update(saved)
