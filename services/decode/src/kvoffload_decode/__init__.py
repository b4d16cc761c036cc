"""kvoffload-decode: the kv_consumer — host-pool allocation, metaserver registration, per-layer pull
from the prefill, sparse-offload decode and token streaming (``kvoffload-decode``)."""

__version__ = "0.1.0"
