"""No import cycle anywhere in the package, function-level imports and
those under ``if TYPE_CHECKING:`` included: a module that imports another
inside a function, or only for its annotations, to dodge a cycle still
depends on it, and a tangle of modules that all need each other cannot be
read, changed or tested one at a time. Also: no module imports another's
private (underscore) name."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ir", "frontends", "passes", "compiler", "runtime")


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, name: str) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import, wherever it stands."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((mod, [a.name for a in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> tuple[nx.DiGraph, list[str]]:
    """The module graph, and the private names imported across modules."""
    mods = modules()
    g = nx.DiGraph()
    private = []
    for name, path in mods.items():
        g.add_node(name)
        for mod, names in imports(path, name):
            targets = [mod] + [f"{mod}.{n}" for n in names if f"{mod}.{n}" in mods]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    g.add_edge(name, t)
            if mod in mods:
                private += [f"{name} imports {mod}.{n}" for n in names
                            if n.startswith("_") and not n.startswith("__") and f"{mod}.{n}" not in mods]
    return g, private


def test_no_import_cycles():
    g, _ = import_graph()
    assert len(g) > 100   # the walk found the package
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_private_names_cross_modules():
    _, private = import_graph()
    assert not private, "\n".join(private)


def test_the_walk_sees_function_level_imports(tmp_path):
    """A function-level import is an edge; a TYPE_CHECKING one is not."""
    p = tmp_path / "m.py"
    p.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a import T\n"
                 "def f():\n    from b import g\n", encoding="utf-8")
    assert [m for m, _ in imports(p, "m")] == ["typing", "a", "b"]
