"""Tests and benchmarks only: vLLM knows GptOssDenseForCausalLM in every Python started with this
folder on ``PYTHONPATH``.

The serving benchmark's servers of ``examples/models/gpt-oss-20b-dense`` start with it first on
theirs (``benchmarks/serve/configs.py``, ``REGISTERED``).

The gpt-oss engine test (``tests/gpu/test_sliding_window_engine.py``) runs
``oracle_model.save_gpt_oss_dense``'s checkpoint, whose config names that architecture; its
engines (``tests/gpu/engines.py``, ``Engine.pythonpath``) put this folder first on their path,
so every Python process they start, vLLM's engine core and workers included wherever vLLM starts
them in processes of their own, imports this module at start-up. It registers the class with
vLLM's ``ModelRegistry`` by name (``module:class``, vLLM's lazy form: the model's module,
``gpt_oss_dense_model`` beside this one, is imported when vLLM first needs the class), once
vLLM's registry module has been imported by whoever imports it: a process that never imports
vLLM imports neither vLLM nor torch because of this. The ``sitecustomize`` module this one
shadows (the next one on the path: ``tests/hide_flashinfer``'s, a system one) runs after it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

ARCHITECTURE = "GptOssDenseForCausalLM"
CLASS = f"gpt_oss_dense_model:{ARCHITECTURE}"  # this folder's module
REGISTRY = "vllm.model_executor.models.registry"
HERE = os.path.dirname(os.path.abspath(__file__))


def register(model_registry: Any) -> None:
    model_registry.register_model(ARCHITECTURE, CLASS)


class _ThenRegister(importlib.abc.Loader):
    """The registry module's own loader, followed by :func:`register`."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package...
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        register(module.ModelRegistry)


class _WhenImported(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != REGISTRY:
            return None
        sys.meta_path.remove(self)  # once: the module's own spec is found without this finder
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader)
        return spec


def _run_the_shadowed_one() -> Any:
    """The next ``sitecustomize`` on the path after this folder, run; or None."""
    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    if HERE not in entries:
        return None
    spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", sys.path[entries.index(HERE) + 1:])
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if REGISTRY in sys.modules:
    register(sys.modules[REGISTRY].ModelRegistry)
else:
    sys.meta_path.insert(0, _WhenImported())
SHADOWED = _run_the_shadowed_one()
