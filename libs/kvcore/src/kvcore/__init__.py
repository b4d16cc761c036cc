"""kvcore: engine-agnostic KV memory management for kvoffload.

Four rooms, each with its own module map:

- ``config/``: the JSON users write (``--kv-transfer-config``, ``--additional-config``), checked and
  typed, and the validated settings of a prefill / decode node.
- ``pool/``: the host pool (``HostPoolBackend``, the embedded ``LocalHostPool``, shared-memory
  segments, leases, eviction, block keys) and ``pool/registry``, one entry per host-pool backend.
- ``hotcache/``: sparse decode's hot top-k residency and the native gather of token rows.
- ``traces/``: top-k traces (synthetic, recorded) and their locality.

And the modules every room's users share:

- ``layout``: per-layer cache specs; ``plan``: the prefill buffer plan, descriptor merge and memory
  accounting.
- ``gates``: the slot reuse gates (I4); ``slottickets``: a slot's occupant (``SlotTicket``).
- ``pdpair``: whether a prefill and a decode deployment pair, and which TP ranks feed which.
- ``transferregistry``: one entry per P→D transfer backend (name, what it needs, where it runs, its
  engine factory, its keys, whether vLLM and a loopback stack take it).
- ``backends``: whether a host-pool or P→D transfer backend can run here.
- ``device``: devices and the counting allocator.
- ``_native_hotcache`` / ``_native_gather``: the C++ extensions (``native/``, built by setup.py) behind
  ``hotcache/``; their ``.pyi`` files give the checker their types.

No model code and no service code lives here; the benchmarks and the research code they measure
with (sizing curves, offline prefetch scoring) are ``kvoffload_bench``'s.
"""

__version__ = "0.1.0"
