"""kvoffload-decode: the kv_consumer (host-pool allocation, per-layer remote D2H pull,
sparse-offload decode, token streaming). The server arrives with the services issue; until then
this package only reserves its place in the monorepo."""

__version__ = "0.1.0"
