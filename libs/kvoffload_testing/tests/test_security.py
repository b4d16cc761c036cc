"""Code-base guards for the security defaults: every gRPC channel and port goes through svcruntime.tls
(so --tls-* reach all of them), and the stack hands every gRPC service the TLS flags and the proxy
its key through the environment only. (No pickle / eval: tests/integration/test_no_pickle.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

from kvoffload_testing.stack import API_KEY_ENV, Stack, StackConfig
from svcruntime.tls import TLSConfig

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted(
    p
    for pattern in ("libs/*/src/**/*.py", "services/*/src/**/*.py", "kvoffload/*.py")
    for p in ROOT.glob(pattern)
    if "_pb2" not in p.name
)
GRPC_RAW = {"insecure_channel", "secure_channel", "add_insecure_port", "add_secure_port"}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            yield node, f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def test_sources_found():
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert (
        "libs/svcruntime/src/svcruntime/tls.py" in names
        and "libs/kvoffload_testing/src/kvoffload_testing/stack.py" in names
    )
    assert any(n.startswith("services/proxy/") for n in names)


def test_every_grpc_channel_and_port_goes_through_svcruntime_tls():
    offenders = []
    for path in SOURCES:
        if path.name == "tls.py" and path.parent.name == "svcruntime":
            continue
        for node, name in _calls(ast.parse(path.read_text(), str(path))):
            if name in GRPC_RAW:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not offenders, "use svcruntime.tls.secure_or_insecure_channel / add_port:\n" + "\n".join(offenders)


def test_stack_passes_tls_to_every_grpc_service_and_the_key_by_environment(tmp_path):
    (tmp_path / "c.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "k.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    tls = TLSConfig.load(tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "c.pem")
    plain = Stack(StackConfig(model=tmp_path, log_dir=tmp_path)).commands()
    assert not any("--tls" in " ".join(argv) for _, argv, _ in plain)  # default unchanged: no TLS
    cmds = {
        name: argv
        for name, argv, _ in Stack(StackConfig(model=tmp_path, log_dir=tmp_path, tls=tls, api_key="k3y")).commands()
    }
    for name in ("metastore", "decode-0", "prefill-0"):
        argv = cmds[name]
        assert argv[argv.index("--tls-cert") + 1] == str(tmp_path / "c.pem"), name
        assert argv[argv.index("--tls-key") + 1] == str(tmp_path / "k.pem"), name
        assert argv[argv.index("--tls-ca") + 1] == str(tmp_path / "c.pem"), name
        assert argv[argv.index("--host") + 1] == "127.0.0.1", name
    assert "--tls-cert" not in cmds["proxy"]  # HTTP only
    assert "k3y" not in str(cmds) and API_KEY_ENV == "KVOFFLOAD_API_KEY"
