"""kvcore: engine-agnostic KV memory management for kvoffload.

One concept per module:

- ``config`` / ``settings``: the JSON users write (``--kv-transfer-config``, ``--additional-config``)
  and the per-node rules that need the model and the parallel sizes; ``backends``: whether an
  Ascend backend can run here.
- ``layout``: per-layer cache specs; ``plan``: the prefill buffer plan, descriptor merge and memory
  accounting; ``gates``: the slot reuse gates (I4).
- ``hotcache``: decode hot top-k residency (native + reference); ``gather``: native gather/scatter
  of token rows.
- ``hostpool``: the host KV pool interface and its embedded backend, over ``segment`` (named shared
  memory), ``leases`` and ``eviction``; ``blockkeys``: stable chained block keys.
- ``device``: devices and the counting allocator; ``bench``: side-by-side benchmarks.

No model code and no service code lives here.
"""

__version__ = "0.1.0"
