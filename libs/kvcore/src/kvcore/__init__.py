"""kvcore: engine-agnostic KV memory management for kvoffload.

One concept per module: ``config`` (the JSON users write), ``layout`` (per-layer cache specs),
``plan`` (buffer plan, descriptor merge, memory accounting), ``gates`` (slot reuse gates, I4),
``hotcache`` (decode hot top-k residency), ``gather`` (native gather/scatter of token rows),
``hostpool`` (shared-memory host KV pool and block keys), ``device`` (devices and the counting
allocator). No model code and no service code lives here.
"""

__version__ = "0.1.0"
