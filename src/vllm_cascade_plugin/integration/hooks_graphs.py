"""The runner hooks of whole-step graphs (``CASCADE_FULL_GRAPHS``,
:mod:`~vllm_cascade_plugin.graphs.fullgraph`).

V1 ``GPUModelRunner._model_forward`` and V2 ``CudaGraphManager.run_pw_graph`` run a cascade
decode step's model call from the plugin's own CUDA graph of the whole step; every other call
is vLLM's as it came. The never-raise rules are :mod:`.hooks_step`'s; a failure of the graphs'
code runs the model call eagerly, once, unless a run of it already finished outside a capture.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .. import stats
from ..step import session
from . import compat, hooks_step
from .hooks_step import failed

_FULL = "_cascade_full_graphs"  # runner attribute: its StepGraphs, or False when unsupported


def full_graphs_reason(vllm_config: Any) -> str | None:
    """Why an engine with this configuration cannot replay whole-step graphs, or None."""
    parallel = vllm_config.parallel_config
    if any(size != 1 for size in (parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                                  parallel.data_parallel_size)):
        return "tensor/pipeline/data parallel size above 1"
    if getattr(vllm_config, "lora_config", None):
        return "LoRA is enabled (its per-step adapter mapping is not in the graph's key)"
    if compat.weight_offloading():
        return "vLLM offloads weights (its prefetch streams are synced around vLLM's own graphs)"
    if compat.kv_connector_active(vllm_config):
        # vLLM runs a connector's per-layer hooks (wait_for_layer_load, save_kv_layer) around
        # each layer's attention op, inside the model call: a replayed graph of the whole call
        # would skip them. A graph per layer, inside the attention impl, leaves them outside.
        return ("a KV connector is active (its per-layer load and save hooks run inside the "
                "model call, which a graph of the whole step would skip on replay)")
    return None


def full_graphs(runner: Any) -> Any:
    """The runner's whole-step graphs when ``CASCADE_FULL_GRAPHS`` is on and this engine can use
    them, else None (why not is logged once per runner)."""
    config = session.config
    if config is None or not config.full_graphs or not config.cuda_graphs:
        return None
    graphs = runner.__dict__.get(_FULL)
    if graphs is None:
        from vllm.config import CUDAGraphMode

        from ..graphs.fullgraph import StepGraphs

        reason = full_graphs_reason(runner.vllm_config)
        groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", ())
        if reason is None and len(groups) > 1:
            reason = ("the engine has several KV-cache groups (a hybrid model): whole-step "
                      "graphs are not verified with its other layers inside")
        if reason is not None:
            stats.logger.info("vllm-cascade-plugin: cascade decode steps keep vLLM's piecewise "
                              "path and per-layer graphs, not whole-step graphs: %s.", reason)
        graphs = runner.__dict__[_FULL] = (StepGraphs(CUDAGraphMode.NONE) if reason is None
                                           else False)
    return None if graphs is False else graphs  # not `or`: a StepGraphs without graphs is falsy


def _parallel_sizes(runner: Any) -> tuple[int, ...]:
    parallel = runner.vllm_config.parallel_config
    return (parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
            parallel.data_parallel_size)


def capturing() -> bool:
    """Whether this thread's stream is capturing a CUDA graph (False where CUDA never started)."""
    try:
        import torch

        return bool(torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


class _ModelCall:
    """The runner's model call, handed to the whole-step graphs, which run it, capture it or
    replay its graph: what its last run returned or raised, and whether inside a capture (where
    it computes nothing until the graph is replayed)."""

    def __init__(self, forward: Callable[[], Any]) -> None:
        self.forward = forward
        self.captured = False
        self.completed = False  # returned outside a capture: its result is this step's output
        self.result: Any = None
        self.error: BaseException | None = None

    def __call__(self) -> Any:
        self.captured, self.completed, self.error = capturing(), False, None
        try:
            self.result = self.forward()
        except BaseException as exc:
            self.error = exc
            raise
        self.completed = not self.captured
        return self.result


def _through_graphs(graphs: Any, forward: Callable[[], Any], ctx: Any, inputs: dict[str, Any],
                    parallel_sizes: tuple[int, ...], tag: str, where: str) -> Any:
    """``forward()`` by way of the whole-step graphs; if their code fails, ``forward()`` once
    more only when no run of it finished outside a capture (a capture computes nothing, and a
    finished run's result is the step's), and ``forward()``'s own exception as it is."""
    call = _ModelCall(forward)
    try:
        return graphs.run(call, ctx, inputs, parallel_sizes, tag)
    except Exception as exc:
        if exc is call.error and not call.captured:
            raise  # the model's own failure, not the graphs'
        failed(where, exc)
    return call.result if call.completed else forward()


def v1_model_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """V1: a cascade decode step's model call from a whole-step graph (``fullgraph``)."""
    signature = inspect.signature(original)

    def graphed(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """What the graphs run this call with; None: vLLM's call as it came."""
        step = hooks_step.pending
        if step is None or step.runner is not self or not step.cascade:
            return None
        graphs = full_graphs(self)
        if graphs is None:
            return None
        call = signature.bind(self, *args, **kwargs)
        if call.arguments.get("model_kwargs"):
            return None
        from vllm.forward_context import get_forward_context

        inputs = {k: call.arguments.get(k) for k in
                  ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")}
        return graphs, get_forward_context(), inputs, _parallel_sizes(self)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            found = graphed(self, args, kwargs)
        except Exception as exc:
            failed("_model_forward", exc)
            found = None
        if found is None:
            return original(self, *args, **kwargs)
        graphs, ctx, inputs, sizes = found
        return _through_graphs(graphs, lambda: original(self, *args, **kwargs), ctx, inputs,
                               sizes, "v1", "_model_forward")
    return wrapper


def v2_run_pw_graph(original: Callable[..., Any]) -> Callable[..., Any]:
    """V2: a cascade decode step's piecewise model call from a whole-step graph."""

    def graphed(self: Any, model_inputs: dict[str, Any]) -> tuple[Any, ...] | None:
        """What the graphs run this call with; None: vLLM's call as it came."""
        step = hooks_step.pending
        if (step is None or step.runner.cudagraph_manager is not self or not step.cascade
                or getattr(self, "use_breakable_cg", False)):
            return None
        graphs = full_graphs(step.runner)
        if graphs is None:
            return None
        from vllm.forward_context import get_forward_context

        return graphs, get_forward_context(), dict(model_inputs), _parallel_sizes(step.runner)

    def wrapper(self: Any, model: Any, model_inputs: dict[str, Any]) -> Any:
        try:
            found = graphed(self, model_inputs)
        except Exception as exc:
            failed("run_pw_graph", exc)
            found = None
        if found is None:
            return original(self, model, model_inputs)
        graphs, ctx, inputs, sizes = found
        return _through_graphs(graphs, lambda: original(self, model, model_inputs), ctx, inputs,
                               sizes, "v2", "run_pw_graph")
    return wrapper
