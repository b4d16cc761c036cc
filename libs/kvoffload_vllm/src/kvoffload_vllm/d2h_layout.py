"""Whether a prefill's layout fits this vLLM decode worker's (``Consumer.layout_problem``): layer by
layer, the rows' bytes and dtype, no indexer plane, and under tensor parallel the head slice each
prefill rank fills of this rank's rows (``kvoffload_vllm.d2h_tp``); with a transfer engine, the
prefill's block addresses. An empty answer accepts; anything else names both sides."""

from __future__ import annotations

from kvoffload_proto.v1 import transfer_pb2
from kvoffload_vllm.d2h_layers import D2HLayers
from kvoffload_vllm.d2h_settings import D2HSettings
from kvoffload_vllm.d2h_tp import HeadSlice, head_slice, slice_problem


def layout_problem(m: transfer_pb2.LayoutMetadata, layers: D2HLayers, settings: D2HSettings, *, in_place: bool) -> str:
    """What does not fit between the prefill's layout ``m`` and this worker's ``layers`` ("" when all
    does); ``in_place``: the blocks are read through a transfer engine, which needs their addresses."""
    if in_place:
        for got in m.layers:
            if not got.engine_block_address or not got.engine_block_stride_bytes:
                return (
                    f"layers[{got.layer}].engine_block_address: the prefill names no block addresses in "
                    f"its {m.transfer_engine!r} session; a vLLM decode reads a vLLM prefill's blocks"
                )
    for i, got in enumerate(m.layers):
        row_bytes, dtype = layers.row_bytes(i), layers.dtypes[i]
        part = layer_slice(m, i, layers, settings.tp_size)
        if got.layer != i or isinstance(part, str) or got.main_dtype != dtype or got.indexer_row_bytes:
            return (
                f"layers[{i}]: prefill layer {got.layer} rows {got.main_row_bytes} bytes {got.main_dtype} "
                f"(indexer {got.indexer_row_bytes}), decode layer {i} ({layers.names[i]}) rows "
                f"{row_bytes} bytes {dtype} (no indexer){f': {part}' if isinstance(part, str) else ''}"
            )
        problem = slice_problem(part, layers, i, settings.kv_heads, in_place)
        if problem:
            return f"layers[{i}] ({layers.names[i]}): {problem}"
    return ""


def layer_slice(m: transfer_pb2.LayoutMetadata, layer: int, layers: D2HLayers, tp_size: int) -> HeadSlice | str:
    """The part of each of this rank's rows of ``layer`` the prefill rank of layout ``m`` fills."""
    return head_slice(
        m.layers[layer].main_row_bytes, layers.row_bytes(layer), m.prefill_tp_size, m.prefill_tp_rank, tp_size
    )
