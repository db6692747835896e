"""Which vLLM and FlashInfer releases the plugin runs on, read without importing either:
the tested ranges and the policy for a newer vLLM, the recorded parameters of every vLLM method
the plugin patches, the FlashInfer API its GPU executor calls, and the environment report that
``register()`` and ``vllm-cascade check`` act on.

Import-light (stdlib + packaging): ``register()`` runs it in every vLLM process. Installed
versions come from distribution metadata; methods and parameters from the source files
(:mod:`.sources`).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from . import sources

# The vLLM releases the plugin is tested with (the CPU suite runs 0.26.0, 0.33.0 and 0.34.0 on
# real vLLM objects; the GPU machine runs 0.26.0). A newer release stays off unless
# CASCADE_ALLOW_UNTESTED_VLLM is on and every patched method reads as recorded below.
SUPPORTED_VLLM = SpecifierSet(">=0.26.0,<0.35")
NEWEST_TESTED_VLLM = "0.34.0"
SUPPORTED_FLASHINFER = SpecifierSet(">=0.6.8,<0.8")
GPU_VERIFIED_VLLM = "0.26.0"

# What the GPU executor calls: (module in the flashinfer package, qualified name, parameters).
FLASHINFER_API: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("prefill", "BatchPrefillWithPagedKVCacheWrapper.__init__",
     ("float_workspace_buffer", "kv_layout")),
    ("prefill", "BatchPrefillWithPagedKVCacheWrapper.plan",
     ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
      "num_qo_heads", "num_kv_heads", "page_size", "causal", "sm_scale", "logits_soft_cap",
      "q_data_type", "kv_data_type")),
    ("prefill", "BatchPrefillWithPagedKVCacheWrapper.run",
     ("q", "paged_kv_cache", "out", "lse", "return_lse")),
    ("cascade", "merge_state_in_place", ("v", "s", "v_other", "s_other")),
)

# The whole parameter list of every vLLM method the plugin patches (integration/hooks.py), by
# (module, class, method), from the first release in the table that has it, written as
# :func:`.sources.written_signature` writes it. Each wrapper reads and forwards these (some by
# position): a release whose list differs must be read before it is recorded here.
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
_V2 = "vllm.v1.worker.gpu"
_V2_EXECUTE = ("self", "scheduler_output", "intermediate_tensors", "dummy_run",
               "skip_attn_for_dummy_run", "is_profile")
_V2_DISPATCH = ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras")
_V2_METHODS = {
    (f"{_V2}.block_table", "BlockTables", "append_block_ids"):
        ("self", "req_index", "new_block_ids", "overwrite"),
    (f"{_V2}.model_runner", "GPUModelRunner", "execute_model"): _V2_EXECUTE,
    (f"{_V2}.cudagraph_utils", "CudaGraphManager", "dispatch"): _V2_DISPATCH,
    (f"{_V2}.cudagraph_utils", "CudaGraphManager", "run_pw_graph"):
        ("self", "model", "model_inputs"),
}
_V1_METHODS = {
    (V1_RUNNER_MODULE, "GPUModelRunner", "execute_model"):
        ("self", "scheduler_output", "intermediate_tensors"),
    (V1_RUNNER_MODULE, "GPUModelRunner", "_determine_batch_execution_and_padding"): (
        "self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens",
        "use_cascade_attn", "allow_microbatching", "force_eager", "force_uniform_decode",
        "force_has_lora", "force_num_active_loras", "num_encoder_reqs"),
    ("vllm.v1.cudagraph_dispatcher", "CudagraphDispatcher", "dispatch"): (
        "self", "num_tokens", "uniform_decode", "has_lora", "num_active_loras", "valid_modes",
        "invalid_modes"),
    (V1_RUNNER_MODULE, "GPUModelRunner", "_model_forward"): (
        "self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds",
        "**model_kwargs"),
}
# 0.33: Model Runner V2's dummy runs take more (after every parameter the wrapper reads), its
# dispatch a query-length bound (0.28+, V2_FULL_GRAPH_ARGUMENTS) and a microbatch count. 0.34:
# Model Runner V1 is gone; V2's four methods read as in 0.33.
_V2_METHODS_033 = {
    **_V2_METHODS,
    (f"{_V2}.model_runner", "GPUModelRunner", "execute_model"): (
        *_V2_EXECUTE, "context_len", "valid_dummy_state_slots", "randomize_inputs"),
    (f"{_V2}.cudagraph_utils", "CudaGraphManager", "dispatch"): (
        *_V2_DISPATCH, "max_query_len", "num_ubatches"),
}
PATCHED_METHODS: dict[tuple[int, int], dict[tuple[str, str, str], tuple[str, ...]]] = {
    (0, 26): {**_V1_METHODS, **_V2_METHODS},
    (0, 33): {**_V1_METHODS, **_V2_METHODS_033},
    (0, 34): _V2_METHODS_033,
}
UNTESTED_VLLM_KNOB = "CASCADE_ALLOW_UNTESTED_VLLM"


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> Version | None:
    # Local (+cu130) and post releases of a release count as that release.
    try:
        return Version(Version(version).base_version)
    except InvalidVersion:
        return None


def _in_range(version: str, supported: SpecifierSet) -> bool:
    release = _release(version)
    return release is not None and release in supported


def newer_than_tested(vllm_version: str | None) -> bool:
    """Whether ``vllm_version`` is a release after the tested range (0.35.0 and later)."""
    release = _release(vllm_version or "")
    return release is not None and release > Version(NEWEST_TESTED_VLLM) and (
        release not in SUPPORTED_VLLM)


def recorded_methods(vllm_version: str) -> dict[tuple[str, str, str], tuple[str, ...]]:
    """The patched methods recorded for ``vllm_version``: the newest record at or before its
    release (a release between two recorded ones is held to the older one's record)."""
    release = _release(vllm_version)
    key = (0, 0) if release is None else (*release.release, 0, 0)[:2]
    at = [r for r in PATCHED_METHODS if r <= key] or [min(PATCHED_METHODS)]
    return PATCHED_METHODS[max(at)]


def patched_method_changes(vllm_version: str) -> list[str]:
    """Each patched vLLM method whose parameters in the installed vLLM's source differ from the
    record for ``vllm_version`` (read with ``ast``: imports nothing heavy), as one line naming
    the method; empty: every one reads as recorded."""
    changes = []
    trees: dict[str, Any] = {}
    for (module, owner, name), expected in recorded_methods(vllm_version).items():
        if module not in trees:
            trees[module] = sources.parse(sources.module_file(module))
        tree = trees[module]
        found = sources.definitions(tree, f"{owner}.{name}") if tree is not None else []
        where = f"{module}.{owner}.{name}"
        if not found:
            changes.append(f"{where} is missing")
        elif (have := sources.written_signature(found[-1])) != expected:
            changes.append(f"{where}({', '.join(have)}) is not ({', '.join(expected)})")
    return changes


def async_scheduling_by_default() -> bool:
    """Whether the installed vLLM schedules asynchronously when ``--async-scheduling`` is not
    given to an engine with n-gram or suffix speculative decoding (the methods whose steps can
    run cascade): 0.34 turns it on for every method; 0.26-0.33 turned it off for these."""
    release = _release(installed_version("vllm") or "")
    return release is not None and release >= Version("0.34.0")


def _flashinfer_dir() -> Path | None:
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def flashinfer_api_problems(package_dir: Path | None = None) -> list[str]:
    """What of :data:`FLASHINFER_API` the installed FlashInfer lacks (empty when all is there)."""
    package_dir = package_dir or _flashinfer_dir()
    if package_dir is None:
        return ["the flashinfer package cannot be found"]
    problems: list[str] = []
    trees: dict[str, ast.Module | None] = {}
    for module, qualname, wanted in FLASHINFER_API:
        if module not in trees:
            candidates = (package_dir / f"{module}.py", package_dir / module / "__init__.py")
            trees[module] = sources.parse(next((p for p in candidates if p.is_file()), None))
        tree = trees[module]
        have = sources.parameter_names(tree, qualname) if tree is not None else None
        if have is None:
            problems.append(f"flashinfer.{module}.{qualname} is missing")
        elif missing := [p for p in wanted if p not in have]:
            problems.append(
                f"flashinfer.{module}.{qualname} lacks parameter(s) {', '.join(missing)}")
    return problems


@dataclass(frozen=True)
class EnvironmentReport:
    vllm: str | None
    flashinfer: str | None
    problems: list[str] = field(default_factory=list)
    # Why the installed vLLM is not tested (a release newer than NEWEST_TESTED_VLLM), which
    # CASCADE_ALLOW_UNTESTED_VLLM overrides; None: it is in the tested range or not installed.
    untested: str | None = None

    @property
    def supported(self) -> bool:
        return not self.problems and self.untested is None


def check_environment() -> EnvironmentReport:
    """Installed versions against what we support, plus FlashInfer's API; imports neither."""
    vllm_version = installed_version("vllm")
    fi_version = installed_version("flashinfer-python")
    problems: list[str] = []
    untested = None
    if newer_than_tested(vllm_version):
        untested = (f"vLLM {vllm_version} is newer than the newest release the plugin is tested "
                    f"with ({NEWEST_TESTED_VLLM}); {UNTESTED_VLLM_KNOB}=1 runs it there once "
                    f"every vLLM method it patches reads as in {NEWEST_TESTED_VLLM}")
    for name, found, supported in (("vLLM", vllm_version, SUPPORTED_VLLM),
                                   ("FlashInfer", fi_version, SUPPORTED_FLASHINFER)):
        if found is None:
            problems.append(f"{name} is not installed (supported: {supported})")
        elif not _in_range(found, supported) and not (name == "vLLM" and untested):
            problems.append(f"{name} {found} is outside the supported range {supported}")
    if fi_version is not None:
        problems += flashinfer_api_problems()
    return EnvironmentReport(vllm_version, fi_version, problems, untested)
