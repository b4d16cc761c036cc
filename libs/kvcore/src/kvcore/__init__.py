"""kvcore: engine-agnostic KV memory management for kvoffload.

One concept per module:

The JSON users write (``--kv-transfer-config``, ``--additional-config``) and the node rules:

- ``config``: the parse entry points (``parse_kv_transfer_config``, ``parse_additional_config``).
- ``transferconfig``: ``KVTransferConfig`` and ``MultiConnectorConfig`` (``--kv-transfer-config``).
- ``connectorconfig``: each connector's extra config (``StoreConnectorConfig``, ``D2HConnectorConfig``).
- ``poolkeys``: each host-pool backend's keys in the store connector's extra config (typed models).
- ``additionalconfig``: ``AdditionalConfig`` and its ``SparseKVOffloadConfig``.
- ``confignames``: the names the JSON accepts (connectors, roles, backends, policies, keys).
- ``configerrors``: ``ConfigError`` and the friendly messages of config problems.
- ``configfields``: the strict field rules of the config models.
- ``configmodel``: ``ConfigModel``, their base (unknown keys as warnings, every problem at once).
- ``nodeconfig``: a node's two JSON options parsed together, and its connectors looked up in them.
- ``prefillsettings`` / ``decodesettings``: the validated settings of a prefill / decode node.
- ``pdpair``: whether a prefill and a decode deployment pair, and which TP ranks feed which.
- ``transferregistry``: one entry per P→D transfer backend (name, what it needs, where it runs, its
  engine factory, its keys, whether vLLM and a loopback stack take it), read by config validation,
  the services, the vLLM connector, the stack and the benches.
- ``backends``: whether a host-pool or P→D transfer backend can run here.
- ``mmcconf``: the Memcache conf files (``mmc-meta.conf`` / ``mmc-local.conf``).

The model's caches and the prefill's buffers:

- ``layout``: per-layer cache specs; ``plan``: the prefill buffer plan, descriptor merge and memory
  accounting.
- ``gates``: the slot reuse gates (I4); ``slottickets``: a slot's occupant (``SlotTicket``).

Sparse decode:

- ``hotcache``: decode hot top-k residency (native path); ``hotcache_reference``: its Python
  reference path; ``hotcache_resolution``: what a resolve returns (``Resolution``, ``MAX_TOKEN``).
- ``gather``: native gather/scatter of token rows.
- ``_native_hotcache`` / ``_native_gather``: the C++ extensions (``native/``, built by setup.py) behind
  those two; their ``.pyi`` files give the checker their types.
- ``traces/``: top-k traces (synthetic, recorded) and their locality.

The host pool:

- ``hostpool``: the ``HostPoolBackend`` interface, its hook map and the checks every backend applies.
- ``poolregistry``: one entry per host-pool backend (name, keys, probe, factory, readiness, launcher),
  read by config validation, the services, the stack, the fault suite and ``bench pool``.
- ``localpool``: ``LocalHostPool``, the embedded backend; ``attachedpool``: ``AttachedPool``, a decode TP
  follower's view of its DP rank's pool (rank 0's), at the blocks rank 0 allocates.
- ``poolgeometry``: ``PoolGeometry``, the shape of a pool; ``segment``: ``SharedSegment``, the named
  shared memory that holds it.
- ``leases``: the ``Lease`` protocol and the lease table; ``eviction``: eviction policies;
  ``poolerrors``: the pool's typed errors; ``poolchecks``: the checks of a pool's arguments (keys,
  counts), without torch, as the metastore imports them.
- ``blockkeys``: stable chained block keys.

And: ``device``: devices and the counting allocator.

No model code and no service code lives here; the benchmarks and the research code they measure
with (sizing curves, offline prefetch scoring) are ``kvoffload_bench``'s.
"""

__version__ = "0.1.0"
