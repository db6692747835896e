"""``vllm_cascade_plugin.planning`` is the functional core: numpy and the standard library only
(no torch, vLLM or FlashInfer, and no other part of the package). Checked twice: by reading
every import in the source (``tests/layers.py``, lazy ones included) and by importing every
planning module in a fresh interpreter."""

import os
import subprocess
import sys

import layers


def test_planning_imports_only_numpy_and_itself():
    assert layers.violations("planning") == []


def test_importing_every_planning_module_loads_no_torch_vllm_or_flashinfer():
    planning = [m for m in layers.modules() if layers.part_of(m) == "planning"]
    code = ("import importlib, sys\n"
            f"for name in {planning!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in ('torch', 'vllm', 'flashinfer', 'triton') "
            "if m in sys.modules))")
    path = os.pathsep.join(filter(None, [str(layers.SRC.parent), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONPATH": path})
    assert done.stdout.strip() == "[]"
