"""FlashInfer cannot be used in an interpreter that starts with this folder on ``PYTHONPATH``.

``scripts/test.sh`` runs the tests not marked ``flashinfer`` this way beside vLLM 0.26.0 (and
every Python those tests start inherits it through ``PYTHONPATH``). FlashInfer is still found
where it is installed (``importlib.util.find_spec``: vLLM's ``has_flashinfer()`` sees it, as in
every cell of the matrix), but importing it or any module of it, and reading the metadata of a
``flashinfer-*`` distribution (its version), fail; so does reading its files through the spec
(its locations point to a folder that does not exist, and opening a file there counts too).
Each attempt is appended to the file named by ``FLASHINFER_GUARD_LOG``, and
``tests/conftest.py`` fails the test (or the collection) that made one. A test that passes here
cannot depend on which FlashInfer release is installed, so the FlashInfer matrix
(``scripts/flashinfer_matrix.sh``) need only run the tests marked ``flashinfer``. (Only beside
vLLM 0.26.0, the matrix's vLLM: 0.33's own imports load FlashInfer's files through its b12x.)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys

HIDDEN = True
LOG = os.environ.get("FLASHINFER_GUARD_LOG")
NOWHERE = os.path.join(os.path.dirname(__file__), "flashinfer-is-hidden")


def _is_flashinfer(name: str) -> bool:
    """``flashinfer``, ``flashinfer.x``, ``flashinfer_cubin``, ``flashinfer-python``..."""
    return name.split(".")[0].replace("-", "_").lower().startswith("flashinfer")


def touched(what: str) -> None:
    if LOG:
        frame = sys._getframe(2)  # who asked: the first frame outside the import machinery
        while frame.f_back and (frame.f_code.co_filename.startswith("<frozen")
                                or "importlib" in frame.f_code.co_filename
                                or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        with open(LOG, "a", encoding="utf-8") as log:
            log.write(f"{what} from {where} (process {os.getpid()})\n")


class _Refuse(importlib.abc.Loader):
    def create_module(self, spec):  # type: ignore[no-untyped-def]
        touched(f"import {spec.name}")
        raise ModuleNotFoundError(
            f"importing {spec.name!r} is refused: FlashInfer cannot be used by the tests not "
            "marked flashinfer (tests/hide_flashinfer)", name=spec.name)

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        raise AssertionError("unreachable")


class HideFlashInfer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if not _is_flashinfer(name):
            return None
        for finder in sys.meta_path:  # where it really is: found or not, as without us
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            real = finder.find_spec(name, path, target)
            if real is not None:
                spec = importlib.machinery.ModuleSpec(
                    name, _Refuse(), origin=os.path.join(NOWHERE, "__init__.py"),
                    is_package=real.submodule_search_locations is not None)
                if spec.submodule_search_locations is not None:
                    spec.submodule_search_locations.append(NOWHERE)
                return spec
        return None


_from_name = importlib.metadata.Distribution.from_name.__func__  # type: ignore[attr-defined]


def _hidden_from_name(cls, name: str):  # type: ignore[no-untyped-def]
    if _is_flashinfer(name):
        touched(f"distribution {name}")
        raise importlib.metadata.PackageNotFoundError(name)
    return _from_name(cls, name)


def _audit(event: str, args: tuple) -> None:  # type: ignore[type-arg]
    if event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        path = os.fsdecode(args[0])
        if path.startswith(NOWHERE):
            touched(f"open {path}")


sys.meta_path.insert(0, HideFlashInfer())
sys.addaudithook(_audit)
importlib.metadata.Distribution.from_name = classmethod(_hidden_from_name)  # type: ignore[assignment]
