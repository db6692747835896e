"""Session setup for every test module.

The plugin's Triton kernel (``vllm_cascade_plugin.execution.decode_level``) runs in the CPU tests
under Triton's interpreter, which must be chosen before Triton is first imported (its ``tl.max`` and
``tl.sum`` are bound at import time). On a machine with a GPU (``tests/gpu`` on the H200) the
kernel compiles for real and the CPU tests of it skip.

The ``flashinfer`` marker: a test whose outcome can depend on the installed FlashInfer (it
imports it, or runs code of ours or vLLM's that imports it, looks it up or reads its version).
The FlashInfer matrix runs only those. ``scripts/test.sh`` runs the others with FlashInfer hidden
(``tests/hide_flashinfer``); there, any test that touches FlashInfer fails, saying to mark it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from matrix_files import FLASHINFER_MODULES, HERE, flashinfer_files

# The CPU tests' folders, one per part of the package and one per subject of benchmarks/. Their
# modules share helpers and fixtures across folders by module name (``from test_planner import
# make_batch``), so every folder is on the path from the start, whichever file is collected
# first; test file names are unique across folders. The repository's root is on the path too:
# the tests import the benchmarks as the package they are (``benchmarks.serve.bench``).
MIRRORS = ("planning", "stats", "execution", "graphs", "integration", "face",
           *(f"benchmarks/{subject}" for subject in ("e2e", "graphs", "host", "kernels", "serve",
                                                      "soak")))
sys.path[:0] = [str(HERE / folder) for folder in MIRRORS] + [str(HERE.parent)]

_guard = sys.modules.get("sitecustomize")
if not getattr(_guard, "HIDDEN", False) or Path(_guard.__file__).parent != HERE / "hide_flashinfer":
    _guard = None
collect_ignore = list(FLASHINFER_MODULES) if _guard else []


@pytest.fixture(autouse=True)
def fresh_builder_registry():
    """Every metadata builder a test makes registers with the process's planning session; each
    test starts without the builders of tests before it (whatever order they run in) and leaves
    the session as it found it."""
    from vllm_cascade_plugin.step import session

    saved = dict(vars(session))
    session._builders = {}
    yield
    vars(session).update(saved)


@pytest.fixture(autouse=True)
def no_pending_step():
    """No engine step is in flight when a test starts (``hooks_step.pending``), whatever a test
    before it left: a builder checks the step it is handed against the pending one."""
    from vllm_cascade_plugin.integration import hooks_step

    hooks_step.pending = None
    yield
    hooks_step.pending = None


@pytest.fixture(autouse=True)
def fresh_layout_book():
    """Graphed steps' per-request widths are remembered per process (``graph_layout.BOOK``):
    each test starts with none, as a fresh engine does."""
    from vllm_cascade_plugin.planning import graph_layout

    graph_layout.BOOK.clear()
    yield
    graph_layout.BOOK.clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from vllm_cascade_plugin.integration.compat import v1_model_runner

    if not v1_model_runner():  # vLLM 0.34+: only Model Runner V2 exists
        skip = pytest.mark.skip(reason="this vLLM has no Model Runner V1 (removed in 0.34)")
        for item in items:
            if item.get_closest_marker("v1_runner"):
                item.add_marker(skip)
    whole = {HERE / name for name in FLASHINFER_MODULES}
    for item in items:
        if item.path in whole:
            item.add_marker(pytest.mark.flashinfer)
    files = set(flashinfer_files())
    if stray := sorted({str(item.path) for item in items
                        if item.get_closest_marker("flashinfer") and item.path not in files}):
        raise pytest.UsageError(
            f"tests marked flashinfer in {stray}, which the FlashInfer matrix does not collect "
            "(tests/matrix_files.py: mark them with the text pytest.mark.flashinfer)")
    if _guard is not None:  # FlashInfer is hidden: the marked tests cannot run here
        marked = [item for item in items if item.get_closest_marker("flashinfer")]
        if marked:
            config.hook.pytest_deselected(items=marked)
            items[:] = [item for item in items if not item.get_closest_marker("flashinfer")]


# --- where FlashInfer is hidden: which test touched it ----------------------------------------

_seen = 0  # lines of the guard's log already attributed


def _new_touches() -> list[str]:
    global _seen
    path = _guard.LOG if _guard is not None else None
    if not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as log:
        lines = log.read().splitlines()
    new, _seen = lines[_seen:], len(lines)
    return new


def pytest_configure(config: pytest.Config) -> None:
    if _guard is not None and not _guard.LOG:
        fd, path = tempfile.mkstemp(prefix="flashinfer-guard-", suffix=".log")
        os.close(fd)
        _guard.LOG = os.environ["FLASHINFER_GUARD_LOG"] = path  # this process and its children


def pytest_collection_finish(session: pytest.Session) -> None:
    if touches := _new_touches():
        pytest.exit("collecting the tests touched FlashInfer, which cannot be used here: "
                    + "; ".join(touches[:5]) + ". A module that imports it at its top goes in "
                    "FLASHINFER_MODULES (tests/conftest.py).", returncode=1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    report = yield
    if touches := _new_touches():
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} touched FlashInfer ({call.when}): " + "; ".join(touches[:5])
            + ". Its outcome can depend on the installed FlashInfer: mark it "
            "@pytest.mark.flashinfer (the FlashInfer matrix runs those).")
    return report
