"""A network namespace joined to this one by a veth pair (Debian's iproute2, ``ip netns``), for P/D
across two network stacks: this namespace's end of the pair is ``Veth.here``, the namespace's
``Veth.there``, a /30 between them, so every byte between a process here and one run there with
``in_namespace`` crosses a real network stack, not loopback. ``split_decode`` moves a stack's
decode there (tests and ``bench pd``). ``namespace_pair``: two such namespaces that also reach each
other, as two hosts of one network do. Needs root; a missing ``ip`` fails, never skips.

Each pair gets a /30 of its own (10.231.N.0/30, the lowest N no interface of this namespace has), taken
under a file lock: two test modules (or a test and a bench) making pairs at once on one machine must
never give two interfaces the same address, or the kernel routes one stack's bytes into the other's
namespace."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvoffload_testing.stack import Stack, StackConfig

IP = shutil.which("ip") or "/usr/sbin/ip"
SUBNETS = 256  # 10.231.0.0/30 ... 10.231.255.0/30
LOCK = Path("/tmp/kvoffload-netns.lock")  # every process that makes pairs on this machine takes it


@dataclass(frozen=True)
class Veth:
    """A namespace behind a veth pair: its name, this namespace's address and the namespace's."""

    name: str
    here: str
    there: str


def ip(*args: str) -> str:
    return subprocess.run([IP, *args], check=True, capture_output=True, text=True, timeout=30).stdout


def _free_subnet() -> int:
    """The lowest N whose 10.231.N.1 and .2 no interface of this namespace holds (under ``LOCK``)."""
    held = ip("-o", "-4", "addr", "show")
    for n in range(SUBNETS):
        if f" 10.231.{n}.1/" not in held and f" 10.231.{n}.2/" not in held:
            return n
    raise RuntimeError(f"every one of the {SUBNETS} subnets 10.231.N.0/30 is taken by an interface here")


@contextmanager
def veth_namespace() -> Iterator[Veth]:
    """A new network namespace behind a veth pair to this one, on a /30 of its own; both removed after."""
    name, tag = f"kvd-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:6]
    here, there = f"kvh{tag}", f"kvt{tag}"
    ip("netns", "add", name)
    try:
        with LOCK.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the address is on the interface
            n = _free_subnet()
            veth = Veth(name, f"10.231.{n}.1", f"10.231.{n}.2")
            ip("link", "add", here, "type", "veth", "peer", "name", there)
            ip("link", "set", there, "netns", name)
            ip("addr", "add", f"{veth.here}/30", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", name, "addr", "add", f"{veth.there}/30", "dev", there)
        ip("-n", name, "link", "set", there, "up")
        ip("-n", name, "link", "set", "lo", "up")
        yield veth
    finally:
        subprocess.run([IP, "link", "del", here], capture_output=True, timeout=30)
        subprocess.run([IP, "netns", "del", name], capture_output=True, timeout=30)


@contextmanager
def namespace_pair() -> Iterator[tuple[Veth, Veth]]:
    """Two namespaces behind veth pairs to this one (``veth_namespace``), each routing everything else
    through its pair (so either reaches any address of this namespace, e.g. a server bound to the other's
    ``here``), and linked to each other by a veth pair of their own: a process in one reaches the other's
    ``there`` over that link, not forwarded through this namespace (whose firewall may drop forwarded
    packets: Docker's FORWARD policy). Everything is removed with the namespaces."""
    with veth_namespace() as a, veth_namespace() as b:
        for v in (a, b):
            ip("-n", v.name, "route", "add", "default", "via", v.here)
        tag = uuid.uuid4().hex[:6]
        ends = ((a, f"kva{tag}", b), (b, f"kvb{tag}", a))
        ip("link", "add", ends[0][1], "type", "veth", "peer", "name", ends[1][1])
        for v, end, other in ends:
            ip("link", "set", end, "netns", v.name)
            ip("-n", v.name, "link", "set", end, "up")
            ip("-n", v.name, "route", "add", f"{other.there}/32", "dev", end)
        yield a, b


def in_namespace(namespace: str, argv: list[str]) -> list[str]:
    """``argv`` run inside ``namespace`` (``ip netns exec`` execs it: the pid is the command's own)."""
    return [IP, "netns", "exec", namespace, *argv]


def split_decode(commands: list[tuple[str, list[str], str]], veth: Veth) -> list[tuple[str, list[str], str]]:
    """A stack's ``commands`` (name, argv, health URL; its services on ``veth.here``) with ``decode-0``
    run in the namespace on ``veth.there`` (its --host and health URL there) and the proxy sending to it
    there."""
    out = []
    for name, argv, health in commands:
        if name == "decode-0":
            argv = [*in_namespace(veth.name, argv), "--host", veth.there]
            health = health.replace(veth.here, veth.there)
        if name == "proxy":
            argv = [*argv, "--decoder-hosts", veth.there]
        out.append((name, argv, health))
    return out


class SplitStack(Stack):
    """The reference stack (its services on ``veth.here``: ``cfg.host``) with its decode in the veth's
    namespace on ``veth.there`` (``split_decode``). Give the decode a host id of its own
    (``KVOFFLOAD_HOST_ID`` in its ``service_env``): the namespaces share /dev/shm, and a decode of the
    prefill's host id would read its shared memory instead of the network."""

    def __init__(self, cfg: StackConfig, veth: Veth) -> None:
        self.veth = veth
        super().__init__(cfg)

    def commands(self) -> list[tuple[str, list[str], str]]:
        return split_decode(super().commands(), self.veth)
