"""Loopback ports for a stack: which are free now, below Linux's ephemeral range.

A stack's ports follow one layout (``free_stack_ports``: the proxy, the prefills, the decodes, the
metastore, the decodes' control ports, a mooncake_master's); a prefill's gRPC data port is its HTTP
port + ``DATA_PORT_OFFSET``.
"""

from __future__ import annotations

import random
import socket

DATA_PORT_OFFSET = 10000  # a prefill's gRPC (LayerSource, Health, Stats) port = its HTTP port + this


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port_base(offsets: tuple[int, ...] = (0, 1, 2, 3, 20, 1 + DATA_PORT_OFFSET)) -> int:
    """A base port such that ``base + offset`` is free now for every offset (by default a one-prefill,
    one-decode stack: proxy, prefill, decode, metastore, kv port, the prefill's data port), all below
    Linux's ephemeral range (32768+): a port there can be taken at any moment by an outgoing
    connection's local end, and a service's bind then fails."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(11000, 32768 - max(offsets), 10)
        if all(port_is_free(base + o) for o in offsets):
            return base
    raise RuntimeError(f"no free ports for offsets {offsets} below 32768")


def free_stack_ports(prefills: int = 1, decodes: int = 1, mooncake: bool = False, decode_tp: int = 1) -> dict:
    """StackConfig's port fields for a stack of ``prefills`` and ``decodes`` whose every port (HTTP,
    the prefills' data ports, the metastore, the decodes' control ports, with ``mooncake`` the
    mooncake_master's RPC and metrics ports) is free now and below the ephemeral range:
    ``StackConfig(model=..., log_dir=..., **free_stack_ports())``.

    A decode of ``decode_tp`` ranks listens on ``decode_tp`` consecutive control ports (rank t on its
    control port + t), and every one of them is checked: whether the decodes are deployments of their
    own (decode i's control port ``kv_port + 16 i``) or the DP ranks of one (``kv_port + i x tp``)."""
    if not 1 <= decode_tp <= 16 // max(1, decodes):
        raise ValueError(f"decode_tp: got {decode_tp}; {decodes} decodes of it must fit 16 control ports")
    kv = 2 + prefills + decodes
    master: tuple[int, ...] = (kv + 16 * decodes, kv + 16 * decodes + 1) if mooncake else ()
    control = {kv + 16 * i + t for i in range(decodes) for t in range(decode_tp)}  # separate deployments
    control |= {kv + i * decode_tp + t for i in range(decodes) for t in range(decode_tp)}  # DP ranks of one
    offsets = (
        *range(kv),
        *(1 + i + DATA_PORT_OFFSET for i in range(prefills)),
        *sorted(control),
        *master,
    )
    base = free_port_base(offsets)
    ports = {
        "proxy_port": base,
        "prefill_ports": tuple(range(base + 1, base + 1 + prefills)),
        "decode_ports": tuple(range(base + 1 + prefills, base + 1 + prefills + decodes)),
        "metastore_port": base + 1 + prefills + decodes,
        "kv_port": base + kv,
    }
    if mooncake:
        ports.update(mooncake_port=base + master[0], mooncake_metrics_port=base + master[1])
    return ports
