"""The package map cannot drift from the code: each package's ``__init__`` docstring names every
module of its folder (its module map), each package's ``pyproject.toml`` declares exactly the
first-party distributions its modules import, and the dependency table of docs/design.md §2 is
that graph."""

from __future__ import annotations

import ast
import re

import pytest
from package_tree import ROOT, declared, distributions, imported, packages

DESIGN = ROOT / "docs" / "design.md"


def module_map_gaps(directory) -> list[str]:
    """The modules and subpackages under ``directory`` that their folder's ``__init__`` docstring
    does not name (as ``name``, ``name.py`` or ``name/`` in backticks)."""
    missing = []
    for init in sorted(directory.rglob("__init__.py")):
        folder = init.parent
        if "tests" in folder.relative_to(directory).parts:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        names = [
            p.stem
            for p in folder.glob("*.py")
            if p.name not in ("__init__.py", "__main__.py") and not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))
        ]
        names += [p.parent.name for p in folder.glob("*/__init__.py") if p.parent.name != "tests"]
        for name in sorted(names):
            if not re.search(rf"`{re.escape(name)}(\.py|/)?`", doc):
                missing.append(str((folder / name).relative_to(directory.parent)))
    return missing


@pytest.mark.parametrize("package", sorted(packages()))
def test_the_package_docstring_names_every_module(package):
    assert module_map_gaps(packages()[package]) == []


def test_the_module_map_check_sees_a_module_left_out(tmp_path):
    (tmp_path / "__init__.py").write_text('"""pkg: ``a`` does one thing; `sub/` another."""\n')
    for name in ("a.py", "b.py", "__main__.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text('"""sub: nothing named."""\n')
    (tmp_path / "sub" / "c.py").write_text("")
    assert [gap.rsplit("/", 2)[-2:] for gap in module_map_gaps(tmp_path)] == [[tmp_path.name, "b"], ["sub", "c"]]


@pytest.mark.parametrize("package", sorted(packages()))
def test_the_pyproject_declares_exactly_the_first_party_packages_imported(package):
    assert imported(package) == declared(package), (
        f"imported, not declared: {sorted(imported(package) - declared(package))}; "
        f"declared, not imported: {sorted(declared(package) - imported(package))}"
    )


def test_the_design_dependency_table_is_the_real_graph():
    text = DESIGN.read_text()
    table = text[text.index("<!-- dependency-table -->") : text.index("<!-- /dependency-table -->")]
    rows = {}
    for line in table.splitlines()[3:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    real = {distributions()[p]: declared(p) for p in packages()}
    assert rows == real
