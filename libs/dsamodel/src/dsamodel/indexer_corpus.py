"""The text the PCA indexer is calibrated on, and held-out text its recall is measured on.

Both come from files every installation of this library already has: documentation, licences
and source of its own pinned dependencies (torch, numpy, jinja2), found through
``importlib.metadata`` (no network, no data from a model hub). A ``Source`` names a distribution
and a file: ``dist-info:NAME`` is a file of its ``.dist-info`` directory or of its ``licenses/``
folder (``METADATA`` is read from its body: the README, without the header lines), anything else a
path under site-packages.

``CALIBRATION`` (prose, a licence, Markdown, Python) and ``HELD_OUT`` (for ``indexer_recall``)
share no file. The order is fixed, so the same installed files give the same tokens.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

DIST_INFO = "dist-info:"


@dataclass(frozen=True)
class Source:
    """One text file of an installed distribution."""

    dist: str
    path: str

    @property
    def name(self) -> str:
        return f"{self.dist}:{self.path}"

    def read_bytes(self) -> bytes:
        """The file's bytes (ValueError naming the file when it is not installed)."""
        try:
            dist = importlib.metadata.distribution(self.dist)
        except importlib.metadata.PackageNotFoundError as exc:
            raise ValueError(f"indexer text {self.name}: distribution {self.dist!r} is not installed") from exc
        if self.path.startswith(DIST_INFO):
            name = self.path.removeprefix(DIST_INFO)
            # a wheel built to PEP 639 keeps its licence files under .dist-info/licenses/
            text = dist.read_text(name) or dist.read_text(f"licenses/{name}")
            if text is None:
                raise ValueError(f"indexer text {self.name}: no such file in {self.dist}'s dist-info")
            return text.encode("utf-8")
        path = Path(str(dist.locate_file(self.path)))
        if not path.is_file():
            raise ValueError(f"indexer text {self.name}: {path} is not a file")
        return path.read_bytes()

    def text(self) -> str:
        """The text to tokenize: the file, or a METADATA file's body (after the header lines)."""
        text = self.read_bytes().decode("utf-8", errors="replace")
        if self.path == DIST_INFO + "METADATA":
            _, _, body = text.partition("\n\n")
            return body
        return text

    def sha256(self) -> str:
        return hashlib.sha256(self.read_bytes()).hexdigest()


CALIBRATION: tuple[Source, ...] = (
    Source("torch", DIST_INFO + "METADATA"),  # the PyTorch README (Markdown prose)
    Source("numpy", DIST_INFO + "LICENSE.txt"),  # licences
    Source("jinja2", "jinja2/filters.py"),  # Python source and docstrings
    Source("torch", "torch/nn/modules/activation.py"),  # Python source, math-heavy docstrings
)

HELD_OUT: tuple[Source, ...] = (
    Source("torch", "torch/nn/modules/module.py"),
    Source("numpy", "numpy/_core/fromnumeric.py"),
    Source("jinja2", "jinja2/environment.py"),
)
