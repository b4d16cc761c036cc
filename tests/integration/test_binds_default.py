"""Security defaults through real processes: a metastore, a prefill, a decode and a proxy started
with no ``--host`` (``kvoffload_testing.stack``'s command lines less that flag) and no TLS flags listen on
127.0.0.1 only — every listening TCP socket each process holds, read from /proc (its socket fd
inodes matched against /proc/<pid>/net/tcp{,6}) — and their gRPC ports answer plain gRPC.

Linux only (/proc). A default changed to 0.0.0.0 or :: shows up here as a non-loopback socket."""

from __future__ import annotations

import sys

import pytest
from sockets import listening_sockets

from kvoffload_testing.ports import DATA_PORT_OFFSET, free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import stack_stats
from kvoffload_testing.stack_config import ensure_tiny_model

pytestmark = [
    pytest.mark.stack,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads listening sockets from /proc"),
    pytest.mark.slow,
]


class DefaultHostStack(Stack):
    """The stack's own command lines without their ``--host`` (flags from ``service_args`` stay)."""

    def commands(self):
        out = []
        for name, argv, health in super().commands():
            i = argv.index("--host")  # the stack's one; a ValueError here means it no longer passes one
            out.append((name, argv[:i] + argv[i + 2 :], health))
        return out


def expected_ports(cfg: StackConfig) -> dict[str, set[int]]:
    """The ports each service must be listening on (what the stack dials)."""
    out = {"metastore": {cfg.metastore_port}, "proxy": {cfg.proxy_port}}
    for i, port in enumerate(cfg.prefill_ports):
        out[f"prefill-{i}"] = {port, port + DATA_PORT_OFFSET}
    for i, port in enumerate(cfg.decode_ports):
        out[f"decode-{i}"] = {port, cfg.kv_port + 16 * i}
    return out


def default_host_config(model, log_dir, service_args: dict[str, list[str]] | None = None) -> StackConfig:
    return StackConfig(
        model=model,
        log_dir=log_dir,
        **free_stack_ports(),
        max_model_len=1024,
        prefill_pool_gb=0.01,
        service_args=service_args or {},
    )


def non_loopback_binds(stack: Stack) -> list[str]:
    """What is wrong with the stack's listening sockets: a socket off 127.0.0.1, a port not listened
    on (so the check looked at the real sockets), a service with none at all."""
    problems = []
    for name, ports in expected_ports(stack.cfg).items():
        sockets = listening_sockets(stack.process(name).pid)
        if not sockets:
            problems.append(f"{name}: no listening socket at all")
        if missing := ports - {port for _, port in sockets}:
            problems.append(f"{name}: not listening on {sorted(missing)}; it listens on {sockets}")
        if off := [s for s in sockets if s[0] != "127.0.0.1"]:
            problems.append(f"{name}: listens off loopback on {off}")
    return problems


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("binds")
    model = ensure_tiny_model(tmp / "tiny")
    with DefaultHostStack(default_host_config(model, tmp / "logs")) as s:
        yield s


def test_no_service_passes_host(stack):
    for name, argv, _ in stack.commands():
        assert "--host" not in argv, (name, argv)


def test_every_service_listens_on_loopback_only_by_default(stack):
    assert set(expected_ports(stack.cfg)) == {name for name, _, _ in stack.commands()}
    assert non_loopback_binds(stack) == []


def test_grpc_is_plain_by_default(stack):
    """No TLS flags: the metastore, the prefill's data port and the decode's control port answer
    Stats over plain gRPC."""
    assert stack.cfg.tls is None
    stats = stack_stats(stack.cfg)
    assert set(stats) == {"metastore", "prefill-0", "decode-0"}
    assert all(stats.values()), stats  # counters came back from each
