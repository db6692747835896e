"""The package's layers as a whole (``tests/layers.py``): every module belongs to a part with a
rule, the root modules keep theirs, no import circle, no module much over 400 lines (nor any
Python module or shell script of ``benchmarks/`` and ``scripts/``), and the checks have teeth."""

from pathlib import Path

import pytest

import layers


def test_every_module_belongs_to_a_part_with_a_rule():
    assert {layers.part_of(m) for m in layers.modules()} == set(layers.RULES)


@pytest.mark.parametrize("part", ["config", "step", "__init__"])
def test_the_root_modules_import_only_what_their_rule_allows(part):
    assert layers.violations(part) == []


def test_no_import_cycle_among_the_packages_modules():
    assert layers.cycles(layers.import_graph()) == []


MAX_LINES = 420  # "no module over ~400 lines": a module past this is split before it grows


def test_no_module_is_longer_than_about_400_lines():
    lengths = {m: len(p.read_text().splitlines()) for m, p in layers.modules().items()}
    assert len(lengths) > 40  # the package's modules, not an empty folder
    assert {m: n for m, n in lengths.items() if n > MAX_LINES} == {}


TOOLING = ("benchmarks", "scripts")  # held to the same length as the package's modules


def test_no_benchmark_or_script_is_longer_than_about_400_lines():
    root = Path(__file__).resolve().parents[1]
    lengths = {str(p.relative_to(root)): len(p.read_text().splitlines())
               for folder in TOOLING for p in sorted((root / folder).rglob("*"))
               if p.suffix in (".py", ".sh") and "results" not in p.relative_to(root).parts}
    assert len(lengths) > 40  # the benchmarks' modules and the scripts, not an empty folder
    assert "scripts/gpu_validate.sh" in lengths and "benchmarks/serve/bench.py" in lengths
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def test_the_parts_rules_point_only_downwards():
    for i, part in enumerate(layers.ORDER):
        assert layers.RULES[part].parts <= set(layers.ORDER[:i]), part


def fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "src" / layers.PACKAGE
    for name, text in {"__init__.py": "", **files}.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return src


def test_upward_lazy_and_third_party_imports_are_caught(tmp_path):
    src = fake_package(tmp_path, {
        "planning/__init__.py": "",
        "planning/a.py": "def f():\n    import torch\n    from ..integration import b\n",
        "integration/__init__.py": "",
        "integration/b.py": "import vllm.config\n",
        "execution/__init__.py": "",
        "execution/c.py": "from vllm.v1.worker import gpu_model_runner\n",
        "execution/vllm_kernels.py": "from vllm.vllm_flash_attn import flash_attn_varlen_func\n",
    })
    assert [v.split(": ", 1)[1] for v in layers.violations("planning", src)] == [
        "imports torch", "imports vllm_cascade_plugin.integration.b (part integration)"]
    assert layers.violations("integration", src) == []
    assert [v.split(": ", 1)[1] for v in layers.violations("execution", src)] == [
        "imports vllm.v1.worker.gpu_model_runner (vLLM)"]


def test_a_cycle_is_found(tmp_path):
    src = fake_package(tmp_path, {"a.py": "from . import b\n", "b.py": "from .c import x\n",
                                  "c.py": "def f():\n    from . import a\n"})
    assert layers.cycles(layers.import_graph(src)) == [
        [f"{layers.PACKAGE}.a", f"{layers.PACKAGE}.b", f"{layers.PACKAGE}.c"]]
