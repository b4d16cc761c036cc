"""Generate the Python stubs of ``proto/kvoffload/v1/*.proto`` with ``grpc_tools.protoc``.

Used by ``proto/setup.py`` (every build and editable install generates the stubs into
``src/kvoffload_proto/v1/``) and by ``tests/test_stubs_fresh.py`` (regenerates into a temporary
folder and compares). The stubs are never edited by hand nor committed.

The contracts live at ``kvoffload/v1/`` (wire package ``kvoffload.v1``); protoc sees that folder
under the virtual path ``kvoffload_proto/`` so that the generated modules import each other as
``kvoffload_proto.v1.*`` and never shadow the ``kvoffload`` command's package.
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE = "kvoffload_proto"
VERSION_DIR = "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(contracts_dir: Path) -> list[Path]:
    """The ``.proto`` files of ``contracts_dir`` (the ``proto/kvoffload`` folder), sorted."""
    files = sorted((Path(contracts_dir) / VERSION_DIR).glob("*.proto"))
    if not files:
        raise FileNotFoundError(f"no .proto files under {Path(contracts_dir) / VERSION_DIR}")
    return files


def is_generated(path: Path) -> bool:
    return path.name.endswith(GENERATED_SUFFIXES)


def generate(contracts_dir: Path, out_root: Path) -> list[Path]:
    """Write ``out_root/kvoffload_proto/v1/<name>_pb2{.py,.pyi,_grpc.py}``; returns them, sorted.

    Raises RuntimeError with protoc's exit status if generation fails (protoc prints why).
    """
    from grpc_tools import protoc  # build-time dependency only

    contracts_dir, out_root = Path(contracts_dir).resolve(), Path(out_root).resolve()
    files = proto_files(contracts_dir)
    out_dir = out_root / PACKAGE / VERSION_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():  # a deleted .proto must not leave stubs behind
        if is_generated(old):
            old.unlink()
    wkt = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto shipped with grpc_tools
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PACKAGE}={contracts_dir}",
        f"--proto_path={wkt}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(f"{PACKAGE}/{VERSION_DIR}/{f.name}" for f in files),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit status {rc} on {[f.name for f in files]}")
    return sorted(p for p in out_dir.iterdir() if is_generated(p))


if __name__ == "__main__":  # python -m kvoffload_proto.codegen CONTRACTS_DIR OUT_ROOT
    for p in generate(Path(sys.argv[1]), Path(sys.argv[2])):
        print(p)
