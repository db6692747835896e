"""``vllm serve`` and ``vllm bench serve`` for ``serve/bench.py``, each in its own process group.

A server is started, polled on ``/health`` until it answers, asked to reset its prefix cache, and
stopped with every process it started (the API server and the engine processes): SIGTERM to the
group, SIGKILL after a grace period, until none of it is left, so the GPU is free for the next.
A client run is stopped the same way past its timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from benchmarks.serve.workloads import HOST  # loopback only


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is left, zombies aside (a container's init may never
    reap them). Reads Linux's /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # after "pid (comm)": state, ppid, pgrp
            fields = stat.read_text().rsplit(")", 1)[-1].split()
        except OSError:  # exited meanwhile
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to ``proc``'s process group (``start_new_session``: its id is ``proc.pid``), SIGKILL
    after ``grace_s``; returns once none of it is left (the GPU is free for the next server)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(proc.pid):
            proc.poll()  # reaps our child
            time.sleep(0.5)
        if not _group_alive(proc.pid):
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


class Server:
    """``vllm serve`` in a process group of its own, its output in ``log``; stopped on exit."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, port: int):
        self.cmd, self.env, self.log, self.port = cmd, env, log, port
        self.url = f"http://{HOST}:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}) before it was "
                                   f"healthy; the end of {self.log}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:  # not listening yet, or 503 while the engine starts
                pass
            time.sleep(2)
        raise TimeoutError(f"vllm serve not healthy after {timeout_s:.0f} s; the end of "
                           f"{self.log}:\n{self.tail()}")

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.read().decode()

    def reset_prefix_cache(self) -> bool:
        """False when it does not exist (no dev mode) or blocks stay held (retried ~10 s)."""
        for _ in range(20):
            request = urllib.request.Request(self.url + "/reset_prefix_cache", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=30) as r:
                    if json.loads(r.read()).get("success"):
                        return True
            except urllib.error.HTTPError:
                return False
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, 60.0)  # the API server and the engine processes
            self.proc = None


def run_client(cmd: list[str], log: Path, timeout_s: float,
               poll: Callable[[], None] | None = None, every_s: float = 1.0) -> int:
    """One ``vllm bench serve`` in a process group of its own; killed past ``timeout_s``.
    ``poll``: called every ``every_s`` seconds while the client runs (its failures are its
    own business: it must not raise)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CASCADE_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    deadline = time.monotonic() + timeout_s
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while True:
                left = max(deadline - time.monotonic(), 0.0)
                try:
                    return proc.wait(timeout=min(left, every_s) if poll else left)
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        print(f"  client past {timeout_s:.0f} s: stopped", file=sys.stderr)
                        return -1
                    if poll is not None:
                        poll()
        finally:
            stop_group(proc, 5.0)


def free_port(start: int) -> int:
    for port in range(start, start + 200):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind((HOST, port))
            return port
    raise RuntimeError(f"no free port in {start}..{start + 199}")
