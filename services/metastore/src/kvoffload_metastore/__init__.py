"""kvoffload-metastore: the MetaService role of the embedded host KV pool.

Modules: ``core`` (``MetaStoreCore``: pool registry, key -> location index, allocation, read
leases, heartbeats, LRU eviction; no gRPC), ``records`` (the snapshots it hands out),
``errors`` (error types and their status codes), ``servicer`` (proto <-> core), ``server``
(``serve()`` and the ``kvoffload-metastore`` command), ``config`` (flags and the seed's mmc conf
files), ``metrics`` (Prometheus and Stats counters), ``logs`` (structlog JSON), ``client``
(``MetaStoreClient``, typed and kvcore-shaped).
"""

__version__ = "0.1.0"
