"""kvoffload-prefill: the kv_producer — layerwise prefill onto shared-memory device buffers, host-pool
save, per-layer announcements to the decode endpoints a request names (``kvoffload-prefill``).

Modules:
- ``server``: ``serve()`` and the ``kvoffload-prefill`` command (a P/D prefill, or offload-only)
- ``options``: its flags, their checks, the validated settings, the host pool's flags
- ``pools``: the host pool by backend, its readiness and its Stats counters
- ``worker``: ``PrefillWorker``, one request's prefill announcing every layer to its decodes
- ``queue_bound``: ``PrefillQueue``, the P/D mode's turns at the engine and their time bound
- ``source``: the rows ``LayerSource`` serves out of the layer buffers
- ``app``: the HTTP API of a P/D prefill (the proxy's dispatch)
- ``generate``: ``GenerateLoop``, offload-only mode's engine thread (complete requests)
- ``offload_app``: the HTTP API of offload-only mode
- ``metrics``: ``PrefillMetrics``, the Prometheus metrics both modes export
- ``prefix_cache``: the prefix cache's reset (``/reset_prefix_cache``), for both modes
- ``tp_ranks``: ``--tensor-parallel-size``: the TP rank processes, and a follower rank's main
"""

__version__ = "0.1.0"
