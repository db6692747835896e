"""Engine runs for the GPU engine tests: each configuration runs once, side by side with others.

An :class:`Engine` names one run of ``engine_driver.py`` (model, plugin on or off, runner,
backend, extra arguments, ``CASCADE_*`` knobs, folders put first on its ``PYTHONPATH``).
:func:`run` starts the runs a test needs at the same time, each in its own process (the plugin
registers at startup), and returns their results.
A run's result is kept in ``CASCADE_ENGINE_CACHE`` (a folder; default: one of this process), under
a lock, so every test that needs the same run, in this pytest process or in another one beside
it (``scripts/gpu_validate.sh`` runs several), gets that one run. A failed run is kept too: the
tests that need it fail with its log, without running it again.

The engines share the GPU: ``engine_driver.py`` asks vLLM for a fixed KV cache
(``kv_cache_memory_bytes``) and a small ``gpu_memory_utilization``, so several fit and none
profiles memory while another one changes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).parent


@functools.cache
def _cache() -> Path:
    folder = Path(os.environ.get("CASCADE_ENGINE_CACHE") or tempfile.mkdtemp(prefix="engines-"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@dataclasses.dataclass(frozen=True)
class Engine:
    model: str
    plugin: bool
    runner: str = "v2"
    backend: str = "FLASHINFER"
    extra: tuple[str, ...] = ()
    knobs: tuple[tuple[str, str], ...] = ()
    # Folders put first on the run's PYTHONPATH, plugin on or off: a test-only model's
    # registration (its sitecustomize runs in every process of the run).
    pythonpath: tuple[str, ...] = ()

    def with_(self, **changes) -> Engine:
        return dataclasses.replace(self, **changes)

    @property
    def kernel(self) -> str:
        """The executor under test: ``CASCADE_TEST_KERNEL`` (fa3|flashinfer), else the plugin's
        own choice; part of the run's identity."""
        return os.environ.get("CASCADE_TEST_KERNEL", "") if self.plugin else ""

    @property
    def name(self) -> str:
        words = ["on" if self.plugin else "off", self.runner, self.backend.lower(),
                 Path(self.model).name, *(a.strip("-") for a in self.extra),
                 *(f"{k.removeprefix('CASCADE_').lower()}={v}" for k, v in self.knobs)]
        if self.kernel:
            words.append(f"kernel={self.kernel}")
        return "-".join(w.replace(",", "+").replace("/", "_") for w in words)

    @property
    def key(self) -> str:
        fields = {**dataclasses.asdict(self), "kernel": self.kernel,
                  "model": str(Path(self.model).resolve())}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        return f"{self.name[:80]}-{digest}"

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CASCADE_")}
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_USE_V2_MODEL_RUNNER="1" if self.runner == "v2" else "0")
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(
                [*self.pythonpath, *filter(None, [env.get("PYTHONPATH")])])
        if self.plugin:
            # Every cascade path the plugin has: mixed steps split too (off by default); the
            # engine's knobs replace these.
            env.update({"CASCADE_ATTENTION": "1", "CASCADE_POLICY": "always",
                        "CASCADE_SPLIT_MIXED": "1", **dict(self.knobs)})
            if self.kernel:
                env["CASCADE_KERNEL"] = self.kernel
        return env


def run(*engines: Engine) -> list[dict]:
    """The results of ``engines`` (engine_driver.py's JSON plus ``plugin_log``, the plugin's own
    log lines), the missing ones run side by side."""
    if len(engines) == 1:
        return [_result(engines[0])]
    with ThreadPoolExecutor(len(engines)) as pool:
        return list(pool.map(_result, engines))


def _result(engine: Engine) -> dict:
    done = _cache() / f"{engine.key}.json"
    with open(_cache() / f"{engine.key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test (or process) may be running it now
        if not done.exists():
            done.write_text(json.dumps(_execute(engine)))
    result = json.loads(done.read_text())
    assert "error" not in result, f"engine {engine.name} failed:\n{result.get('error')}"
    return result


def _execute(engine: Engine) -> dict:
    with _slot():
        return _execute_now(engine)


@contextlib.contextmanager
def _slot() -> Iterator[None]:
    """One of ``CASCADE_ENGINE_SLOTS`` places for a running engine, shared by every process
    with the same ``CASCADE_ENGINE_CACHE`` (unset: no limit): bounds the engines on one GPU
    and its host at a time."""
    slots = int(os.environ.get("CASCADE_ENGINE_SLOTS", "0"))
    if slots <= 0:
        yield
        return
    while True:
        for i in range(slots):
            with open(_cache() / f"slot-{i}.lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                yield
                return
        time.sleep(0.5)


def _execute_now(engine: Engine) -> dict:
    out = _cache() / f"{engine.key}.out.json"
    proc = subprocess.run([sys.executable, str(HERE / "engine_driver.py"), engine.model,
                           str(out), *(("--backend", engine.backend)
                                       if engine.backend != "FLASHINFER" else ()),
                           *engine.extra], env=engine.environment(), capture_output=True,
                          text=True, timeout=900)
    log = proc.stdout + proc.stderr
    if results := os.environ.get("CASCADE_RESULTS_DIR"):  # the whole log, for the record
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / f"engine-{engine.name}.log").write_text(log)
    if proc.returncode != 0 or "Traceback" in log or not out.exists():
        return {"error": f"exit status {proc.returncode}\n{log[-6000:]}"}
    # The plugin's own log lines (what it said it does, and why), for the tests to read.
    plugin_lines = [line for line in log.splitlines() if "vllm-cascade-plugin:" in line]
    return {**json.loads(out.read_text()), "plugin_log": plugin_lines}


def write_results(name: str, rows: list[dict]) -> None:
    """A module's result rows into ``CASCADE_RESULTS_DIR/name.json``; under pytest-xdist each
    worker writes ``name.<worker>.json`` (``scripts/gpu_validate.sh`` joins them)."""
    out = os.environ.get("CASCADE_RESULTS_DIR")
    if not out or not rows:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{name}{'.' + worker if worker else ''}.json").write_text(
        json.dumps(rows, indent=1))
