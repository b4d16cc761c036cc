"""kvcore.pool: the host KV pool — its interface, the embedded backend, its shared memory, leases
and eviction, and the registry of every backend.

- ``host_pool``: the ``HostPoolBackend`` interface, its hook map and the checks every backend applies.
- ``registry``: one entry per host-pool backend (name, keys, probe, factory, readiness, launcher),
  read by config validation, the services, the stack, the fault suite and ``bench pool``.
- ``local``: ``LocalHostPool``, the embedded backend; ``attached``: ``AttachedPool``, a decode TP
  follower's view of its DP rank's pool (rank 0's), at the blocks rank 0 allocates.
- ``geometry``: ``PoolGeometry``, the shape of a pool; ``segment``: ``SharedSegment``, the named
  shared memory that holds it.
- ``leases``: the ``Lease`` protocol and the lease table; ``eviction``: eviction policies.
- ``errors``: the pool's typed errors; ``checks``: the checks of a pool's arguments (keys, counts),
  without torch, as the metastore imports them.
- ``block_keys``: stable chained block keys.
"""
