"""kvoffload-metastore: the MetaService role of the embedded host KV pool.

Modules:
- ``core``: ``MetaStoreCore``, the index (pool registry, key -> location, allocation, read leases,
  heartbeats, LRU eviction); no gRPC
- ``placement``: where an allocation goes (the pools to try, the LRU victims that make room)
- ``pool_state``: ``PoolState`` and ``StoredObject``, the mutable per-pool and per-object state it keeps
- ``leasebook``: ``LeaseBook``, its read leases by id, and the lease TTL rule
- ``records``: the snapshots it hands out
- ``errors``: error types and their status codes
- ``servicer``: proto <-> core
- ``server``: ``serve()`` and the ``kvoffload-metastore`` command
- ``config``: flags and the seed's mmc conf files
- ``metrics``: Prometheus and Stats counters

The client (``MetaStoreClient``) lives in ``poolbackends.client``, logging in ``svcruntime.logs``.
"""

__version__ = "0.1.0"
