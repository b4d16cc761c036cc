"""The D2H connector's transfer engine inside vLLM (a ``transfer_backend`` with an engine that vLLM
takes, ``kvcore.transferregistry``: ``"mooncake"``).

Each side starts a Mooncake Transfer Engine (``pdlink.engines``, ``pdlink.mooncake_transfer``) at its
``advertise_host`` and registers vLLM's KV cache memory with it: every storage the layers' caches
live in, once (with several KV cache groups, layers are views of one storage). The prefill
advertises each layer's block 0 address and block stride (``LayerLayout.engine_block_address``,
``engine_block_stride_bytes``: ``D2HLayers.layer_layouts(engine_blocks=True)``) and names the blocks
of every announced range (``ReadReadyRequest.src_block_ids``); the decode reads the blocks it needs
of a layer straight into the request's own blocks in one batched read (``read_blocks``): no staging
buffer, no copy after it. A failure to start or to register is ``pdlink.engines.EngineUnavailable``
with the engine's own reason, and the vLLM server does not start; a failed read fails the layer's
read (READ_FAILED).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.transferregistry import uses_engine
from kvoffload_proto.v1 import transfer_pb2
from kvoffload_vllm.d2h_layers import D2HLayers
from kvoffload_vllm.d2h_settings import D2HSettings
from pdlink.engine_rows import Transfer
from pdlink.engines import register_segment, start_engine


def storages(pages: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(address, bytes) of every distinct storage the layers' ``pages`` view, in first-seen order."""
    seen: dict[int, int] = {}
    for page in pages:
        storage = page.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
    return list(seen.items())


def start_d2h_engine(settings: D2HSettings, role: str, layers: D2HLayers) -> Transfer | None:
    """This worker's engine of ``settings.transfer_backend`` at its ``advertise_host`` ("Prefill" or
    "Decode" ``role``), vLLM's KV cache storages registered with it; None when the backend has no
    engine (the gRPC stream); ``EngineUnavailable`` with the engine's reason when it cannot start."""
    if not uses_engine(settings.transfer_backend):
        return None
    transfer = start_engine(settings.transfer_backend, role, settings.advertise_host, None)
    try:
        for address, nbytes in storages(layers.pages):
            register_segment(transfer, address, nbytes)
    except BaseException:
        transfer.close()
        raise
    return transfer


def read_blocks(
    transfer: Transfer,
    meta: transfer_pb2.LayoutMetadata,
    layer: int,
    src_ids: torch.Tensor,
    page: torch.Tensor,
    dst_ids: torch.Tensor,
) -> int:
    """Read the prefill's blocks ``src_ids`` of ``layer`` (layout ``meta``) into blocks ``dst_ids`` of
    ``page`` (this decode's ``[num_blocks, page_bytes]`` view of the layer) in one batched read;
    returns the bytes read. ValueError when the layout names no block addresses for the layer."""
    lay = meta.layers[layer]
    if not lay.engine_block_address or not lay.engine_block_stride_bytes:
        raise ValueError(
            f"layers[{layer}]: the prefill's layout names no engine_block_address / engine_block_stride_bytes"
        )
    if not len(src_ids):
        return 0
    page_bytes = int(page.shape[1])
    peer = lay.engine_block_address + src_ids * lay.engine_block_stride_bytes
    local = page.data_ptr() + dst_ids * page.stride(0)
    transfer.read(meta.engine_session, local.tolist(), peer.tolist(), [page_bytes] * len(src_ids))
    return page_bytes * len(src_ids)
