"""The indexer's texts are read from installed distributions, whichever dist-info layout they have."""

from __future__ import annotations

import pytest

from dsamodel.indexer_corpus import DIST_INFO, Source


def _dist(root, name: str, files: dict[str, str]) -> None:
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: {name}\nVersion: 1.0\n\nThe body.\n")
    for rel, text in files.items():
        (info / rel).parent.mkdir(parents=True, exist_ok=True)
        (info / rel).write_text(text)


def test_a_licence_is_found_beside_metadata_or_under_licenses(tmp_path, monkeypatch):
    _dist(tmp_path, "flat-dist", {"LICENSE.txt": "flat licence"})
    _dist(tmp_path, "pep639-dist", {"licenses/LICENSE.txt": "pep 639 licence"})  # numpy 2.4's wheels
    monkeypatch.syspath_prepend(str(tmp_path))
    assert Source("flat-dist", DIST_INFO + "LICENSE.txt").text() == "flat licence"
    assert Source("pep639-dist", DIST_INFO + "LICENSE.txt").text() == "pep 639 licence"
    assert Source("pep639-dist", DIST_INFO + "METADATA").text() == "The body.\n"
    with pytest.raises(ValueError, match="pep639-dist:dist-info:COPYING: no such file"):
        Source("pep639-dist", DIST_INFO + "COPYING").read_bytes()
