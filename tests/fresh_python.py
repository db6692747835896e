"""Python processes as vLLM starts them, each new, without paying vLLM's import every time.

A vLLM process imports vLLM (torch, its compiler stack: ~20 s of CPU) and then loads its plugins.
The tests of what happens then (registration, ``vllm-cascade check``) each need a process of
their own (``register()`` keeps per-process state, and some cases check what it imports), but
not a new vLLM import: :class:`ForkServer` starts one interpreter that imports vLLM and nothing
of this plugin, and runs each case in a child forked from it, which then takes the case's
environment, runs its code as ``python -c`` (or ``python -m``) would, and exits with its status.
Only ``CASCADE_*`` and ``VLLM_PLUGINS`` may differ between a case and its server: vLLM and the
plugin read them when plugins load, after the import. A case whose other variables differ from
the server's gets a new server started with them (``vllm_process``), so each case sees the
environment a ``subprocess.run`` would give it. ``test_registration`` checks one case against a
new interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

DONE = "@@fresh-python@@"

SERVER = r"""
import atexit, json, os, runpy, sys, threading, types
DONE = sys.argv[1]
exec(sys.argv[2], {"__name__": "__prelude__"})
assert threading.active_count() == 1, "a thread would not survive fork()"
requests, replies = os.fdopen(0, "r"), os.fdopen(os.dup(1), "w", buffering=1)
print(DONE + " ready", file=replies)
for line in requests:
    case = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                    (1, case["out"], os.O_WRONLY), (2, case["err"], os.O_WRONLY)):
                os.dup2(os.open(path, flags), fd)
            os.environ.clear(); os.environ.update(case["env"])
            sys.argv = case["sys_argv"]
            try:
                if case["module"]:
                    runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
                else:
                    main = types.ModuleType("__main__")
                    sys.modules["__main__"] = main
                    exec(compile(case["code"], "<string>", "exec"), main.__dict__)
                status = 0
            except SystemExit as stop:
                code = stop.code
                if code is None or isinstance(code, int):
                    status = code or 0
                else:
                    print(code, file=sys.stderr)
            except BaseException:
                sys.excepthook(*sys.exc_info())
            atexit._run_exitfuncs()
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(status)
    print(f"{DONE} pid {pid}", file=replies)
    _, wait_status = os.waitpid(pid, 0)
    print(f"{DONE} exit {os.waitstatus_to_exitcode(wait_status)}", file=replies)
"""

SAME_AS_SERVER_EXCEPT = ("CASCADE_", "VLLM_PLUGINS", "PYTEST_CURRENT_TEST")


class ForkServer:
    """``run(code, env)`` / ``run_module(name, args, env)``: a ``CompletedProcess`` as from
    ``subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)``."""

    def __init__(self, prelude: str, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.tmp = Path(tempfile.mkdtemp(prefix="fresh-python-"))
        self.log = self.tmp / "server.err"
        with self.log.open("w") as log:  # not a pipe: nobody reads it while the server runs
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVER, DONE, prelude], env=self.env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self._pending = b""
        self._reply(timeout=600, expect="ready")

    def _reply(self, timeout: float, expect: str) -> str:
        """The server's next ``expect`` line (read unbuffered: select() sees only the pipe)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" not in self._pending:
                ready, _, _ = select.select([fd], [], [], timeout)
                chunk = os.read(fd, 65536) if ready else b""
                if not chunk:
                    raise RuntimeError(
                        f"no {expect!r} from the fork server in {timeout} s" if not ready else
                        f"the fork server exited ({self.proc.wait()}) before {expect!r}: "
                        + self.log.read_text()[-3000:])
                self._pending += chunk
            line, self._pending = self._pending.split(b"\n", 1)
            text = line.decode(errors="replace")
            if text.startswith(f"{DONE} {expect}"):
                return text[len(DONE) + len(expect) + 1:].strip()

    def _run(self, argv: list[str], sys_argv: list[str], code: str | None, module: str | None,
             env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
        differ = {k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)
                  and not k.startswith(SAME_AS_SERVER_EXCEPT)}
        if differ:
            raise ValueError(f"a forked case cannot change {sorted(differ)}: vLLM's import may "
                             "read them; use a new interpreter")
        out, err = (tempfile.mkstemp(dir=self.tmp)[1] for _ in range(2))
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"sys_argv": sys_argv, "code": code, "module": module,
                                          "env": env, "out": out, "err": err}).encode() + b"\n")
        self.proc.stdin.flush()
        pid = int(self._reply(timeout=60, expect="pid"))
        try:
            status = int(self._reply(timeout=timeout, expect="exit"))
        except RuntimeError:
            os.kill(pid, signal.SIGKILL)
            raise
        stdout, stderr = (Path(p).read_text(errors="replace") for p in (out, err))
        return subprocess.CompletedProcess(argv, status, stdout, stderr)

    def run(self, code: str, env: dict[str, str],
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return self._run([sys.executable, "-c", code], ["-c"], code, None, env, timeout)

    def run_module(self, module: str, args: list[str], env: dict[str, str],
                   timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return self._run([sys.executable, "-m", module, *args], ["-m", *args], None, module, env,
                         timeout)

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]  # the server's loop ends
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()  # type: ignore[union-attr]
        for path in self.tmp.iterdir():
            path.unlink()
        self.tmp.rmdir()


# What a vLLM process has imported when it loads plugins (and what every case imports first).
VLLM_PRELUDE = """
import vllm.logger
import vllm.plugins
import vllm.v1.attention.backends.registry
if hasattr(vllm.logger, "configure_logging"):  # 0.31+: configured first thing, before plugins
    import vllm.config.logging
"""


_server: ForkServer | None = None


def vllm_process(env: dict[str, str]) -> ForkServer:
    """The fork server for vLLM-like cases whose environment is ``env``: its environment is
    ``env`` less the variables cases may set after the import; started on first use, and again
    whenever that environment changed (a test, or vLLM's import, set a variable since)."""
    global _server
    base = {k: v for k, v in env.items() if not k.startswith(SAME_AS_SERVER_EXCEPT)}
    if _server is None or _server.env != base:
        if _server is None:
            atexit.register(lambda: _server is not None and _server.close())
        else:
            _server.close()
        _server = ForkServer(VLLM_PRELUDE, base)
    return _server
