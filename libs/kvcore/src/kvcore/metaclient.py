"""``MetaStoreClient``: the MetaStore (``kvoffload.v1.MetaStore``) over gRPC, shaped like the index
hooks of ``kvcore.hostpool.HostPoolBackend``; plus the registry errors and records it hands out.

grpc and the generated stubs (``kvoffload_proto.v1``) are imported when a client is built, never at
import time, so ``import kvcore`` and every other kvcore module work without them.

Every call carries a deadline (``timeout_s``). Failures raise the same types as kvcore's pools
(``ObjectNotFound``, ``ObjectExists``, ``ObjectLeased``, ``PoolFullError`` with its numbers,
``LeaseExpired``, ``ValueError`` for bad input) or the registry errors defined here
(``PoolNotRegistered``, ``PoolConflict``, ``WorldSizeExceeded``, ``NoPoolRegistered``); a MetaStore
that cannot be reached or does not answer in time is ``MetaStoreUnavailable``. Nothing is retried
here: the caller owns retry policy. The metastore service re-exports these error types, so its
servicer and this client agree on one vocabulary (``ERROR_MD``/``KEY_MD``/``FULL_MD`` are the
trailing-metadata keys that carry type, key and numbers across the wire).

Constructed with ``pool_id`` (a LocalService's view of its own pool), ``alloc`` places objects in
that pool only and ``stats`` reports it. The client moves no bytes: ``kvcore.remotepool.
RemoteHostPool`` is the full ``HostPoolBackend`` that copies in shared memory at the block ids
handed out here and reports each written plane with ``mark_written``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcore.hostpool import (
    LeaseExpired,
    ObjectExists,
    ObjectLeased,
    ObjectNotFound,
    PoolError,
    PoolFullError,
    PoolStats,
)
from kvcore.segment import PoolGeometry
from kvcore.tls import PROCESS, secure_or_insecure_channel

if TYPE_CHECKING:
    import grpc

ERROR_MD = "kvoffload-error"          # exception class name
KEY_MD = "kvoffload-key-bin"          # offending key, raw bytes
FULL_MD = {  # PoolFullError attribute -> trailing metadata key on RESOURCE_EXHAUSTED
    "needed": "kvoffload-needed-blocks", "free": "kvoffload-free-blocks",
    "evictable": "kvoffload-evictable-blocks", "num_blocks": "kvoffload-num-blocks",
}


# --------------------------------------------------------------------------------------------
# Registry errors (object errors are kvcore.hostpool's)
# --------------------------------------------------------------------------------------------


class PoolNotRegistered(PoolError):
    """No live pool with this id (never registered, deregistered, or expired)."""


class PoolConflict(PoolError):
    """``register_pool`` of a live pool id with another segment or geometry (and no ``replace``)."""


class WorldSizeExceeded(PoolError):
    """``world_size`` pools are registered already."""


class NoPoolRegistered(PoolError):
    """``alloc`` while no pool is registered."""


class MetaStoreUnavailable(PoolError):
    """The MetaStore could not be reached or did not answer in time (client side only).

    ``code`` is the ``grpc.StatusCode`` of the failed call (None if there was none)."""

    def __init__(self, message: str, *, code: Any = None) -> None:
        super().__init__(message)
        self.code = code


# Types a client rebuilds from the ERROR_MD name (never anything else: no eval of network data),
# with the status code name the servicer sends them under (metastore.proto).
STATUS_NAMES: dict[type[PoolError], str] = {
    ObjectNotFound: "NOT_FOUND", LeaseExpired: "NOT_FOUND", PoolNotRegistered: "NOT_FOUND",
    ObjectExists: "ALREADY_EXISTS", PoolConflict: "ALREADY_EXISTS",
    ObjectLeased: "FAILED_PRECONDITION", WorldSizeExceeded: "FAILED_PRECONDITION",
    NoPoolRegistered: "FAILED_PRECONDITION",
}
BY_NAME: dict[str, type[PoolError]] = {t.__name__: t for t in STATUS_NAMES}
_UNREACHABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")


# --------------------------------------------------------------------------------------------
# Records (what the client hands out; immutable snapshots)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolRecord:
    """A registered pool: ``segment_name`` to ``SharedSegment.attach`` on host ``host``."""

    pool_id: str
    segment_name: str
    host: str
    geometry: PoolGeometry

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes


@dataclass(frozen=True)
class Location:
    key: bytes
    pool_id: str
    block_id: int
    size_bytes: int
    written_planes: tuple[int, ...]
    complete: bool


@dataclass(frozen=True)
class Allocation:
    pool: PoolRecord
    block_ids: list[int]
    evicted: int


# --------------------------------------------------------------------------------------------
# Wire conversions (grpc and the stubs are loaded lazily)
# --------------------------------------------------------------------------------------------


def _wire() -> tuple[Any, Any, Any]:
    """(grpc, metastore_pb2, metastore_pb2_grpc), imported on first use."""
    try:
        grpc = importlib.import_module("grpc")
        pb = importlib.import_module("kvoffload_proto.v1.metastore_pb2")
        pb_grpc = importlib.import_module("kvoffload_proto.v1.metastore_pb2_grpc")
    except ImportError as e:
        raise ImportError(f"the MetaStore client needs grpcio and kvoffload-proto ({e}); install kvoffload-kvcore "
                          f"with its dependencies") from e
    return grpc, pb, pb_grpc


def geometry_from_pb(g: Any) -> PoolGeometry:
    return PoolGeometry(g.block_size, tuple(g.plane_row_bytes), g.num_blocks,
                        tuple((label.layer, label.kind) for label in g.plane_labels))


def geometry_to_pb(g: PoolGeometry) -> Any:
    pb = _wire()[1]
    return pb.PoolGeometry(block_size=g.block_size, plane_row_bytes=g.plane_row_bytes, num_blocks=g.num_blocks,
                           plane_labels=[pb.PlaneLabel(layer=layer, kind=kind) for layer, kind in g.plane_labels])


def _record(p: Any) -> PoolRecord:
    return PoolRecord(p.pool_id, p.segment_name, p.host, geometry_from_pb(p.geometry))


def _location(loc: Any) -> Location:
    return Location(loc.key, loc.pool_id, loc.block_id, loc.size_bytes, tuple(loc.written_planes), loc.complete)


def error_from_rpc(e: "grpc.RpcError", method: str) -> Exception:
    """The typed exception of a failed call; never evaluates network data."""
    code, details = e.code(), e.details() or ""
    md = dict(e.trailing_metadata() or ())
    key = md.get(KEY_MD)
    key = key if isinstance(key, bytes) else None
    if code.name == "RESOURCE_EXHAUSTED":
        n = {name: int(md.get(mdkey, 0)) for name, mdkey in FULL_MD.items()}
        exc = PoolFullError(key=key, needed=n["needed"], free=n["free"], evictable=n["evictable"],
                            num_blocks=n["num_blocks"])
        exc.args = (details,)
        return exc
    cls = BY_NAME.get(str(md.get(ERROR_MD, "")))
    if cls is not None and STATUS_NAMES[cls] == code.name:
        return cls(details, key=key)
    if code.name == "INVALID_ARGUMENT":
        return ValueError(details)
    if code.name in _UNREACHABLE:
        return MetaStoreUnavailable(f"MetaStore {method}: {code.name}: {details}", code=code)
    return PoolError(f"MetaStore {method}: {code.name}: {details}", key=key)


# --------------------------------------------------------------------------------------------
# Leases
# --------------------------------------------------------------------------------------------


class RemoteLease:
    """A MetaStore lease, shaped like ``kvcore.leases.Lease``.

    ``deadline`` is ``time.monotonic()`` seconds of this process, counted from when the request was
    sent (so it errs early). The holder calls ``release()`` (idempotent; also on ``with`` exit) or
    lets it expire; after that the block ids in ``locations`` may name other objects.
    """

    def __init__(self, client: "MetaStoreClient", reply: Any, keys: tuple[bytes, ...], sent: float) -> None:
        self._client = client
        self.keys = keys
        self.lease_id = reply.lease_id
        self.locations = [_location(loc) for loc in reply.locations]
        self._deadline = sent + reply.ttl_ms / 1000
        self._released = False

    @property
    def deadline(self) -> float:
        return self._deadline

    @property
    def live(self) -> bool:
        """Believed live: not released and before the deadline (no RPC)."""
        return not self._released and time.monotonic() < self._deadline

    def renew(self, ttl_ms: int = 0) -> float:
        """Move the deadline to now + ttl_ms (0: the MetaStore's default); ``LeaseExpired`` if gone."""
        pb = _wire()[1]
        sent = time.monotonic()
        reply = self._client._call("RenewLease", pb.RenewLeaseRequest(lease_id=self.lease_id, ttl_ms=ttl_ms))
        self._deadline = sent + reply.ttl_ms / 1000
        return self._deadline

    def release(self) -> None:
        if not self._released:
            pb = _wire()[1]
            self._client._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=self.lease_id))
            self._released = True

    def __enter__(self) -> "RemoteLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"RemoteLease({self.lease_id}, {len(self.keys)} keys, live={self.live})"


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


