"""The test files the FlashInfer matrix's cells collect: those that mark a test ``flashinfer``
(the text ``pytest.mark.flashinfer``) and ``FLASHINFER_MODULES``. Collecting only these saves each
cell the imports of the rest; ``tests/conftest.py`` fails any run in which a marked test comes
from another file. ``python tests/matrix_files.py`` prints them, one a line."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
# Modules that import FlashInfer at their top: every test in them is marked, and they are not
# collected where FlashInfer is unusable.
FLASHINFER_MODULES = ("gpu/test_kernels.py", "gpu/test_kernels_fp8.py", "gpu/test_kernels_split.py",
                      "gpu/test_kernels_sinks.py")


def flashinfer_files() -> list[Path]:
    marking = {p for p in HERE.rglob("test_*.py")
               if "pytest.mark.flashinfer" in p.read_text(encoding="utf-8")}
    return sorted(marking | {HERE / name for name in FLASHINFER_MODULES})


if __name__ == "__main__":
    for path in flashinfer_files():
        print(path.relative_to(HERE.parent))
