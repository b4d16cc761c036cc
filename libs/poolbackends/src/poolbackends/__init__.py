"""poolbackends: the host-pool backends beyond the embedded ``kvcore.pool.local.LocalHostPool``: the pool
whose index lives in a kvoffload-metastore, or on an existing distributed store (Mooncake Store,
Memcache), and the launchers of their servers. Each backend is one ``kvcore.pool.registry`` entry whose
hooks (``open_pool``, ``pool_not_ready``, the launcher) live in its module here.

- ``registry``: runs an entry's hooks: ``open_pool`` (with a ``PoolRequest``; ``PoolOpenError``),
  ``readiness``, ``start_server``, ``open_lookup`` (a ``PrefixLookup``).
- ``errors``: the registry errors (``PoolNotRegistered``, ``PoolConflict``, ``WorldSizeExceeded``,
  ``NoPoolRegistered``) and ``MetaStoreUnavailable``; object errors are kvcore's.
- ``records``: the immutable records the MetaStore hands out (``PoolRecord``, ``Location``,
  ``Allocation``).
- ``wire``: how errors, geometries and records travel over gRPC (both directions: the metastore's
  servicer and this client share it).
- ``client``: ``MetaStoreClient`` and its ``RemoteLease``.
- ``membership``: a pool's registration, heartbeats and re-join after a MetaStore restart.
- ``remotepool``: ``RemoteHostPool``, the ``kvcore.pool.host_pool.HostPoolBackend`` over that index.
- ``peersegments``: ``PeerSegments``, the same-host segments of other pools a ``RemoteHostPool`` reads
  (attached once, re-attached when recreated).
- ``embedded``: backend ``"kvoffload"``: a ``RemoteHostPool`` with a metastore, else a ``LocalHostPool``
  (its lookup: the metastore's ``Exists``);
  ``metastore_server`` (starts a ``kvoffload-metastore``) serves it.
- ``storepool``: ``StoreHostPool``, a ``kvcore.pool.local.LocalHostPool`` whose complete objects are also
  kept in an existing distributed store (the base of the next two); ``store_fetched`` keeps the
  objects a load read whole from the store for its other planes. The server launchers below are
  ``svcruntime.serverprocess.ServerProcess``es.
- ``mooncake``: backend ``"mooncake"``, ``MooncakeHostPool``, a ``StoreHostPool`` whose objects are
  shared through Mooncake Store instead; ``mooncake_objects`` (its objects in the store),
  ``mooncake_store`` (the store client), ``mooncake_lookup`` (which blocks the store holds, asked of
  the master without a pool) and ``mooncake_master`` (starts a ``mooncake_master``) serve it.
- ``memcache``: backend ``"memcache"``, ``MemcacheHostPool``, a ``StoreHostPool`` over Memcache
  (``memcache_hybrid``); ``memcache_client`` (a LocalService, its start-up errors), ``memcache_conf``
  (the seed's ``mmc-meta.conf`` / ``mmc-local.conf`` keys) and ``memcache_meta`` (starts a
  MetaService) serve it.
"""

__version__ = "0.1.0"
