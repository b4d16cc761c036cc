"""``MooncakeLookup``: which blocks Mooncake Store holds, asked of its master without a pool (backend
``"mooncake"``'s ``lookup`` hook in ``kvcore.pool.registry``: the vLLM store's scheduler looks a prompt's
blocks up here, as it asks a kvoffload-metastore's ``Exists`` on backend ``"kvoffload"``).

One Mooncake Store client that mounts no segment and registers no buffer (``MooncakeStore`` of
``global_segment_bytes=0``): it only asks the master whether ``<namespace>/<key hex>`` exists, the key a
``MooncakeHostPool`` of that namespace puts a block under once the block is complete in every plane
(``poolbackends.mooncake_objects``), so a key exists exactly when some pool of the namespace holds the
whole block. Like any check, a hit grants the master's lease on the object (the owner cannot remove
it for ``mooncake_lease_ttl_ms``), which covers the load that follows it. A master that does not
answer makes ``exists`` raise ``MooncakeStoreError`` (a ``PoolError``) naming it; the client finds a
restarted master by itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.pool.host_pool import PoolError
from poolbackends.mooncake_master import MooncakeNotInstalled
from poolbackends.mooncake_store import MooncakeStore, MooncakeStoreError, address_toward, code_name
from poolbackends.registry import PoolOpenError


class MooncakeLookup:
    """``exists`` of block keys in one namespace of the Mooncake Store of ``store`` (a connected client)."""

    def __init__(self, store: MooncakeStore, namespace: str) -> None:
        if not namespace or "/" in namespace:
            raise ValueError(f"namespace must be a non-empty str without '/', got {namespace!r}")
        self._store, self.namespace = store, namespace

    @classmethod
    def connect(cls, master: str, namespace: str, *, connect_timeout_s: float = 5.0) -> MooncakeLookup:
        """A client of no segment of the master at ``master`` (``host:port``); ``MooncakeStoreError``
        when no master answers within ``connect_timeout_s``, ``MooncakeNotInstalled`` without the wheel."""
        store = MooncakeStore.connect(
            master,
            global_segment_bytes=0,
            local_buffer_bytes=0,
            local_hostname=address_toward(master),
            connect_timeout_s=connect_timeout_s,
        )
        return cls(store, namespace)

    @property
    def master(self) -> str:
        return self._store.master

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: a complete object of the block is in the store (the master leases those that are)."""
        if not keys:
            return []
        codes = self._store.exists([f"{self.namespace}/{bytes(k).hex()}" for k in keys])
        bad = next((c for c in codes if c < 0), None)
        if bad is not None:
            raise MooncakeStoreError(
                f"Mooncake Store exists of {len(keys)} key(s) failed with {code_name(bad)} (master "
                f"{self.master}, namespace {self.namespace!r})",
                code=bad,
            )
        return [c == 1 for c in codes]

    def close(self) -> None:
        self._store.close()

    def __repr__(self) -> str:
        return f"MooncakeLookup(master={self.master!r}, namespace={self.namespace!r})"


def open_lookup(store, timeout_s: float) -> MooncakeLookup:
    """The lookup of the store config's ``mooncake_master`` and ``mooncake_namespace``: ``PoolOpenError``
    when the wheel is missing or the master does not answer within ``timeout_s``."""
    try:
        return MooncakeLookup.connect(store.mooncake_master, store.mooncake_namespace, connect_timeout_s=timeout_s)
    except (PoolError, MooncakeNotInstalled) as e:
        raise PoolOpenError(str(e)) from None
