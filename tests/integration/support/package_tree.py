"""The repository's packages as a test sees them: each shipped package's directory, its modules
(tests and generated stubs left out), the first-party modules each one imports, and each package's
distribution with the first-party distributions its ``pyproject.toml`` declares."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]


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


def pyproject_of(directory: Path) -> Path:
    """The ``pyproject.toml`` of the distribution that ships the package at ``directory``."""
    for parent in (directory, *directory.parents):
        if (parent / "pyproject.toml").is_file():
            return parent / "pyproject.toml"
    raise FileNotFoundError(f"no pyproject.toml above {directory}")


def distributions() -> dict[str, str]:
    """Top-level package name -> the distribution name that ships it."""
    out = {name: tomllib.loads(pyproject_of(d).read_text())["project"]["name"] for name, d in packages().items()}
    out["kvoffload_proto"] = tomllib.loads((ROOT / "proto" / "pyproject.toml").read_text())["project"]["name"]
    return out


def declared(package: str) -> set[str]:
    """The first-party distributions the package's ``pyproject.toml`` requires (extras left out)."""
    project = tomllib.loads(pyproject_of(packages()[package]).read_text())["project"]
    names = {Requirement(r).name for r in project.get("dependencies", [])}
    return names & set(distributions().values())


def imported(package: str) -> set[str]:
    """The first-party distributions the package's modules import (itself left out)."""
    by_top = distributions()
    out = set()
    for path in modules(package, packages()[package]).values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            out.update(by_top[t] for t in tops if t in by_top and t != package)
    return out
