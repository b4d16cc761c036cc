"""Test support: the listening TCP sockets of a process (and its children), read from /proc, so a
test can check where a real service actually bound, not what its flags default to."""

from __future__ import annotations

import os
import socket


def _proc_addr(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6} (32-bit words in host order, little-endian here) as text;
    IPv4-mapped IPv6 (gRPC's dual-stack sockets) as the IPv4 address."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return addr.removeprefix("::ffff:") if "." in addr else addr


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (a service that forks a helper holds sockets there too)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except FileNotFoundError:
                pass
    return out


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket (IPv4 and IPv6) held by ``pid`` or a child."""
    out = []
    for p in _descendants(pid):
        inodes = set()
        for fd in os.listdir(f"/proc/{p}/fd"):
            try:
                target = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{p}/net/{table}") as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    local, state, inode = fields[1], fields[3], fields[9]
                    if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                        addr, port = local.rsplit(":", 1)
                        out.append((_proc_addr(addr), int(port, 16)))
    return sorted(set(out))
