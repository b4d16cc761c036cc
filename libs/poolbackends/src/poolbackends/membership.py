"""A pool's membership in the MetaStore: registration, heartbeats, death and re-join.

``PoolMembership`` registers a segment under the client's ``pool_id`` when built
(``WorldSizeExceeded`` when the MetaStore holds ``world_size`` pools) and starts a daemon thread
that heartbeats every ``heartbeat_interval_ms`` (default: the MetaStore's suggestion, a third of
its timeout). A failed beat is logged, counted and retried at the next interval. Once the
MetaStore answers that the pool is not registered (it expired, or was deregistered or replaced),
the membership is dead: ``check_usable`` raises ``PoolNotRegistered`` saying why — unless it was
built with ``rejoin=True`` (what a service wants: a restarted MetaStore must not retire the node).
Then each later beat tries to register the same segment again (empty as far as the new index
knows), once ``ready_to_rejoin()`` says the copies that began before the pool died are over:
they hold block locations of the old index, which the new one will hand out again.

``close()`` stops the beats and deregisters (idempotent); it does not close the client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import structlog

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import PoolError
from poolbackends.client import MetaStoreClient
from poolbackends.errors import PoolNotRegistered, WorldSizeExceeded

log = structlog.get_logger(__name__)
T = TypeVar("T")


class PoolMembership:
    """One registered pool's standing with the MetaStore (see the module docstring)."""

    def __init__(
        self,
        client: MetaStoreClient,
        segment_name: str,
        geometry: PoolGeometry,
        host_id: str,
        *,
        heartbeat_interval_ms: int | None = None,
        replace: bool = False,
        rejoin: bool = False,
        ready_to_rejoin: Callable[[], bool] = lambda: True,
    ) -> None:
        if not client.pool_id:
            raise ValueError("client must be a MetaStoreClient built with pool_id=<this pool's id>")
        self._client = client
        self.pool_id: str = client.pool_id
        self.segment_name, self.geometry, self.host_id = segment_name, geometry, host_id
        self._rejoin, self._ready_to_rejoin = rejoin, ready_to_rejoin
        self._lock = threading.Lock()
        self._dead: str | None = None  # why the MetaStore no longer knows this pool
        self._closed = False
        self.rejoins = 0
        self.heartbeat_failures = 0  # beats that failed without an answer (each logged and retried)
        self._unanswered: str | None = None  # why the last beat got no answer (None: it was answered)
        try:
            reply = client.register_pool(segment_name, geometry, host=host_id, replace=replace)
        except WorldSizeExceeded as e:
            raise WorldSizeExceeded(f"the MetaStore at {client.target} refused pool {self.pool_id!r}: {e}") from None
        self.heartbeat_timeout_ms = int(reply.heartbeat_timeout_ms)
        self.lease_ttl_ms = int(reply.lease_ttl_ms)
        interval = int(reply.heartbeat_interval_ms) if heartbeat_interval_ms is None else heartbeat_interval_ms
        if isinstance(interval, bool) or not isinstance(interval, int) or not 0 < interval < self.heartbeat_timeout_ms:
            client.deregister_pool()
            raise ValueError(
                f"heartbeat_interval_ms must be an int in [1, {self.heartbeat_timeout_ms}) (the "
                f"MetaStore's heartbeat timeout), got {heartbeat_interval_ms!r}"
            )
        self.heartbeat_interval_ms = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name=f"kv-heartbeat-{self.pool_id}", daemon=True)
        self._thread.start()
        log.info(
            "remote_pool_registered",
            pool_id=self.pool_id,
            target=client.target,
            segment=segment_name,
            host=host_id,
            num_blocks=geometry.num_blocks,
            heartbeat_interval_ms=interval,
            num_pools=int(reply.num_pools),
            world_size=int(reply.world_size),
        )

    # ---- standing --------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Not closed and, as far as this process knows, registered with the MetaStore."""
        return not self._closed and self._dead is None

    @property
    def dead(self) -> str | None:
        """Why the MetaStore no longer knows the pool (None while it does)."""
        return self._dead

    def not_ready(self) -> str:
        """Why the pool cannot serve now ("" when it can): closed, dropped by the MetaStore (until a
        re-join), or the last heartbeat went unanswered (the MetaStore is unreachable)."""
        if self._closed:
            return f"pool {self.pool_id!r} is closed"
        if self._dead is not None:
            return f"pool {self.pool_id!r} is not registered with the MetaStore at {self._client.target}: {self._dead}"
        if self._unanswered is not None:
            return (
                f"the MetaStore at {self._client.target} does not answer pool {self.pool_id!r}'s heartbeats: "
                f"{self._unanswered}"
            )
        return ""

    def check_usable(self) -> None:
        """``PoolError`` once closed, ``PoolNotRegistered`` (saying why) once dead."""
        if self._closed:
            raise PoolError(f"remote host pool {self.pool_id!r} is closed")
        if self._dead is not None:
            raise PoolNotRegistered(
                f"pool {self.pool_id!r} is no longer registered with the MetaStore at {self._client.target} "
                f"({self._dead}); every object it held is gone: close it and create it again (replace=True "
                f"reuses the name)"
            )

    def mark_dead(self, why: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = why
                log.error("remote_pool_dead", pool_id=self.pool_id, target=self._client.target, reason=why)

    def own_pool_call(self, fn: Callable[..., T], *args: object) -> T:
        """A call whose ``PoolNotRegistered`` can only be about this pool: it marks the pool dead."""
        try:
            return fn(*args)
        except PoolNotRegistered as e:
            self.mark_dead(str(e))
            self.check_usable()
            raise

    # ---- heartbeats ------------------------------------------------------------------------------

    def heartbeat(self) -> int:
        """Beat once now; ms until the MetaStore expires the pool without another beat.

        ``PoolNotRegistered`` (and the pool is dead from now on) if the MetaStore dropped it."""
        self.check_usable()
        try:
            expires_in_ms = self.own_pool_call(self._client.heartbeat)
        except PoolNotRegistered:
            raise
        except PoolError as e:
            self._unanswered = str(e)
            raise
        self._unanswered = None
        return expires_in_ms

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_ms / 1000):
            try:
                self.heartbeat()
            except PoolNotRegistered:
                if not self._rejoin:
                    return  # dead: the pool's hooks raise from now on
                self._try_rejoin()
            except PoolError as e:
                if self._closed:
                    return
                self.heartbeat_failures += 1
                log.warning(
                    "remote_pool_heartbeat_failed",
                    pool_id=self.pool_id,
                    target=self._client.target,
                    error=str(e),
                    failures=self.heartbeat_failures,
                    retry_in_ms=self.heartbeat_interval_ms,
                )
            except Exception:
                self.heartbeat_failures += 1
                log.exception("remote_pool_heartbeat_error", pool_id=self.pool_id)

    def _try_rejoin(self) -> None:
        """Register the segment again under the same pool id (the index starts empty)."""
        if not self._ready_to_rejoin():
            log.warning("remote_pool_rejoin_waiting", pool_id=self.pool_id)
            return
        try:
            self._client.register_pool(self.segment_name, self.geometry, host=self.host_id, replace=True)
        except Exception as e:  # noqa: BLE001 - tried again at the next beat
            self.heartbeat_failures += 1
            log.warning("remote_pool_rejoin_failed", pool_id=self.pool_id, target=self._client.target, error=str(e))
            return
        with self._lock:
            self._dead = None
            self._unanswered = None
            self.rejoins += 1
        log.warning("remote_pool_rejoined", pool_id=self.pool_id, target=self._client.target, rejoins=self.rejoins)

    # ---- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the beats and deregister (a failure is logged: the MetaStore expires the pool). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self._client.timeout_s + 1)
        if self._dead is None:
            try:
                self._client.deregister_pool()
            except PoolError as e:
                log.warning("remote_pool_deregister_failed", pool_id=self.pool_id, error=str(e))
