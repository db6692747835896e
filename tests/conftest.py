"""Session setup for every test module.

The plugin's Triton kernel (``vllm_cascade_plugin.decode_level``) runs in the CPU tests under
Triton's interpreter, which must be chosen before Triton is first imported (its ``tl.max`` and
``tl.sum`` are bound at import time). On a machine with a GPU (``tests/gpu`` on the H200) the
kernel compiles for real and the CPU tests of it skip.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
