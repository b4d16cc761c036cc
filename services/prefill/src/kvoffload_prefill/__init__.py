"""kvoffload-prefill: the kv_producer (layerwise prefill onto shared device buffers, host-pool
save, per-layer announcements to decode). The server arrives with the services issue; until then
this package only reserves its place in the monorepo."""

__version__ = "0.1.0"
