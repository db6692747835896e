"""Every runtime patch the plugin makes to vLLM's model runners, in one place.

Why patches at all: vLLM's metadata builder learns of a step only after the step's CUDA-graph
mode is fixed, gets block ids only as a GPU tensor, and never passes a common prefix (0.32+ have
no cascade at all). So a small wrapper in each runner plans the step on the CPU first, and forbids
a FULL graph replay (which would skip our attention Python) only on steps that will run cascade.
Steps without sharing keep exactly the graphs vLLM would use without the plugin.

Each wrapper calls the original exactly once, never replaces it, and passes its result or
exception through unchanged; its own failures are counted, logged once, and cost the step its
cascade, never the engine. Every patched method exists with the arguments we read in vLLM 0.26
through 0.34; what differs between releases is asked of :mod:`.compat`. The list is mirrored in
docs/architecture.md and guarded by ``tests/integration/test_hooks.py``, which compares each patched
method's whole parameter list with the one recorded for the release
(:data:`.compat.releases.PATCHED_METHODS`) and fails loudly on any change.

V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``, 0.26-0.33; 0.34 has no V1 runner),
``vllm.v1.worker.gpu_model_runner.GPUModelRunner``:
  ``execute_model``  remember a real step; forget its plan when the step ends;
  ``_determine_batch_execution_and_padding``  plan the step (its CPU block table is committed);
  ``vllm.v1.cudagraph_dispatcher.CudagraphDispatcher.dispatch``  ``invalid_modes`` gets FULL on
  cascade steps (what vLLM's own cascade did through ``use_cascade_attn`` up to 0.31).
V2 runner, ``vllm.v1.worker.gpu``:
  ``block_table.BlockTables.append_block_ids``  keep a CPU mirror of the block ids;
  ``model_runner.GPUModelRunner.execute_model``  remember a real (not dummy) step;
  ``cudagraph_utils.CudaGraphManager.dispatch``  plan the step; no FULL graph for cascade steps.
Whole-step graphs (``CASCADE_FULL_GRAPHS``, :mod:`~vllm_cascade_plugin.graphs.fullgraph`): V1
``GPUModelRunner._model_forward`` and V2 ``CudaGraphManager.run_pw_graph`` run a cascade decode
step's model call from the plugin's own CUDA graph of the whole step.

This module installs the patches (:func:`install`, :func:`patch_targets`); the wrappers live in
:mod:`.hooks_step` (the step in flight, ``execute_model``, the rules every wrapper keeps),
:mod:`.hooks_dispatch` (planning, graph-mode dispatch, V2's block-id mirror) and
:mod:`.hooks_graphs` (whole-step graphs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from . import compat
from .hooks_dispatch import (
    v1_determine_batch_execution,
    v1_dispatch,
    v2_append_block_ids,
    v2_dispatch,
)
from .hooks_graphs import v1_model_forward, v2_run_pw_graph
from .hooks_step import execute_model

_PATCHED = "__cascade_plugin_original__"


def _wrap(owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    if hasattr(original, _PATCHED):  # idempotent: the backend module may be imported twice
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _PATCHED, original)
    setattr(owner, name, wrapper)


def patch_targets() -> list[tuple[type, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    """(class, method, wrapper factory) for every patch; imports vLLM's runner modules. Model
    Runner V1's only where the installed vLLM has it (0.26-0.33)."""
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    targets: list[tuple[type, str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = [
        (BlockTables, "append_block_ids", v2_append_block_ids),
        (V2Runner, "execute_model", execute_model),
        (CudaGraphManager, "dispatch", v2_dispatch),
        (CudaGraphManager, "run_pw_graph", v2_run_pw_graph),
    ]
    if compat.v1_model_runner():
        from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

        targets += [
            (V1Runner, "execute_model", execute_model),
            (V1Runner, "_determine_batch_execution_and_padding", v1_determine_batch_execution),
            (CudagraphDispatcher, "dispatch", v1_dispatch),
            (V1Runner, "_model_forward", v1_model_forward),
        ]
    return targets


def install() -> None:
    """Apply every patch (idempotent). Called when the backend module is imported in a worker."""
    for owner, name, make in patch_targets():
        _wrap(owner, name, make)
