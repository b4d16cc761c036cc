"""The layout a prefill hands every decode, built in one place: ``layer_layout`` (one cache layer:
its rows, its slot, where a decode reads them) and ``layout_metadata`` (every layer, the prefill's
identity and, on a transfer engine, where its engine is reached). The reference prefill
(``kvoffload_prefill.worker``) and the vLLM producer (``kvoffload_vllm.producer``) both build their
``LayoutMetadata`` here, whole: nothing patches one after it is built.

A builder refuses a message the decode would refuse (``ValueError`` naming the field), so a wrong
layout fails at the prefill's start, not at every decode's first handshake.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload_proto.v1 import transfer_pb2


@dataclass(frozen=True)
class Region:
    """Where a plane of one layer lies in the prefill's shared-memory layer buffers."""

    segment_name: str
    offset_bytes: int
    row_stride_bytes: int
    capacity_tokens: int


@dataclass(frozen=True)
class EngineShare:
    """How decodes reach the prefill's memory through a transfer engine: the engine's name (its
    ``transfer_backend``), its session ("HOST:PORT") and, for a reference prefill, the address of
    byte 0 of its registered layer-buffer segment (0 for a paged vLLM prefill, whose layers carry
    their own block addresses)."""

    engine: str
    session: str
    segment_address: int = 0


def layer_layout(
    layer: int,
    *,
    slot: int,
    main_row_bytes: int,
    main_dtype: str,
    main_row_kind: str = "",
    indexer_row_bytes: int = 0,
    indexer_dtype: str = "",
    block_size: int = 0,
    main_buffer: Region | None = None,
    indexer_buffer: Region | None = None,
    engine_block: tuple[int, int] | None = None,
) -> transfer_pb2.LayerLayout:
    """One layer of the layout (proto ``LayerLayout``): its main rows, its indexer rows when it has
    them, its block size when its group's differs from the layout's, the shared-memory regions of
    a reference prefill, and (``engine_block``: block 0's address, the bytes from block to block)
    a paged prefill's blocks on a transfer engine."""
    if main_row_bytes <= 0 or not main_dtype:
        raise ValueError(f"layer {layer}: needs main_row_bytes > 0 and a main_dtype ({main_row_bytes}, {main_dtype!r})")
    if (indexer_row_bytes > 0) != bool(indexer_dtype):
        raise ValueError(f"layer {layer}: indexer_dtype is set exactly when indexer_row_bytes > 0")
    if indexer_buffer is not None and not indexer_row_bytes:
        raise ValueError(f"layer {layer}: an indexer_buffer without indexer rows")
    out = transfer_pb2.LayerLayout(
        layer=layer,
        slot=slot,
        main_row_bytes=main_row_bytes,
        main_dtype=main_dtype,
        main_row_kind=main_row_kind,
        indexer_row_bytes=indexer_row_bytes,
        indexer_dtype=indexer_dtype,
        block_size=block_size,
    )
    for region, into in ((main_buffer, out.main_buffer), (indexer_buffer, out.indexer_buffer)):
        if region is not None:
            into.segment_name = region.segment_name
            into.offset_bytes = region.offset_bytes
            into.row_stride_bytes = region.row_stride_bytes
            into.capacity_tokens = region.capacity_tokens
    if engine_block is not None:
        out.engine_block_address, out.engine_block_stride_bytes = engine_block
    return out


def layout_metadata(
    *,
    model_id: str,
    layers: Sequence[transfer_pb2.LayerLayout],
    block_size: int,
    tp_rank: int,
    tp_size: int,
    data_endpoint: str,
    host_id: str,
    version: int,
    engine: EngineShare | None = None,
) -> transfer_pb2.LayoutMetadata:
    """The whole layout (proto ``LayoutMetadata``): ``layers`` ordered by layer, numbered 0..N-1."""
    if [lay.layer for lay in layers] != list(range(len(layers))):
        raise ValueError(f"layers: must be numbered 0..{len(layers) - 1} in order, got {[lay.layer for lay in layers]}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"prefill_tp_rank: got {tp_rank}; must be in [0, prefill_tp_size {tp_size})")
    if version <= 0 or block_size <= 0:
        raise ValueError(f"layout_version and block_size must be > 0 (got {version}, {block_size})")
    out = transfer_pb2.LayoutMetadata(
        model_id=model_id,
        num_layers=len(layers),
        block_size=block_size,
        layers=layers,
        prefill_tp_rank=tp_rank,
        prefill_tp_size=tp_size,
        data_endpoint=data_endpoint,
        host_id=host_id,
        layout_version=version,
    )
    if engine is not None:
        out.transfer_engine, out.engine_session = engine.engine, engine.session
        out.engine_segment_address = engine.segment_address
    return out
