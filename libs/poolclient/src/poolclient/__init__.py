"""poolclient: the host KV pool whose index lives in a kvoffload-metastore.

- ``errors``: the registry errors (``PoolNotRegistered``, ``PoolConflict``, ``WorldSizeExceeded``,
  ``NoPoolRegistered``) and ``MetaStoreUnavailable``; object errors are kvcore's.
- ``records``: the immutable records the MetaStore hands out (``PoolRecord``, ``Location``,
  ``Allocation``).
- ``wire``: how errors, geometries and records travel over gRPC (both directions: the metastore's
  servicer and this client share it).
- ``client``: ``MetaStoreClient`` and its ``RemoteLease``.
- ``membership``: a pool's registration, heartbeats and re-join after a MetaStore restart.
- ``remotepool``: ``RemoteHostPool``, the ``kvcore.hostpool.HostPoolBackend`` over that index.
- ``mooncake``: ``MooncakeHostPool``, a ``kvcore.hostpool.LocalHostPool`` whose objects are shared
  through Mooncake Store instead; ``mooncake_objects`` (its objects in the store), ``mooncake_store``
  (the store client) and ``mooncake_master`` (starts a ``mooncake_master``) serve it.
"""

__version__ = "0.1.0"
