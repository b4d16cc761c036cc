"""``MooncakeStore``: one connected Mooncake Store client, with bounded connect, batches split at
1024 keys, and Mooncake's integer error codes turned into ``MooncakeStoreError``s naming the cause.

It wraps ``mooncake.store.MooncakeDistributedStore`` (wheel ``mooncake-transfer-engine-non-cuda``,
imported only here and only when a store is connected, so ``import poolbackends`` never needs it)
configured for TCP with the P2P handshake (no metadata server). ``connect`` first checks that the
master's RPC port answers (``connect_timeout_s``): the client's own ``setup`` would retry for 90 s.
The client contributes ``global_segment_bytes`` of its memory to the store (a "segment", named
``segment_name``); every object this client puts is hard-pinned (the master never evicts it) and
placed in this client's own segment, so it lives exactly until it is removed or this client dies
(the master drops a dead client's segment after its ``--client_ttl``). A client of
``global_segment_bytes=0`` and ``local_buffer_bytes=0`` mounts and registers nothing: it only asks
(``poolbackends.mooncake_lookup``). ``address_toward(master)``: this host's address on the route to
the master, where its peers (which reach that master) can reach it too.

Batch calls return one code per key (0 or a size: success; negative: ``CODES``) and are split into
chunks of ``MAX_BATCH_KEYS``: cross-process batches of more than 1024 keys fail with -800
(TRANSFER_FAIL) in this wheel. A master restart loses every key; the client re-mounts its segment by
itself within about a second (meanwhile puts fail with -200 and every call with -900 while no master
answers; once a call met -900, the next ones fail at once while the master's port does not answer,
instead of waiting ~4 s each for the wheel's reconnect). One ``MooncakeStore`` may serve several
pools (each with its own key namespace).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvcore.pool.host_pool import ObjectUnreachable, PoolError
from poolbackends.mooncake_master import INSTALL_HINT, MooncakeNotInstalled, port_answers

MAX_BATCH_KEYS = 1024
DOWN_PROBE_S = 0.5  # while the master is down: how long a call waits for its port before failing

OK = 0
NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

CODES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE (no room in any mounted segment, or the segment is not mounted yet)",
    -400: "INVALID_KEY",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL (the master does not answer: down or restarting)",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}


class MooncakeStoreError(PoolError):
    """A Mooncake Store call failed; ``code`` is Mooncake's error code (``CODES``)."""

    def __init__(self, message: str, *, code: int, key: bytes | None = None) -> None:
        super().__init__(message, key=key)
        self.code = code


class MooncakeObjectsUnreachable(MooncakeStoreError, ObjectUnreachable):
    """A read met objects the master lists whose owner's segment does not answer (its process is
    gone); they were force-removed from the store."""


def address_toward(master: str) -> str:
    """This host's IPv4 address on the route to ``master`` (``host:port``; no packet is sent): where a
    peer that reaches the master reaches this host (127.0.0.1 for a master on loopback)."""
    host, _, port = master.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, int(port)))
        except OSError as e:
            raise MooncakeStoreError(f"no route to the mooncake_master at {master}: {e}", code=RPC_FAIL) from None
        return str(s.getsockname()[0])


def code_name(code: int) -> str:
    return f"{code} {CODES.get(code, 'unknown Mooncake error')}"


def _store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise MooncakeNotInstalled(f"cannot import mooncake.store ({e}); {INSTALL_HINT}") from e
    return MooncakeDistributedStore


def _chunked(call: Callable[..., list[int]], n: int, *lists: Sequence[Any], **kw: Any) -> list[int]:
    """``call(*lists)`` over chunks of ``MAX_BATCH_KEYS`` rows; the codes concatenated."""
    if n <= MAX_BATCH_KEYS:
        return list(call(*(list(x) for x in lists), **kw))
    out: list[int] = []
    for i in range(0, n, MAX_BATCH_KEYS):
        out += call(*(list(x[i : i + MAX_BATCH_KEYS]) for x in lists), **kw)
    return out


