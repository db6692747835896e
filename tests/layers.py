"""The package's layers and what each may import, read from the source (``ast``, nothing is
imported): the tests in ``tests/<part>/test_<part>_layer.py`` hold each part to its rule, and
``tests/test_layering.py`` the whole package to having no import cycle.

A part is a subpackage of ``vllm_cascade_plugin`` or one of its root modules. Each may import the
standard library, the third-party modules its rule names, and the parts below it that its rule
names; never a part above it. Every import counts: at the top of a module, inside a function
(lazy) and under ``TYPE_CHECKING``. The rules, bottom to top, are written down for people in
``docs/where-changes-go.md``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "vllm_cascade_plugin"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE


@dataclass(frozen=True)
class Rule:
    """What the modules of one part may import besides the standard library and themselves."""

    parts: frozenset[str]  # other parts of the package
    third_party: frozenset[str]  # top-level third-party modules
    # Dotted vLLM modules (prefixes) the part may import, and in which of its modules only
    # (None: any). A part with "vllm" in ``third_party`` may import all of vLLM.
    vllm: tuple[str, ...] = ()
    vllm_modules: frozenset[str] | None = None


def _rule(parts: str = "", third_party: str = "", vllm: tuple[str, ...] = (),
          vllm_modules: frozenset[str] | None = None) -> Rule:
    return Rule(frozenset(parts.split()), frozenset(third_party.split()), vllm, vllm_modules)


GPU = "numpy torch triton flashinfer"
# Bottom to top. ``step`` is the step session: the runner hooks plan into it, the builders,
# the graphs and the demo read it.
RULES: dict[str, Rule] = {
    "config": _rule(),
    "stats": _rule("config", "prometheus_client"),
    "planning": _rule("", "numpy numba"),
    "step": _rule("config stats planning", "numpy"),
    "graphs": _rule("config stats planning step", "torch"),
    "execution": _rule(
        "config stats planning step graphs", GPU,
        vllm=("vllm.vllm_flash_attn", "vllm.v1.attention.ops.merge_attn_states"),
        vllm_modules=frozenset({f"{PACKAGE}.execution.vllm_kernels"})),
    "integration": _rule("config stats planning step graphs execution",
                         f"{GPU} vllm packaging typing_extensions"),
    # The user's face drives vLLM as a user does: its public API, no internals.
    "face": _rule("config stats planning step graphs execution integration",
                  f"{GPU} packaging",
                  vllm=("vllm.LLM", "vllm.SamplingParams", "vllm.inputs")),
    # The entry point (``register``): the integration's registration, lazily.
    "__init__": _rule("integration"),
}
ORDER = tuple(RULES)


def modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of the package in ``src`` by dotted name."""
    found = {}
    for path in sorted(src.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(src).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def part_of(module: str) -> str:
    """The part a module of the package belongs to (``__init__`` for the package itself)."""
    rest = module.split(".")[1:]
    return rest[0] if rest else "__init__"


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported name, line) for every import in ``path``; for ``from X import y``, ``X.y``
    unless ``X`` is of the package and ``y`` is not a module of it (then ``X``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                child = f"{source}.{alias.name}"
                inside = source.split(".")[0] == PACKAGE
                found.append((child if child in known or not inside else source, node.lineno))
    return found


def is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names or name == "__future__"


def violations(part: str, src: Path = SRC) -> list[str]:
    """Every import of ``part``'s modules that its rule does not allow."""
    rule, known = RULES[part], modules(src)
    problems = []
    for module, path in known.items():
        if part_of(module) != part:
            continue
        where = path.relative_to(src.parents[1])
        for name, line in imports(module, path, known):
            top = name.split(".")[0]
            if top == PACKAGE:
                target = part_of(name)
                if target != part and target not in rule.parts:
                    problems.append(f"{where}:{line}: imports {name} (part {target})")
            elif top == "vllm" and "vllm" not in rule.third_party:
                allowed = any(name == p or name.startswith(p + ".") for p in rule.vllm)
                if not allowed or (rule.vllm_modules is not None
                                   and module not in rule.vllm_modules):
                    problems.append(f"{where}:{line}: imports {name} (vLLM)")
            elif not is_stdlib(name) and top not in rule.third_party:
                problems.append(f"{where}:{line}: imports {name}")
    return problems


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a package's ``__init__`` counts as the
    package's module)."""
    known = modules(src)
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        for name, _ in imports(module, path, known):
            while name and name not in known:  # an attribute of a module: the module
                name = name.rpartition(".")[0]
            if name.startswith(PACKAGE) and name != module:
                graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found
