"""Real vLLM objects on a machine without a GPU.

Used by tests that construct vLLM's real FlashInfer builder and impl from a real VllmConfig.
What cannot run here (FlashInfer kernels and wrappers, the Triton page-copy kernel) is swapped at
its call site by the tests that need it.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 32000,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


@functools.cache
def cpu_vllm_config(model_dir: str) -> Any:
    return engine_config(model_dir)


def engine_config(model_dir: str, backend: str = "FLASHINFER", **engine_args: Any) -> Any:
    """A real VllmConfig of the tiny Llama for ``backend``; ``engine_args``: more EngineArgs
    (``speculative_config``, ``kv_cache_dtype``, ``enable_prefix_caching``, ...)."""
    use_cpu_platform()
    from vllm.engine.arg_utils import EngineArgs

    Path(model_dir).mkdir(parents=True, exist_ok=True)
    (Path(model_dir) / "config.json").write_text(json.dumps(TINY_LLAMA))
    with triton_for_the_cpu_platform():
        config = EngineArgs(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
                            attention_backend=backend, block_size=16, enforce_eager=True,
                            max_model_len=4096, **engine_args).create_engine_config()
    resolve_kv_cache_layout(config)
    return config


@contextlib.contextmanager
def triton_for_the_cpu_platform() -> Iterator[None]:
    """vLLM 0.34's CPU platform refuses an x86 machine without an active Triton driver
    (triton-cpu, not on the package index here) while it checks the config; 0.26-0.33 warned.
    The configs built here are for the GPU backends' builders, which never run Triton on the
    CPU platform's behalf: the check is told Triton is there while the config is made."""
    import vllm.triton_utils

    had = vllm.triton_utils.HAS_TRITON
    vllm.triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        vllm.triton_utils.HAS_TRITON = had


def use_cpu_platform() -> None:
    """Make vLLM's current platform the CPU platform, also in modules that already bound it.

    Without a GPU the platform is "unspecified" and configs fail with an empty device type.
    Modules such as ``vllm.engine.arg_utils`` bind ``current_platform`` when imported, and an
    earlier test (``vllm-cascade check``, the CLI) may have imported them already.
    """
    import sys

    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    old = vllm.platforms._current_platform
    if isinstance(old, CpuPlatform):
        return
    platform = CpuPlatform()
    vllm.platforms._current_platform = platform
    if old is None:
        return
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", {}).get("current_platform") is old:
            module.current_platform = platform  # type: ignore[attr-defined]


def resolve_kv_cache_layout(config: Any) -> None:
    """vLLM 0.29+: resolve the KV cache layout as the engine core does before workers start.

    Earlier releases read the layout from ``get_kv_cache_layout()`` whenever it is needed.
    """
    from vllm.v1.attention.backends import utils

    if not hasattr(utils, "resolve_kv_cache_layout"):
        return
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    names = [layout.name for layout in utils.get_supported_kv_cache_layouts([FlashInferBackend])]
    utils.resolve_kv_cache_layout(config, [names])


def make_layers(config: Any, scales: list[Any], sliding_window: int | None = None,
                backend: Any = None) -> list[str]:
    """Create one real ``Attention`` layer per scale (registered in ``config``); return names.

    ``sliding_window``: the layers attend to that many tokens back (Gemma-style local layers).
    ``backend``: the attention backend class (default: the plugin's FlashInfer backend).
    """
    import vllm.v1.utils
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    if backend is None:
        from vllm_cascade_plugin.integration.flashinfer_backend import (
            CascadeFlashInferBackend as backend,
        )
    # Pinned host buffers need CUDA. vLLM reads the flag at import, from the platform it knew
    # then (a test may import vLLM before it sets the CPU platform); 0.33's CpuGpuBuffer pins
    # on every copy.
    vllm.v1.utils.PIN_MEMORY = False
    if backend.get_name() == "FLASHINFER":  # only then import vLLM's FlashInfer module
        import vllm.v1.attention.backends.flashinfer as fi_module

        fi_module.PIN_MEMORY = False
        if hasattr(fi_module, "_get_multi_ctas_kv_counter_buffer"):
            # 0.33: every impl sizes a trtllm-gen counter by the GPU's SM count and allocates
            # it on CUDA. Our path never reads it; a CPU buffer of the same size stands in.
            fi_module.get_device_sm_count = lambda device: 132
            fi_module._get_multi_ctas_kv_counter_buffer = (
                lambda min_bytes, device: torch.zeros(min_bytes, dtype=torch.uint8))
    names = []
    with set_current_vllm_config(config):
        for scale in scales:
            name = f"model.layers.{len(config.compilation_config.static_forward_context)}.attn"
            Attention(8, 128, scale, num_kv_heads=2, cache_config=config.cache_config,
                      prefix=name, attn_backend=backend,
                      per_layer_sliding_window=sliding_window)
            names.append(name)
    return names


def make_builder(config: Any, layer_names: list[str], sliding_window: int | None = None,
                 backend: Any = None, dtype: Any = torch.bfloat16) -> Any:
    """vLLM's builder (ours; ``backend``'s, default the FlashInfer one) for ``layer_names``,
    with the KV-cache spec vLLM gives them: one group for all layers, each attention group's
    spec carrying its layers' window."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if backend is None:
        from vllm_cascade_plugin.integration.flashinfer_backend import (
            CascadeFlashInferBackend as backend,
        )
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=dtype,
                             sliding_window=sliding_window)
    with set_current_vllm_config(config):
        return backend.get_builder_cls()(
            spec, layer_names, config, torch.device("cpu"))


def kv_cache_config(config: Any, specs: dict[str, Any]) -> Any:
    """The KV-cache config (its ``kv_cache_groups``) vLLM forms from the layers' ``specs`` (one
    worker, 1 GiB), as the
    engine core asks for them: ``get_kv_cache_configs`` (in 0.33+ after
    ``get_global_kv_cache_groups``, in ``kv_cache_planning``), on a copy of ``specs`` (vLLM may
    unify them in place)."""
    try:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
        get_groups = None
    except ImportError:  # vLLM 0.33: moved, and the engine core forms the groups first
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups as get_groups,  # type: ignore[no-redef]
        )
        from vllm.v1.core.kv_cache_planning import (
            get_kv_cache_configs,  # type: ignore[no-redef]
        )
    found = [dict(specs)]
    groups_first = () if get_groups is None else (get_groups(config, found),)
    [kv] = get_kv_cache_configs(config, found, [1 << 30], *groups_first)
    return kv


def in_child(code: str, *args: str, first: tuple[str, ...] = (), timeout: float = 600,
             **more_env: str) -> Any:
    """Run ``code`` in a fresh Python with ``first``, the tests' folder and the plugin's
    ``src`` first on its path, ``more_env`` set and ``CASCADE_ATTENTION`` unset (vLLM's own
    reading, no plugin); it prints one line ``@@<json>``: that JSON, decoded. ``args`` become
    ``sys.argv[1:]``."""
    import os
    import subprocess
    import sys

    here = Path(__file__).parent
    env = {**os.environ, **more_env, "PYTHONPATH": os.pathsep.join(filter(None, [
        *first, str(here), str(here.parent / "src"), os.environ.get("PYTHONPATH")]))}
    env.pop("CASCADE_ATTENTION", None)
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, text=True,
                          capture_output=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("@@")]
    return json.loads(line[2:])
