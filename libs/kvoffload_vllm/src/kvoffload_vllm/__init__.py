"""kvoffload's KV connectors for vLLM's v1 KV-connector API.

A user switches one on with vLLM's own flag and the module path of this package::

    --kv-transfer-config '{"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "kvoffload_vllm",
        "kv_connector_extra_config": {"backend": "kvoffload", "metastore": "127.0.0.1:5000"}}'

The connector classes import vLLM, so they are loaded on first access (``kvoffload_vllm.layout``,
``kvoffload_vllm.plan`` and ``kvoffload_vllm.d2h_plan`` import without it). The P/D pair:
``SfaRemoteD2HConnector`` with ``kv_role`` ``kv_producer`` on the prefill (usually inside vLLM's
``MultiConnector`` next to the store) and ``kv_consumer`` on the decode; see ``kvoffload_vllm.d2h``.

- ``store``: ``AscendStoreConnector``, the layerwise prefix store over host pools (``SupportsHMA``:
  every KV cache group by its own block table and block size).
- ``store_config``: its ``kv_transfer_config``, checked and typed.
- ``store_lookup``: its scheduler's lookup in the backend's index (the metastore, a mooncake_master).
- ``store_mmc``: what that config leaves out, from the seed's mmc files (``MMC_*_CONFIG_PATH``).
- ``unread_config``: the guide's keys a vLLM server would leave unread (``sparse_kv_offload_config``,
  the pull's ``use_layerwise``): refused or warned at start-up.
- ``store_counters``: its counters and what each counts; ``store_saves``: what a step's saves report (counted,
  logged, or a failed save's objects removed; layers in the pool before the forward ended).
- ``store_tp``: the pool keys each TP rank keeps its blocks under.
- ``tp``: this engine's TP rank, and whether every rank holds the same KV.
- ``plan``: which blocks each step of the store loads and saves.
- ``pool_alloc``: the pool objects a step's saves write (blocks the pool lacks).
- ``kv_groups``: vLLM's KV cache groups (layers, block size, layer specs; the null block).
- ``group_caches``: one group's caches as pool planes, read and written in place.
- ``group_pools``: the store's pool per group, and a step's hits loaded from them.
- ``shared_buffers``: the seed's shared layer buffers on a vLLM prefill (which layers share which
  buffer; the vLLM version they are built for).
- ``kv_cache_patch``: sizes vLLM's KV cache for those buffers (the one change to vLLM internals).
- ``shared_steps``: the store's per-layer loads and host copies on shared buffers.
- ``shared_loader``: their loader thread, ``layerwise_prefetch_layers`` layers ahead of the forward.
- ``request_kv``: host copies of running requests' blocks of the shared layers.
- ``request_kv_budget``: their budget (``layerwise_request_kv_gb``): start-up check, scheduler admission.
- ``reuse_gate``: a shared buffer's next layer waits until its previous one is saved and pulled.
- ``d2h``: ``SfaRemoteD2HConnector``, the P/D pull (``SupportsHMA``: every KV cache group by its own
  block table and block size); its worker sides:
- ``producer``: the prefill's side (announces layers through ``pdlink``'s ``DecodeLink``, serves
  vLLM's blocks as a ``RowBuffer``).
- ``d2h_consumer``: the decode's side (a ``RowSink`` of vLLM's blocks under ``pdlink``'s ``PullConsumer``);
- ``d2h_layout``: whether a prefill's layout fits the decode worker's (rows, dtypes, TP head slices);
- ``incoming``: one request the decode receives (its blocks, what landed, its state);
- ``d2h_engine``: both sides on a transfer engine (``transfer_backend: "mooncake"``: vLLM's cache
  memory registered, each layer's block addresses, one batched read into the request's blocks).
- ``d2h_plan``: what each step sends, and which copy of a block a decode keeps.
- ``d2h_layers``: the D2H connector's layers on the wire, each with its KV cache group's blocks and block size.
- ``d2h_settings``: ``D2HSettings``, the connector's typed config.
- ``d2h_step``: ``D2HStepMetadata``, one step's work for the workers (sends, ``Recv``, cancellations).
- ``d2h_tp``: tensor parallel pairing: the decode rank a prefill rank feeds, its share of a step,
  the head slice of a block it fills.
- ``kv_digest``: per-layer digests of a request's prompt KV (the decode's ``kv_digests`` log, checks).
- ``layout``: block keys' model ids; the one contiguous KV cache group the shared buffers take.
- ``block_bytes``: a layer's cache as its blocks' bytes over any block stride (hybrid-manager views too).
- ``stats``: the connectors' counters as vLLM stats and Prometheus counters.
- ``plugin``: registers the connector names with vLLM and installs ``kv_cache_patch``.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["AscendStoreConnector", "SfaRemoteD2HConnector"]


def __getattr__(name: str):
    if name == "AscendStoreConnector":
        from kvoffload_vllm.store import AscendStoreConnector

        return AscendStoreConnector
    if name == "SfaRemoteD2HConnector":
        from kvoffload_vllm.d2h import SfaRemoteD2HConnector

        return SfaRemoteD2HConnector
    raise AttributeError(f"module 'kvoffload_vllm' has no attribute {name!r}")
