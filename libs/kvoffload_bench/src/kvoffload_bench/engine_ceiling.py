"""``bench pd``'s ``idle_mooncake_*`` diagnostic: Mooncake Transfer Engine's own rate on this host,
outside any stack, against a memcpy of the same bytes.

A child process starts an engine and registers ``pool_bytes`` of host memory; this process starts
its own and reads ``read_bytes`` at a time out of it (one range per batched read over TCP: the
transport's best case), taking turns with a ``copy_`` of the same bytes between cold buffers of
its own, ``reps`` times each. Over TCP the bytes go through the kernel twice (the peer's send, this
side's receive) besides the engine's own slicing, so ``idle_mooncake_ratio_to_memcpy`` is the
ceiling any pull over it can reach on this machine: an in-stack ratio far below it points at the
load, one close to it at the transport.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import torch

_PEER = """
import sys, torch
from pdlink.mooncake_transfer import MooncakeTransfer
transfer = MooncakeTransfer.start("127.0.0.1")
pool = torch.ones({pool_bytes}, dtype=torch.uint8)
transfer.register(pool.data_ptr(), pool.numel())
print("READY", transfer.session, pool.data_ptr(), flush=True)
sys.stdin.read()  # until the reader is done
"""


def mooncake_ceiling(read_bytes: int = 16 << 20, pool_bytes: int = 256 << 20, reps: int = 8) -> dict:
    """``idle_mooncake_gbps``, ``idle_mooncake_memcpy_gbps`` (each bytes over seconds, summed over the
    ``reps`` reads / copies, which take turns) and ``idle_mooncake_ratio_to_memcpy``, with
    ``idle_mooncake_read_bytes``. RuntimeError when the peer engine cannot start."""
    from pdlink.mooncake_transfer import MooncakeTransfer

    if not 0 < read_bytes <= pool_bytes:
        raise ValueError(f"read_bytes must be in (0, pool_bytes={pool_bytes}], got {read_bytes}")
    peer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_PEER.format(pool_bytes=pool_bytes))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert peer.stdout is not None
        ready = next((line for line in peer.stdout if line.startswith("READY ")), "")
        if not ready:
            raise RuntimeError(f"the peer Transfer Engine did not start (exit {peer.wait(timeout=30)})")
        _, session, address = ready.split()
        transfer = MooncakeTransfer.start("127.0.0.1")
        dst = torch.zeros(pool_bytes, dtype=torch.uint8)
        src = torch.ones(pool_bytes, dtype=torch.uint8)
        transfer.register(dst.data_ptr(), pool_bytes)
        try:
            spans = pool_bytes // read_bytes
            transfer.read(session, [dst.data_ptr()], [int(address)], [read_bytes])  # the handshake, untimed
            engine_s = copy_s = 0.0
            for i in range(reps):
                off = (i % spans) * read_bytes
                t = time.perf_counter()
                transfer.read(session, [dst.data_ptr() + off], [int(address) + off], [read_bytes])
                engine_s += time.perf_counter() - t
                off = ((i + spans // 2) % spans) * read_bytes  # other bytes than the read's: cold
                t = time.perf_counter()
                dst[off : off + read_bytes].copy_(src[off : off + read_bytes])
                copy_s += time.perf_counter() - t
        finally:
            transfer.close()
    finally:
        if peer.stdin is not None:
            peer.stdin.close()
        peer.wait(timeout=30)
    engine, memcpy = reps * read_bytes / engine_s / 1e9, reps * read_bytes / copy_s / 1e9
    return {
        "idle_mooncake_read_bytes": read_bytes,
        "idle_mooncake_gbps": engine,
        "idle_mooncake_memcpy_gbps": memcpy,
        "idle_mooncake_ratio_to_memcpy": engine / memcpy,
    }