class MooncakeStore:
    """One Mooncake Store client (see the module docstring). Thread-safe: the wheel's client is."""

    def __init__(self, store: Any, master: str, protocol: str) -> None:
        self._store = store
        self.master = master
        self.protocol = protocol
        self.segment_name: str = store.get_hostname()
        self._put_config = self._replicate_config()
        self._lock = threading.Lock()
        self._closed = False
        host, _, port = master.rpartition(":")
        self._master_at = (host, int(port))
        self._down = False  # the last call met RPC_FAIL: probe the master's port before the next

    @classmethod
    def connect(
        cls,
        master: str,
        *,
        global_segment_bytes: int,
        local_buffer_bytes: int = 16 << 20,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        rdma_devices: str = "",
        connect_timeout_s: float = 5.0,
    ) -> MooncakeStore:
        """Connect to the ``mooncake_master`` at ``master`` (``host:port``) and mount a segment of
        ``global_segment_bytes``. ``MooncakeStoreError`` if no master answers within ``connect_timeout_s``."""
        host, sep, port = master.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"master must be 'host:port' of a mooncake_master, got {master!r}")
        if not isinstance(global_segment_bytes, int) or global_segment_bytes < 0 or 0 < global_segment_bytes < 1 << 20:
            raise ValueError(f"global_segment_bytes must be an int >= 1 MiB (or 0: none), got {global_segment_bytes!r}")
        store_cls = _store_class()
        if not port_answers(host, int(port), connect_timeout_s):
            raise MooncakeStoreError(
                f"no mooncake_master answers at {master} (within {connect_timeout_s} s): start one "
                f"(`kvoffload up --pool mooncake`, or poolbackends.mooncake_master.MooncakeMaster.start) or fix "
                f"the address",
                code=RPC_FAIL,
            )
        store = store_cls()
        rc = store.setup(
            {
                "local_hostname": local_hostname,
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": global_segment_bytes,
                "local_buffer_size": local_buffer_bytes,
                "protocol": protocol,
                "rdma_devices": rdma_devices,
                "master_server_addr": master,
            }
        )
        if rc != 0:
            raise MooncakeStoreError(
                f"Mooncake Store setup against master {master} failed with {code_name(rc)} "
                f"(segment {global_segment_bytes} B, protocol {protocol!r})",
                code=rc,
            )
        return cls(store, master, protocol)

    def _replicate_config(self) -> Any:
        from mooncake.store import ReplicateConfig

        cfg = ReplicateConfig()
        cfg.replica_num = 1
        cfg.with_hard_pin = True  # the owner alone removes its objects; the master never evicts them
        cfg.preferred_segment = self.segment_name  # they live (and die) with this client's segment
        return cfg

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError(f"Mooncake Store client of master {self.master} is closed")

    # ---- buffers -------------------------------------------------------------------------------

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` of host memory at address ``ptr`` for zero-copy transfers."""
        self._check_open()
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise MooncakeStoreError(f"register_buffer of {nbytes} B failed with {code_name(rc)}", code=rc)

    def unregister(self, ptr: int) -> None:
        if not self._closed:
            self._store.unregister_buffer(ptr)

    # ---- batches (one code per key) --------------------------------------------------------------

    def put_parts(self, keys: Sequence[str], ptrs: Sequence[list[int]], sizes: Sequence[list[int]]) -> list[int]:
        """Put each key as the concatenation of its parts (registered memory), hard-pinned in this segment."""
        self._check_open()
        return self._batch(
            self._store.batch_put_from_multi_buffers, len(keys), keys, ptrs, sizes, config=self._put_config
        )

    def get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Read whole objects into ``ptrs`` (bytes read, or a negative code); grants the master's read lease."""
        self._check_open()
        return self._batch(self._store.batch_get_into, len(keys), keys, ptrs, sizes)

    def exists(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 per key, or a negative code; like a read, it grants the master's lease on existing keys."""
        self._check_open()
        return self._batch(self._store.batch_is_exist, len(keys), keys)

    def remove(self, keys: Sequence[str], *, force: bool = False) -> list[int]:
        """0, ``OBJECT_NOT_FOUND``, ``OBJECT_HAS_LEASE`` (unless ``force``) or another code per key."""
        self._check_open()
        return self._batch(self._store.batch_remove, len(keys), keys, force=force)

    def _batch(self, call: Callable[..., list[int]], n: int, *lists: Sequence[Any], **kw: Any) -> list[int]:
        """``_chunked(call, ...)``, except around a master that went down: after a call met RPC_FAIL,
        the next ones first see whether its port answers, and answer RPC_FAIL for every key at once
        when it does not (the wheel's client would try to reconnect for ~4 s per call); a call that
        meets RPC_FAIL while the port answers is made once more (the first call on a connection to a
        master that restarted fails, the next reconnects). Every batch here may be made twice: a put
        of a key already there is a no-op, a remove of one gone is OBJECT_NOT_FOUND."""
        if self._down and not port_answers(*self._master_at, DOWN_PROBE_S):
            return [RPC_FAIL] * n
        codes = _chunked(call, n, *lists, **kw)
        if RPC_FAIL in codes and port_answers(*self._master_at, DOWN_PROBE_S):
            codes = _chunked(call, n, *lists, **kw)
        self._down = RPC_FAIL in codes
        return codes

    # ---- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmount the segment (its objects go) and disconnect; takes about 2 s. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._store.close()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"MooncakeStore(master={self.master!r}, segment={self.segment_name!r}, {state})"
