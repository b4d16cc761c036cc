"""kvoffload-prefill: the kv_producer — layerwise prefill onto shared-memory device buffers, host-pool
save, per-layer announcements to the decode endpoints a request names (``kvoffload-prefill``)."""

__version__ = "0.1.0"
