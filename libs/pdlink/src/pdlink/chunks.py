"""The producer's side of the data path: a LayerSource's answer to ReadLayer, the requested rows as
``DataChunk`` messages of at most ``MAX_CHUNK_BYTES`` (transfer.proto), which ``pdlink.sources``
reassembles."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvoffload_proto.v1 import MAX_CHUNK_BYTES, transfer_pb2

__all__ = ["MAX_CHUNK_BYTES", "data_chunks"]


def data_chunks(data: torch.Tensor) -> Iterator[transfer_pb2.DataChunk]:
    """``data`` (contiguous uint8, 1-D) as DataChunks in order, each of at most ``MAX_CHUNK_BYTES`` and
    naming the ``total_bytes``; an empty ``data`` is one empty chunk (offset 0, total 0)."""
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError(
            f"data_chunks takes a contiguous 1-D uint8 tensor, not {data.dtype} of shape {tuple(data.shape)}"
        )
    total = data.numel()
    raw = data.numpy().tobytes()
    for off in range(0, total, MAX_CHUNK_BYTES):
        yield transfer_pb2.DataChunk(offset_bytes=off, data=raw[off : off + MAX_CHUNK_BYTES], total_bytes=total)
    if total == 0:
        yield transfer_pb2.DataChunk(offset_bytes=0, data=b"", total_bytes=0)
