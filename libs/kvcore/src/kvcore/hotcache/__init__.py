"""kvcore.hotcache: sparse decode's device side — the hot top-k buffer's residency and the gather of
token rows.

- ``cache``: decode hot top-k residency (native path, ``kvcore._native_hotcache``).
- ``reference``: its Python reference path; ``resolution``: what a resolve returns (``Resolution``,
  ``MAX_TOKEN``).
- ``gather``: native gather/scatter of token rows (``kvcore._native_gather``).
"""