class MetaStoreClient:
    """Typed client of ``kvoffload.v1.MetaStore`` (see the module docstring). Thread-safe."""

    def __init__(self, target: str, *, pool_id: str | None = None, timeout_s: float = 5.0,
                 channel: "grpc.Channel | None" = None, tls: Any = PROCESS) -> None:
        """``tls``: a ``kvcore.tls.TLSConfig`` for the channel, None for plain gRPC; by default the
        process's (``kvcore.tls.configure``). Ignored when ``channel`` is given."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        grpc, self._pb, pb_grpc = _wire()
        self._rpc_error = grpc.RpcError
        self.target = target
        self.pool_id = pool_id
        self.timeout_s = timeout_s
        self._owns_channel = channel is None
        self._channel = channel if channel is not None else secure_or_insecure_channel(target, tls)
        self._stub = pb_grpc.MetaStoreStub(self._channel)

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except self._rpc_error as e:
            raise error_from_rpc(e, method) from None

    def _pool(self, pool_id: str | None) -> str:
        pool_id = pool_id or self.pool_id
        if not pool_id:
            raise ValueError("pool_id is required (pass it, or construct the client with pool_id=...)")
        return pool_id

    # ---- LocalService ----------------------------------------------------------------------------

    def register_pool(self, segment_name: str, geometry: PoolGeometry, *, pool_id: str | None = None,
                      host: str = "", replace: bool = False) -> Any:
        """Register a segment this process created; the ``RegisterPoolReply`` says how often to ``heartbeat``."""
        return self._call("RegisterPool", self._pb.RegisterPoolRequest(
            pool_id=self._pool(pool_id), segment_name=segment_name, geometry=geometry_to_pb(geometry), host=host,
            replace=replace))

    def heartbeat(self, pool_id: str | None = None) -> int:
        """ms until the pool expires without another beat; ``PoolNotRegistered`` if it is gone."""
        return self._call("Heartbeat", self._pb.HeartbeatRequest(pool_id=self._pool(pool_id))).expires_in_ms

    def deregister_pool(self, pool_id: str | None = None) -> bool:
        return self._call("DeregisterPool",
                          self._pb.DeregisterPoolRequest(pool_id=self._pool(pool_id))).deregistered

    # ---- HostPoolBackend-shaped index hooks ------------------------------------------------------

    def check_alloc(self, keys: Sequence[bytes]) -> PoolRecord:
        """The pool ``alloc(keys)`` would use, or the error it would raise; changes nothing."""
        reply = self._call("Alloc", self._pb.AllocRequest(keys=list(keys), pool_hint=self.pool_id or "",
                                                          require_hint=self.pool_id is not None, dry_run=True))
        return _record(reply.pool)

    def can_alloc(self, keys: Sequence[bytes]) -> bool:
        try:
            self.check_alloc(keys)
        except (ObjectExists, PoolFullError, PoolNotRegistered, NoPoolRegistered):
            return False
        return True

    def alloc(self, keys: Sequence[bytes]) -> list[int]:
        """Block ids of new objects (in this client's pool when it has one), in key order."""
        return self.alloc_objects(keys, self.pool_id, require_hint=self.pool_id is not None).block_ids

    def alloc_objects(self, keys: Sequence[bytes], pool_hint: str | None = None, *,
                      require_hint: bool = False) -> Allocation:
        reply = self._call("Alloc", self._pb.AllocRequest(keys=list(keys), pool_hint=pool_hint or "",
                                                          require_hint=require_hint))
        return Allocation(_record(reply.pool), list(reply.block_ids), reply.evicted_objects)

    def mark_written(self, keys: Sequence[bytes], plane: int) -> list[bool]:
        """Report plane ``plane`` of each object written; per key whether it is now complete."""
        return list(self._call("MarkWritten", self._pb.MarkWrittenRequest(keys=list(keys), plane=plane)).complete)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return list(self._call("Exists", self._pb.ExistsRequest(keys=list(keys))).exists)

    def lookup(self, keys: Sequence[bytes]) -> tuple[list[Location], dict[str, PoolRecord]]:
        """Locations in key order, and the pools they name (segment names to attach)."""
        reply = self._call("Lookup", self._pb.LookupRequest(keys=list(keys)))
        return [_location(loc) for loc in reply.locations], {p.pool_id: _record(p) for p in reply.pools}

    def block_ids(self, keys: Sequence[bytes]) -> list[int]:
        return [loc.block_id for loc in self.lookup(keys)[0]]

    def lease(self, keys: Sequence[bytes], ttl_ms: int = 0, *, holder: str = "") -> RemoteLease:
        sent = time.monotonic()
        reply = self._call("Lease", self._pb.LeaseRequest(keys=list(keys), ttl_ms=ttl_ms, holder=holder))
        return RemoteLease(self, reply, tuple(keys), sent)

    def remove(self, keys: Sequence[bytes]) -> None:
        self._call("Remove", self._pb.RemoveRequest(keys=list(keys)))

    def meta_stats(self) -> Any:
        """The raw ``MetaStatsReply`` (every pool, totals)."""
        return self._call("Stats", self._pb.MetaStatsRequest())

    def stats(self) -> PoolStats:
        """kvcore ``PoolStats`` of this client's pool (all pools summed without one).

        ``live_leases`` and ``lease_expiries`` are the MetaStore's totals (leases are not per pool)."""
        s = self.meta_stats()
        pools = [p for p in s.pools if self.pool_id in (None, p.pool.pool_id)]
        if self.pool_id is not None and not pools:
            raise PoolNotRegistered(f"pool {self.pool_id!r} is not registered")
        total = lambda name: sum(getattr(p, name) for p in pools)  # noqa: E731
        return PoolStats(num_blocks=sum(p.pool.geometry.num_blocks for p in pools), used_blocks=total("used_blocks"),
                         free_blocks=total("free_blocks"), used_bytes=total("used_bytes"),
                         capacity_bytes=total("capacity_bytes"), complete_objects=total("complete_objects"),
                         live_leases=s.live_leases, lease_expiries=s.lease_expiries, evictions=total("evictions"))

    def close(self) -> None:
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> "MetaStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
