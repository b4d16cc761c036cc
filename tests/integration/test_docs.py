"""The documentation a newcomer gets with the repository: the README links docs/, and no README or
docs link leaves the repository or points at a file that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [
        ROOT / "README.md",
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("*/README.md"),
        *ROOT.glob("*/*/README.md"),
        *ROOT.glob("tests/integration/README.md"),
    ]
)
DOCS = [p for p in dict.fromkeys(DOCS) if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold commands, not links
    return LINK.findall(text)


def test_the_documents_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/design.md", "docs/configuration.md"} <= names


def test_the_readme_links_the_design_and_the_configuration_reference():
    assert {"docs/design.md", "docs/configuration.md"} <= set(links(ROOT / "README.md"))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_stays_inside_the_repository_and_resolves(doc):
    bad = []
    for target in links(doc):
        path = target.split("#", 1)[0]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            bad.append(f"{target}: leaves the repository")
        elif path:
            resolved = (doc.parent / path).resolve()
            if ROOT not in resolved.parents and resolved != ROOT:
                bad.append(f"{target}: outside the repository")
            elif not resolved.exists():
                bad.append(f"{target}: no such file")
    text = doc.read_text()
    bad += [f"names a workspace file: {m}" for m in re.findall(r"\.\./shared/\S+", text)]
    assert not bad, f"{doc.relative_to(ROOT)}:\n" + "\n".join(bad)
