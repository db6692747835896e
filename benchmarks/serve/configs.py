"""The serving benchmark's server configurations: each config's attention backend, plugin
environment, ``vllm serve`` arguments and ``sitecustomize`` probes (``probes/``), the flat config
it is compared with, and the command and environment its server starts with."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from benchmarks.serve import workloads as sw
from benchmarks.serve.profiler import profiler_args

HOST = sw.HOST  # loopback only
PROBES = Path(__file__).resolve().parent / "probes"  # sitecustomize folders a config may put first


@dataclasses.dataclass(frozen=True)
class Config:
    """A server configuration: attention backend, extra environment and ``vllm serve`` args;
    ``pythonpath``: folders put first on the server's ``PYTHONPATH``; ``flat``: the flat config
    it is compared with, whose burst sets its Poisson rates (None: its backend's, ``FLAT``)."""

    backend: str
    env: dict[str, str]
    args: tuple[str, ...] = ()
    pythonpath: tuple[str, ...] = ()
    flat: str | None = None

    @property
    def plugin_on(self) -> bool:
        return self.env.get("CASCADE_ATTENTION") == "1"


API_SERVERS_4 = ("--api-server-count", "4")
# vLLM's CUDA-graph capture sizes in powers of two (its default: 1, 2, 4, then every multiple of
# 8 up to 512): a batch growing through a burst meets 10 sizes instead of 67, and the plugin
# keys its whole-step graphs by them (fewer captures), at more padding for flat and plugin.
POW2_GRAPHS = ("--cudagraph-capture-sizes", *(str(1 << i) for i in range(10)))
FP8_KV = ("--kv-cache-dtype", "fp8")
CONFIGS = {
    "flashinfer": Config("FLASHINFER", {"CASCADE_ATTENTION": "0"}),
    "cascade": Config("FLASHINFER", {"CASCADE_ATTENTION": "1"}),
    "flash_attn": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "0"}),
    # A second flat server in the same run, compared with the first: how far two identical
    # servers' figures are apart (the spread a plugin row is judged against).
    "flash_attn_again": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "0"}, flat="flash_attn"),
    "flashinfer_again": Config("FLASHINFER", {"CASCADE_ATTENTION": "0"}, flat="flashinfer"),
    # Flat with vLLM's piecewise CUDA graphs only (no FULL graph of a whole decode step): what
    # a cascade step runs apart from the plugin's attention, since the plugin keeps cascade
    # steps off FULL graphs. On a model whose other layers are splitting ops too (a Mamba
    # hybrid's mixers), those then run eagerly; against flash_attn, what that costs a step.
    "flash_attn_piecewise": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "0"},
                                   args=("--compilation-config",
                                         '{"cudagraph_mode": "PIECEWISE"}'),
                                   flat="flash_attn"),
    # The plugin in vLLM's default backend (FA3 kernels), against plain flash_attn.
    "cascade_flash_attn": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "1"}),
    # Cascade on every step with a shared level, the cost model not asked: whether the steps it
    # keeps flat would have been faster (its "never slower than flat", checked online).
    "cascade_flash_attn_always": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "1",
                                                       "CASCADE_POLICY": "always"}),
    # The plugin with CASCADE_UNVERIFIED=1: on a Mamba hybrid its attention layers' KV-cache
    # group runs cascade only with it (integration/kv_groups.py; beside sliding-window groups,
    # Gemma 3's, the defaults do); against plain flash_attn serving the same model.
    "cascade_flash_attn_hybrid": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "1",
                                                       "CASCADE_UNVERIFIED": "1"}),
    # The plugin with 1 or 4 ms of busy host time added to the planning of every step
    # (probes/host_delay/sitecustomize.py): whether its host time per step is on the critical path,
    # and how much host time a step can hide.
    **{f"cascade_flash_attn_host_delay_{ms}ms": Config(
        "FLASH_ATTN", {"CASCADE_ATTENTION": "1", "CASCADE_BENCH_HOST_DELAY_US": str(1000 * ms)},
        pythonpath=(str(PROBES / "host_delay"),)) for ms in (1, 4)},
    # The plugin with mixed prefill+decode steps split (CASCADE_SPLIT_MIXED=1): their decode
    # rows as cascade where the cost model, its per-step host term included, says so.
    "cascade_flash_attn_split_mixed": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "1",
                                                            "CASCADE_SPLIT_MIXED": "1"}),
    # The same with the cost model's per-step term of a split step changed
    # (probes/split_cost/sitecustomize.py): "split_off", so large that every mixed step runs flat,
    # and "split_free", 0: every mixed step whose decode
    # rows' cascade wins on its kernels runs split. What the split gains, and whether its term
    # is right.
    **{f"cascade_flash_attn_{name}": Config(
        "FLASH_ATTN", {"CASCADE_ATTENTION": "1", "CASCADE_SPLIT_MIXED": "1",
                       "CASCADE_BENCH_SPLIT_STEP_US": us},
        pythonpath=(str(PROBES / "split_cost"),))
       for name, us in (("split_off", "1e12"), ("split_free", "0"))},
    # The plugin with every mixed prefill+decode step planned whole, its prefill rows in the
    # cascade plan, run as cascade where the executor's eager cost model says it wins, else
    # flat: the defaults, spelled out (CASCADE_SPLIT_MIXED=0).
    "cascade_flash_attn_mixed_whole": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "1",
                                                            "CASCADE_SPLIT_MIXED": "0"}),
    # The plugin with every CUDA graph captured the second time its key comes, not the first
    # (probes/capture_after/sitecustomize.py): a layout a burst meets once runs eagerly instead of
    # stalling the engine for a capture.
    "cascade_flash_attn_capture_second": Config(
        "FLASH_ATTN", {"CASCADE_ATTENTION": "1", "CASCADE_BENCH_CAPTURE_AFTER": "2"},
        pythonpath=(str(PROBES / "capture_after"),)),
    # Flat and the plugin on an FP8 KV cache (--kv-cache-dtype fp8; the plugin's FP8 path is
    # opt-in, CASCADE_FP8_KV=1), compared with each other: whether cascade wins there too.
    "flash_attn_fp8": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "0"}, args=FP8_KV,
                             flat="flash_attn_fp8"),
    "cascade_flash_attn_fp8": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "1",
                                                    "CASCADE_FP8_KV": "1"},
                                     args=FP8_KV, flat="flash_attn_fp8"),
    # Flat and the plugin with 4 API server processes (``--api-server-count 4``): requests are
    # tokenized and handed to the engine in parallel, so a burst's time to first token is less
    # the frontend's and more the engine's. Compared with each other, not with one API server.
    "flash_attn_api_servers_4": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "0"},
                                       args=API_SERVERS_4, flat="flash_attn_api_servers_4"),
    "cascade_flash_attn_api_servers_4": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "1"},
                                               args=API_SERVERS_4,
                                               flat="flash_attn_api_servers_4"),
    # Flat and the plugin with capture sizes in powers of two (POW2_GRAPHS), compared with
    # each other.
    "flash_attn_pow2_graphs": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "0"}, args=POW2_GRAPHS,
                                     flat="flash_attn_pow2_graphs"),
    "cascade_flash_attn_pow2_graphs": Config("FLASH_ATTN", {"CASCADE_ATTENTION": "1"},
                                             args=POW2_GRAPHS, flat="flash_attn_pow2_graphs"),
}
# Each backend's flat config: its burst sets the Poisson rates of the configs on that backend
# that name no flat config of their own (``Config.flat``).
FLAT = {"FLASHINFER": "flashinfer", "FLASH_ATTN": "flash_attn"}


