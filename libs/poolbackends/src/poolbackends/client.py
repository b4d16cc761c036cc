"""``MetaStoreClient``: the MetaStore (``kvoffload.v1.MetaStore``) over gRPC, shaped like the index
hooks of ``kvcore.pool.host_pool.HostPoolBackend``, and ``RemoteLease``, the lease handle it hands out.

Every call carries a deadline (``timeout_s``). Failures raise the same types as kvcore's pools
(``ObjectNotFound``, ``ObjectExists``, ``ObjectLeased``, ``PoolFullError`` with its numbers,
``LeaseExpired``, ``ValueError`` for bad input) or the registry errors of ``poolbackends.errors``;
a MetaStore that cannot be reached or does not answer in time is ``MetaStoreUnavailable``
(``poolbackends.wire`` maps statuses to types). Nothing is retried here: the caller owns retry
policy.

Constructed with ``pool_id`` (a LocalService's view of its own pool), ``alloc`` places objects in
that pool only and ``stats`` reports it. The client moves no bytes: ``poolbackends.remotepool.
RemoteHostPool`` is the full ``HostPoolBackend`` that copies in shared memory at the block ids
handed out here and reports each written plane with ``mark_written``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import grpc

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import ObjectExists, PoolFullError, PoolStats, check_positive
from kvcore.pool.leases import check_ttl_ms
from kvoffload_proto.v1 import metastore_pb2 as pb
from kvoffload_proto.v1 import metastore_pb2_grpc as pb_grpc
from poolbackends.errors import NoPoolRegistered, PoolNotRegistered
from poolbackends.records import Allocation, Location, PoolRecord
from poolbackends.wire import error_from_rpc, geometry_to_pb, location_from_pb, pool_from_pb
from svcruntime.tls import PROCESS, secure_or_insecure_channel

# --------------------------------------------------------------------------------------------
# Leases
# --------------------------------------------------------------------------------------------


class RemoteLease:
    """A MetaStore lease; satisfies the ``kvcore.pool.leases.Lease`` protocol.

    ``deadline`` is ``time.monotonic()`` seconds of this process, counted from when the request was
    sent (so it errs early). The holder calls ``release()`` (idempotent; also on ``with`` exit) or
    lets it expire; after that the block ids in ``locations`` may name other objects.
    """

    def __init__(self, client: MetaStoreClient, reply: Any, keys: tuple[bytes, ...], sent: float) -> None:
        self._client = client
        self.keys = keys
        self.lease_id = reply.lease_id
        self.locations: list[Location] = [location_from_pb(loc) for loc in reply.locations]
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
        if ttl_ms != 0 or isinstance(ttl_ms, bool):
            check_ttl_ms(ttl_ms)
        sent = time.monotonic()
        reply = self._client._call("RenewLease", pb.RenewLeaseRequest(lease_id=self.lease_id, ttl_ms=ttl_ms))
        self._deadline = sent + reply.ttl_ms / 1000
        return self._deadline

    def release(self) -> None:
        if not self._released:
            self._client._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=self.lease_id))
            self._released = True

    def __enter__(self) -> RemoteLease:
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

    def __init__(
        self,
        target: str,
        *,
        pool_id: str | None = None,
        timeout_s: float = 5.0,
        channel: grpc.Channel | None = None,
        tls: Any = PROCESS,
    ) -> None:
        """``tls``: a ``svcruntime.tls.TLSConfig`` for the channel, None for plain gRPC; by default the
        process's (``svcruntime.tls.configure``). Ignored when ``channel`` is given."""
        check_positive("timeout_s", timeout_s)
        self.target = target
        self.pool_id = pool_id
        self.timeout_s = timeout_s
        self._owns_channel = channel is None
        self._channel = channel if channel is not None else secure_or_insecure_channel(target, tls)
        self._stub = pb_grpc.MetaStoreStub(self._channel)

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise error_from_rpc(e, method) from None

    def _pool(self, pool_id: str | None) -> str:
        pool_id = pool_id or self.pool_id
        if not pool_id:
            raise ValueError("pool_id is required (pass it, or construct the client with pool_id=...)")
        return pool_id

    # ---- LocalService ----------------------------------------------------------------------------

    def register_pool(
        self,
        segment_name: str,
        geometry: PoolGeometry,
        *,
        pool_id: str | None = None,
        host: str = "",
        replace: bool = False,
    ) -> Any:
        """Register a segment this process created; the ``RegisterPoolReply`` says how often to ``heartbeat``."""
        return self._call(
            "RegisterPool",
            pb.RegisterPoolRequest(
                pool_id=self._pool(pool_id),
                segment_name=segment_name,
                geometry=geometry_to_pb(geometry),
                host=host,
                replace=replace,
            ),
        )

    def heartbeat(self, pool_id: str | None = None) -> int:
        """ms until the pool expires without another beat; ``PoolNotRegistered`` if it is gone."""
        return self._call("Heartbeat", pb.HeartbeatRequest(pool_id=self._pool(pool_id))).expires_in_ms

    def deregister_pool(self, pool_id: str | None = None) -> bool:
        return self._call("DeregisterPool", pb.DeregisterPoolRequest(pool_id=self._pool(pool_id))).deregistered

    # ---- HostPoolBackend-shaped index hooks ------------------------------------------------------

    def check_alloc(self, keys: Sequence[bytes]) -> PoolRecord:
        """The pool ``alloc(keys)`` would use, or the error it would raise; changes nothing."""
        reply = self._call(
            "Alloc",
            pb.AllocRequest(
                keys=list(keys), pool_hint=self.pool_id or "", require_hint=self.pool_id is not None, dry_run=True
            ),
        )
        return pool_from_pb(reply.pool)

    def can_alloc(self, keys: Sequence[bytes]) -> bool:
        try:
            self.check_alloc(keys)
        except (ObjectExists, PoolFullError, PoolNotRegistered, NoPoolRegistered):
            return False
        return True

    def alloc(self, keys: Sequence[bytes]) -> list[int]:
        """Block ids of new objects (in this client's pool when it has one), in key order."""
        return self.alloc_objects(keys, self.pool_id, require_hint=self.pool_id is not None).block_ids

    def alloc_objects(
        self, keys: Sequence[bytes], pool_hint: str | None = None, *, require_hint: bool = False
    ) -> Allocation:
        reply = self._call(
            "Alloc", pb.AllocRequest(keys=list(keys), pool_hint=pool_hint or "", require_hint=require_hint)
        )
        return Allocation(pool_from_pb(reply.pool), list(reply.block_ids), reply.evicted_objects)

    def mark_written(self, keys: Sequence[bytes], plane: int | Sequence[int]) -> list[bool]:
        """Report plane ``plane`` (or each of several planes) of each object written; per key
        whether it is now complete."""
        if isinstance(plane, int):
            request = pb.MarkWrittenRequest(keys=list(keys), plane=plane)
        else:
            request = pb.MarkWrittenRequest(keys=list(keys), planes=list(plane))
        return list(self._call("MarkWritten", request).complete)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return list(self._call("Exists", pb.ExistsRequest(keys=list(keys))).exists)

    def lookup(self, keys: Sequence[bytes]) -> tuple[list[Location], dict[str, PoolRecord]]:
        """Locations in key order, and the pools they name (segment names to attach)."""
        reply = self._call("Lookup", pb.LookupRequest(keys=list(keys)))
        return [location_from_pb(loc) for loc in reply.locations], {p.pool_id: pool_from_pb(p) for p in reply.pools}

    def block_ids(self, keys: Sequence[bytes]) -> list[int]:
        return [loc.block_id for loc in self.lookup(keys)[0]]

    def lease(self, keys: Sequence[bytes], ttl_ms: int = 0, *, holder: str = "") -> RemoteLease:
        sent = time.monotonic()
        reply = self._call("Lease", pb.LeaseRequest(keys=list(keys), ttl_ms=ttl_ms, holder=holder))
        return RemoteLease(self, reply, tuple(keys), sent)

    def remove(self, keys: Sequence[bytes]) -> None:
        self._call("Remove", pb.RemoveRequest(keys=list(keys)))

    def meta_stats(self) -> Any:
        """The raw ``MetaStatsReply`` (every pool, totals)."""
        return self._call("Stats", pb.MetaStatsRequest())

    def stats(self) -> PoolStats:
        """kvcore ``PoolStats`` of this client's pool (all pools summed without one).

        ``live_leases`` and ``lease_expiries`` are the MetaStore's totals (leases are not per pool)."""
        s = self.meta_stats()
        pools = [p for p in s.pools if self.pool_id in (None, p.pool.pool_id)]
        if self.pool_id is not None and not pools:
            raise PoolNotRegistered(f"pool {self.pool_id!r} is not registered")
        total = lambda name: sum(getattr(p, name) for p in pools)  # noqa: E731
        return PoolStats(
            num_blocks=sum(p.pool.geometry.num_blocks for p in pools),
            used_blocks=total("used_blocks"),
            free_blocks=total("free_blocks"),
            used_bytes=total("used_bytes"),
            capacity_bytes=total("capacity_bytes"),
            complete_objects=total("complete_objects"),
            live_leases=s.live_leases,
            lease_expiries=s.lease_expiries,
            evictions=total("evictions"),
        )

    def close(self) -> None:
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> MetaStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
