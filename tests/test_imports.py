"""The package's import graph has no cycle, and no module imports commopt at function level
(docs/architecture.md section 1: the layering, one way only).

Read with ``ast`` from the sources, so it sees every import a reader sees: type-only imports under
``TYPE_CHECKING`` count, and importing ``a.b.c`` counts as importing the package ``a.b`` (whose
``__init__`` runs first), except for the importer's own ancestors, which are already importing.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "commopt"
# The folders of the repository that map into the one package (pyproject's package-dir).
FOLDERS = {"comm": "commopt.comm", "kernels": "commopt.kernels", "schedules": "commopt.schedules",
           "bench": "commopt.bench"}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((name, *parts))] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, at function level) for every import of a commopt module."""
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for alias in child.names:
                    full = f"{target}.{alias.name}"
                    out.append((full if full in mods else target, child.lineno, in_function))
            elif isinstance(child, ast.Import):
                out.extend((alias.name, child.lineno, in_function) for alias in child.names)
            visit(child, nested)

    visit(tree, False)
    return [(t, line, fn) for t, line, fn in out if t == PACKAGE or t.startswith(PACKAGE + ".")]


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    late = []
    for name, path in mods.items():
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for target, line, in_function in _imports(name, path, mods):
            if in_function and name.startswith("commopt.comm"):
                late.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
            parts = target.split(".")
            # the module itself and every package above it that is not the importer's ancestor
            for i in range(2, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in mods and dep != name and dep not in ancestors:
                    edges[name].add(dep)
    return edges, late


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
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

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_no_import_cycle():
    edges, _ = _graph()
    assert edges["commopt.comm.collectives"], "the import graph was not read (no edge out of collectives)"
    cycles = _cycles(edges)
    described = ["; ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a]) if b in c) for c in cycles]
    assert not cycles, f"import cycles: {described}"


def test_no_function_level_import_of_commopt():
    _, late = _graph()
    assert not late, f"function-level imports of commopt modules (import them at the top): {late}"


def test_cycle_finder_finds_a_cycle():
    """The oracle for the checks above: a known cycle is reported, an acyclic graph is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
