"""kvcore is the core: it declares no gRPC, proto or HTTP package, and it imports and runs in a
virtual environment that holds only its declared dependencies (no grpcio, no kvoffload-proto, no
aiohttp) — built here from this environment's installed distributions, nothing downloaded."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
SERVICE_PACKAGES = {"grpcio", "grpcio-health-checking", "kvoffload-proto", "aiohttp", "protobuf"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def test_pyproject_declares_no_service_dependency():
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    names = {_norm(Requirement(d).name) for d in deps}
    assert names and not names & SERVICE_PACKAGES, names & SERVICE_PACKAGES


def _closure(root: str) -> list:
    """The installed distributions ``root`` needs (its requirements, recursively; extras left out)."""
    seen: dict[str, object] = {}
    todo = [root]
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # an optional or platform requirement this environment does not have
        seen[name] = dist
        for spec in dist.requires or ():
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _venv_with_only(root: str, where: Path) -> Path:
    """A venv at ``where`` whose site-packages links exactly the files of ``root``'s closure."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    site = next(where.glob("lib/python*/site-packages"))
    for dist in _closure(root):
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            if (base / top).exists() and not (site / top).exists():
                (site / top).symlink_to(base / top)
    return where / "bin" / "python"


def test_kvcore_imports_and_runs_without_grpc_proto_or_aiohttp(tmp_path):
    python = _venv_with_only("kvoffload-kvcore", tmp_path / "venv")
    code = """
import importlib, importlib.util, pkgutil, torch
missing = [m for m in ("grpc", "kvoffload_proto", "aiohttp", "google.protobuf")
           if importlib.util.find_spec(m.split(".")[0])]
assert not missing, f"the venv has {missing}: the test proves nothing"
import kvcore
mods = [m.name for m in pkgutil.walk_packages(kvcore.__path__, "kvcore.")]
for name in mods:
    importlib.import_module(name)
from kvcore.pool.eviction import LRUEviction
from kvcore.pool.local import LocalHostPool
from kvcore.pool.geometry import PoolGeometry
import uuid
with LocalHostPool.create(f"deps-{uuid.uuid4().hex[:8]}", PoolGeometry(4, (8,), 2), eviction=LRUEviction()) as pool:
    pool.alloc([b"k"])
    pool.put_from([b"k"], 0, torch.ones(1, 4, 8, dtype=torch.uint8))
    assert pool.exists([b"k"]) == [True]
print(len(mods))
"""
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) >= 15  # every kvcore module was imported
