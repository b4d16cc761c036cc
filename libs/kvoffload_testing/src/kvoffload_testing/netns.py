"""A network namespace joined to this one by a veth pair (Debian's iproute2, ``ip netns``), for P/D
across two network stacks: this namespace's end is ``HERE`` (10.231.0.1), the namespace's ``THERE``
(10.231.0.2), a /30 between them, so every byte between a process here and one run there with
``in_namespace`` crosses a real network stack, not loopback. ``split_decode`` moves a stack's
decode there (tests and ``bench pd``). Needs root; a missing ``ip`` fails, never skips."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from kvoffload_testing.stack import Stack, StackConfig

HERE, THERE = "10.231.0.1", "10.231.0.2"  # this namespace's end of the veth, the other namespace's
IP = shutil.which("ip") or "/usr/sbin/ip"


def ip(*args: str) -> None:
    subprocess.run([IP, *args], check=True, capture_output=True, text=True, timeout=30)


@contextmanager
def veth_namespace() -> Iterator[str]:
    """A new network namespace (its name) behind a veth pair to this one; both removed after."""
    name, tag = f"kvd-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:6]
    here, there = f"kvh{tag}", f"kvt{tag}"
    ip("netns", "add", name)
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", name)
        ip("addr", "add", f"{HERE}/30", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", name, "addr", "add", f"{THERE}/30", "dev", there)
        ip("-n", name, "link", "set", there, "up")
        ip("-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        subprocess.run([IP, "link", "del", here], capture_output=True, timeout=30)
        subprocess.run([IP, "netns", "del", name], capture_output=True, timeout=30)


def in_namespace(namespace: str, argv: list[str]) -> list[str]:
    """``argv`` run inside ``namespace`` (``ip netns exec`` execs it: the pid is the command's own)."""
    return [IP, "netns", "exec", namespace, *argv]


def split_decode(commands: list[tuple[str, list[str], str]], namespace: str) -> list[tuple[str, list[str], str]]:
    """A stack's ``commands`` (name, argv, health URL; its services on ``HERE``) with ``decode-0`` run in
    ``namespace`` on ``THERE`` (its --host and health URL there) and the proxy sending to it there."""
    out = []
    for name, argv, health in commands:
        if name == "decode-0":
            argv = [*in_namespace(namespace, argv), "--host", THERE]
            health = health.replace(HERE, THERE)
        if name == "proxy":
            argv = [*argv, "--decoder-hosts", THERE]
        out.append((name, argv, health))
    return out


class SplitStack(Stack):
    """The reference stack (its services on ``HERE``: ``cfg.host``) with its decode in ``namespace`` on
    ``THERE`` (``split_decode``). Give the decode a host id of its own (``KVOFFLOAD_HOST_ID`` in its
    ``service_env``): the namespaces share /dev/shm, and a decode of the prefill's host id would read
    its shared memory instead of the network."""

    def __init__(self, cfg: StackConfig, namespace: str) -> None:
        self.namespace = namespace
        super().__init__(cfg)

    def commands(self) -> list[tuple[str, list[str], str]]:
        return split_decode(super().commands(), self.namespace)
