"""Installing the plugin next to the vLLM a user has never changes that vLLM, its torch or its
FlashInfer: pip's own dry run of the checkout and of its wheel, in the environment the suite runs
in (CI: vLLM 0.26.0, 0.33.0 and 0.34.0, the last with FlashInfer 0.7.4 in place of the 0.7.3 it
pins, which the package index never served). Needs the package index (pip builds the project in
an isolated environment)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What pip reads of the checkout to build the package (pyproject.toml's project, readme and
# packages). The tests build from a copy: pip builds in the source tree (setuptools' build/ and
# egg-info), and the suites of several vLLM releases run side by side from one checkout.
SOURCE = ("pyproject.toml", "README.md", "src")


def pip(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args, "--no-cache-dir",
                           "--disable-pip-version-check", "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


def would_install(target: str, tmp_path: Path) -> dict[str, str]:
    """What ``pip install target`` would install here (name -> version), by pip's report."""
    report = tmp_path / "report.json"
    proc = pip("install", "--dry-run", "--report", str(report), target, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """The checkout's package sources (:data:`SOURCE`), copied."""
    import shutil

    root = tmp_path_factory.mktemp("checkout")
    for name in SOURCE:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.egg-info", "build"))
        else:
            shutil.copy2(REPO / name, root / name)
    return root


@pytest.fixture(scope="module")
def wheel(tmp_path_factory, checkout) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = pip("wheel", "--no-deps", "--wheel-dir", str(out), str(checkout), cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("vllm_cascade_plugin-*.whl")
    return built


@pytest.mark.parametrize("what", ["checkout", "wheel"])
def test_installing_the_plugin_installs_only_the_plugin(what, checkout, wheel, tmp_path):
    from importlib.metadata import version

    assert version("vllm")  # the case that matters: a vLLM is there (raises where none is)
    target = str(checkout) if what == "checkout" else str(wheel)
    assert set(would_install(target, tmp_path)) == {"vllm-cascade-plugin"}


def test_the_vllm_extra_asks_for_a_vllm_the_plugin_supports():
    """A fresh environment gets vLLM with ``pip install 'vllm-cascade-plugin[vllm]'``: its
    floor is the oldest release the plugin runs on."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    from vllm_cascade_plugin.integration.compat.releases import SUPPORTED_VLLM

    wanted = [Requirement(r) for r in requires("vllm-cascade-plugin") or []]
    plain = {r.name for r in wanted if r.marker is None}
    extra = [r for r in wanted if r.marker is not None and r.marker.evaluate({"extra": "vllm"})]
    assert "vllm" not in plain and [r.name for r in extra] == ["vllm"]
    def floor(specifiers) -> str:
        return next(s.version for s in specifiers if s.operator == ">=")

    assert floor(extra[0].specifier) == floor(SUPPORTED_VLLM)