def baseline(config: str) -> str:
    """The flat config ``config`` is compared with (itself for a flat config)."""
    return CONFIGS[config].flat or FLAT[CONFIGS[config].backend]


def server_command(config: Config, model_dir: Path, port: int, max_len: int,
                   args: argparse.Namespace, name: str = "") -> list[str]:
    return [*sw.VLLM, "serve", str(model_dir), "--host", HOST, "--port", str(port),
            "--attention-backend", config.backend, "--load-format", "dummy",
            "--enable-prefix-caching", "--no-enable-flashinfer-autotune",
            "--max-model-len", str(max_len),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--tensor-parallel-size", str(args.tensor_parallel_size), "--seed", str(args.seed),
            "--tokenizer", str(model_dir), "--disable-uvicorn-access-log", *config.args,
            *(profiler_args(Path(args.work_dir) / "traces" / name) if args.profile else [])]


TIMELINE = PROBES / "step_timeline"  # --step-timeline's probe
# Architectures vLLM does not ship, registered with its ModelRegistry in every process of a
# server by a ``sitecustomize`` folder put first on the server's path (which then runs the next
# ``sitecustomize`` on the path: a config's probe still runs): gpt-oss's attention stack with a
# dense MLP (examples/models/gpt-oss-20b-dense), the GPU tests' stand-in for gpt-oss, whose
# experts need fused-MoE kernels some vLLM builds lack.
REGISTERED = {"GptOssDenseForCausalLM": Path(__file__).resolve().parents[2] / "tests" / "gpu"
              / "gpt_oss_dense"}


def model_pythonpath(model_dir: Path | None) -> list[str]:
    """The registration folders the model in ``model_dir`` (its config.json) needs."""
    if model_dir is None:
        return []
    architectures = json.loads((Path(model_dir) / "config.json").read_text()).get(
        "architectures") or []
    return [str(REGISTERED[a]) for a in architectures if a in REGISTERED]


def server_env(config: Config, prometheus_dir: Path, timeline: Path | None = None,
               model_dir: Path | None = None) -> dict[str, str]:
    """``timeline``: the file the step-timeline probe (``probes/step_timeline/``) writes, or
    None; ``model_dir``: the served model's folder (:func:`model_pythonpath`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASCADE_")}
    env.update(config.env, PROMETHEUS_MULTIPROC_DIR=str(prometheus_dir),
               VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
    pythonpath = list(config.pythonpath)
    if timeline is not None:
        if pythonpath:
            raise ValueError("--step-timeline shadows the config's own sitecustomize probe")
        pythonpath, env["CASCADE_BENCH_TIMELINE_FILE"] = [str(TIMELINE)], str(timeline)
    pythonpath = [*model_pythonpath(model_dir), *pythonpath]
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    return env
