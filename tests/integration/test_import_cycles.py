"""No import cycle inside any package of the monorepo: no module imports another that imports it
back, directly or through others. Every import counts — at module level, inside a function, or
under ``TYPE_CHECKING`` — since each is a dependency a reader must follow."""

from __future__ import annotations

import pytest
from package_tree import imports_of, modules, packages


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_check_resolves_relative_and_from_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import thing\nfrom pkg import c\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    assert imports_of("pkg.a", pkg / "a.py", known) == {"pkg", "pkg.b", "pkg.c"}


@pytest.mark.parametrize("package", sorted(packages()))
def test_no_import_cycle(package):
    mods = modules(package, packages()[package])
    assert len(mods) > 1, f"{package}: no modules found under {packages()[package]}"
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    found = cycles(graph)
    assert not found, f"{package} has import cycles: " + "; ".join(" <-> ".join(c) for c in found)
