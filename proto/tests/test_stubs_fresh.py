"""The installed stubs are exactly what the build generates from today's .proto files.

Fails when a .proto changed (or was added/removed) without regenerating: reinstall with
``pip install --no-build-isolation -e proto``.
"""

import filecmp
from pathlib import Path

import pytest

import kvoffload_proto.v1
from kvoffload_proto import codegen

CONTRACTS = Path(__file__).resolve().parents[1] / "kvoffload"
INSTALLED = Path(kvoffload_proto.v1.__path__[0])
REINSTALL = "stale stubs: run `pip install --no-build-isolation -e proto` to regenerate"


def test_installed_stubs_match_a_fresh_generation(tmp_path):
    fresh = codegen.generate(CONTRACTS, tmp_path)
    installed = sorted(p for p in INSTALLED.iterdir() if codegen.is_generated(p))
    assert [p.name for p in installed] == [p.name for p in fresh], REINSTALL
    differ = [p.name for p in fresh if not filecmp.cmp(p, INSTALLED / p.name, shallow=False)]
    assert not differ, f"{REINSTALL} ({', '.join(differ)} differ)"


def test_every_proto_generates_message_and_service_modules(tmp_path):
    names = {p.name for p in codegen.generate(CONTRACTS, tmp_path)}
    for proto in codegen.proto_files(CONTRACTS):
        stem = proto.stem
        assert {f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"} <= names


def test_generation_failure_names_the_exit_status(tmp_path):
    bad = tmp_path / "contracts" / "v1"
    bad.mkdir(parents=True)
    (bad / "broken.proto").write_text('syntax = "proto3"; message {')
    with pytest.raises(RuntimeError, match="exit status"):
        codegen.generate(tmp_path / "contracts", tmp_path / "out")
