"""No import cycle inside any package of the monorepo: no module imports another that imports it
back, directly or through others. Every import counts — at module level, inside a function, or
under ``TYPE_CHECKING`` — since each is a dependency a reader must follow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def packages() -> dict[str, Path]:
    """Top-level package name -> its directory, for every package this repository ships."""
    found = {p.parent.name: p.parent for p in ROOT.glob("libs/*/src/*/__init__.py")}
    found.update({p.parent.name: p.parent for p in ROOT.glob("services/*/src/*/__init__.py")})
    found["kvoffload"] = ROOT / "kvoffload"
    return found


def modules(package: str, directory: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (tests and generated stubs excluded)."""
    out = {}
    for path in directory.rglob("*.py"):
        rel = path.relative_to(directory).with_suffix("")
        if "tests" in rel.parts or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        parts = [package, *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{a.name}" for a in node.names] + [prefix]
        else:
            continue
        for target in targets:
            while target and target not in known:  # "pkg.mod.Class" -> "pkg.mod"
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


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
