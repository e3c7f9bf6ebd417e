"""pycomm's modules import one another without cycles: found by walking the `import`
statements (ast) of every module under pycomm/, so a cycle fails here before it fails, or
hides, at import time. Imports inside functions count too: a deferred import is still a
dependency, and deferring it is how a cycle hides. Imports under `if TYPE_CHECKING:` do
not: they name types for annotations and never run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pycomm

ROOT = Path(pycomm.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:`: imports for annotations only, never run."""
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The pycomm modules `path` imports (a package import means its __init__)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for guard in ast.walk(tree) if _is_type_checking(guard)
                   for stmt in guard.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod when that is a module, else pkg.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    # A package's __init__ runs before any of its modules: importing an ancestor package
    # (`from .. import _C`, an extension module) adds no edge that could close a cycle.
    return {t for t in found if not name.startswith(t + ".")}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, set(paths)) for name, path in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_packages_imports():
    graph = _graph()
    assert "pycomm.ddp.forward" in graph["pycomm.ddp.module"]
    assert "pycomm.bench.models" in graph["pycomm.bench.bucket_sweep"]


@pytest.mark.parametrize("package", ["pycomm", "pycomm.ddp", "pycomm.bench"])
def test_no_import_cycles(package):
    inside = {m: {d for d in deps if d.startswith(package)}
              for m, deps in _graph().items() if m.startswith(package)}
    assert _cycles(inside) == []


def test_ddp_helpers_do_not_import_the_module():
    """pycomm/ddp/'s helpers are handed what they use; only the package imports module.py."""
    importers = {m for m, deps in _graph().items() if "pycomm.ddp.module" in deps}
    assert importers == {"pycomm.ddp"}, importers


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


@pytest.mark.parametrize("module, kept_out", [
    ("pycomm.optim", "pycomm.zero"),
    ("pycomm.adam_step", "pycomm.zero"),
    ("pycomm.adam_step", "pycomm.optim"),
])
def test_the_one_pass_adam_sits_beside_both_of_its_users(module, kept_out):
    """pycomm/adam_step.py is the step of both pycomm.optim and pycomm.zero: the general
    optimizer does not depend on the sharded package, and the kernel's module on neither."""
    reached = {m for m in _reach(_graph(), module)
               if m == kept_out or m.startswith(kept_out + ".")}
    assert reached == set(), f"{module} imports {sorted(reached)}"
