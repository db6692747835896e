"""Parameters of functions read from Python source files (``ast``): no import, no GPU.

How :mod:`.compat` checks an installed FlashInfer's API and an installed vLLM's patched methods
in any process, ``register()`` included, which must not import torch-heavy modules. stdlib only.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path


def module_file(module: str) -> Path | None:
    """The source file of ``module`` (a dotted name), or None where it cannot be found. Imports
    the parent packages (vLLM's are light); never the module itself."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def parse(path: Path | None) -> ast.Module | None:
    """The syntax tree of ``path``; None for a missing file."""
    if path is None or not path.is_file():
        return None
    return ast.parse(path.read_text(encoding="utf-8"))


def definitions(tree: ast.Module, qualname: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every definition of ``qualname`` ("Class.method" or "function") in ``tree``, overloads
    included."""
    *outer, name = qualname.split(".")
    scopes: list[ast.AST] = [tree]
    for part in outer:
        scopes = [n for s in scopes for n in ast.iter_child_nodes(s)
                  if isinstance(n, ast.ClassDef) and n.name == part]
    return [n for s in scopes for n in ast.iter_child_nodes(s)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name]


def parameter_names(tree: ast.Module, qualname: str) -> set[str] | None:
    """The union of the parameter names of every definition of ``qualname``; None: none."""
    found: set[str] | None = None
    for node in definitions(tree, qualname):
        a = node.args
        names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
        found = names if found is None else found | names
    return found


def written_signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """A definition's parameters as Python writes a signature without defaults: names in order,
    ``*name``/``**name`` for variadics, a bare ``*`` before keyword-only parameters and ``/``
    after positional-only ones."""
    a = node.args
    out = [p.arg for p in a.posonlyargs]
    if a.posonlyargs:
        out.append("/")
    out += [p.arg for p in a.args]
    if a.vararg is not None:
        out.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        out.append("*")
    out += [p.arg for p in a.kwonlyargs]
    if a.kwarg is not None:
        out.append(f"**{a.kwarg.arg}")
    return tuple(out)
