"""What several benchmarks share: the plugin from this checkout where it is not installed, the
provenance their meta files record, and progress lines that keep out of a progress bar's way.

Benchmarks run as modules of the ``benchmarks`` package from the repository's root
(``python3 -m benchmarks.<subject>.<module>``) and import this as ``benchmarks.common``; a
benchmark that starts another Python runs it the same way (``module_command``, ``child_path``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"  # the committed result files, by machine


def use_checkout() -> None:
    """Import the plugin from this checkout's ``src`` when it is not installed."""
    if importlib.util.find_spec("vllm_cascade_plugin") is None:
        sys.path.insert(0, str(ROOT / "src"))


def command_line() -> str:
    """How this process was started, as the meta files record it: ``python3 -m MODULE ARGS``
    for a module run with ``-m``, else ``python3 SCRIPT ARGS``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["-m", spec.name] if spec is not None and spec.name else sys.argv[:1]
    return " ".join([Path(sys.executable).name, *head, *sys.argv[1:]])


def module_command(module: str) -> list[str]:
    """The command that runs benchmark module ``module`` (dotted) in a fresh Python; its
    environment needs ``child_path`` on ``PYTHONPATH``."""
    return [sys.executable, "-m", module]


def child_path(*first: str | Path, inherited: str | None = None) -> str:
    """``PYTHONPATH`` for a Python that imports the ``benchmarks`` package (this checkout's
    root) wherever it is started: ``first``, the root, then ``inherited``."""
    return os.pathsep.join([*map(str, first), str(ROOT), *filter(None, [inherited])])


def version(distribution: str) -> str | None:
    """The installed version of ``distribution``, None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def error_text(exc: BaseException) -> str:
    """One line for a failure: its type, message (cut at 300 characters) and where it happened."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {str(exc)[:300]}{where}"


def tqdm_write(text: str) -> None:
    """Print a line above a progress bar (or plainly without tqdm)."""
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety: never fail a GPU run over it
        print(text, flush=True)
        return
    tqdm.write(text)


def commit() -> str:
    """The benchmarks' checkout: ``CASCADE_COMMIT`` where set (a copy of the checkout, such as
    the GPU machine's, whose git metadata need not match its files), else its commit (12 hex
    digits, ``+dirty`` with changes to tracked files not committed), or ``unknown`` outside a
    git checkout."""
    if named := os.environ.get("CASCADE_COMMIT"):
        return named
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args],
                              capture_output=True, text=True, timeout=30, check=True).stdout
    try:
        head = git("rev-parse", "--short=12", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
