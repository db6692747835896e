"""What several benchmarks share: the plugin from this checkout where it is not installed, the
provenance their meta files record, and progress lines that keep out of a progress bar's way.

A benchmark imports this from its own folder (``sys.path[0]`` when run as a script; one loaded
by path puts the folder on ``sys.path`` first).
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


def use_checkout() -> None:
    """Import the plugin from this checkout's ``src`` when it is not installed."""
    if importlib.util.find_spec("vllm_cascade_plugin") is None:
        sys.path.insert(0, str(ROOT / "src"))


def command_line() -> str:
    """How this process was started, as the meta files record it."""
    return " ".join([Path(sys.executable).name, *sys.argv])


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
