"""The decode's reads through a transfer engine (transfer_backend "memfabric" or "mooncake"):
``EngineRows`` owns a started engine (``pdlink.memfabric.MemfabricTransfer``,
``pdlink.mooncake_transfer.MooncakeTransfer``: each has ``name``, ``session``, ``register``, ``read``,
``close``; what they raise when they cannot run here is an ``EngineCannotRun``) and a staging buffer
registered with it; ``layer_rows`` reads a layer's announced rows of every plane out of the memory
the prefill registered, in one batched read."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class EngineCannotRun(Exception):
    """Base of an engine module's errors that mean its engine cannot run here (not installed, refused at
    start-up or at registration): ``pdlink.engines`` reports them as ``EngineUnavailable``."""


class Transfer(Protocol):
    """A started transfer engine of this process."""

    name: str
    session: str

    def register(self, address: int, nbytes: int) -> None: ...

    def read(self, peer_session: str, local: Sequence[int], peer: Sequence[int], lengths: Sequence[int]) -> None: ...

    def close(self) -> None: ...


def check_ranges(local: Sequence[int], peer: Sequence[int], lengths: Sequence[int]) -> None:
    """A batched read's ranges: as many local addresses as peer addresses and lengths (ValueError)."""
    if not len(local) == len(peer) == len(lengths):
        raise ValueError(
            f"read needs as many local addresses ({len(local)}), peer addresses ({len(peer)}) "
            f"and lengths ({len(lengths)})"
        )


class EngineRows:
    """The decode's reads through ``transfer`` (which it owns and closes): a staging buffer of
    ``staging_bytes`` registered with it, and ``layer_rows``, the announced rows of a layer's planes
    read from the prefill session its layout names in one batched read, then copied out of the
    staging buffer (so the next read may reuse it: reads take turns)."""

    def __init__(self, transfer: Transfer, staging_bytes: int) -> None:
        if staging_bytes < 1:
            raise ValueError(f"staging_bytes must be >= 1, got {staging_bytes}")
        self.transfer = transfer
        self._staging = torch.empty(staging_bytes, dtype=torch.uint8)
        self._lock = threading.Lock()
        transfer.register(self._staging.data_ptr(), staging_bytes)

    @property
    def name(self) -> str:
        return self.transfer.name

    def layer_rows(self, meta, start: int, end: int, planes: Sequence[tuple[Any, int]]) -> list[torch.Tensor]:
        """Rows [start, end) of each plane, given as (``BufferRegion``, row bytes), out of the memory the
        prefill of layout ``meta`` registered: uint8 ``[end - start, row_bytes]`` per plane. ValueError
        when the layout or a region cannot give them or they exceed the staging buffer; the engine's
        error when the read fails."""
        if not meta.engine_session or not meta.engine_segment_address:
            raise ValueError("the prefill's layout names no engine_session / engine_segment_address")
        n = end - start
        for region, row_bytes in planes:
            if end > region.capacity_tokens or region.row_stride_bytes != row_bytes:
                raise ValueError(
                    f"buffer region of {region.capacity_tokens} rows x {region.row_stride_bytes} bytes "
                    f"cannot give rows [{start}, {end}) of {row_bytes} bytes"
                )
        sizes = [n * row_bytes for _, row_bytes in planes]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        if sum(sizes) > self._staging.numel():
            raise ValueError(
                f"rows [{start}, {end}) need {sum(sizes)} bytes; the {self.name} staging buffer holds "
                f"{self._staging.numel()}"
            )
        base = self._staging.data_ptr()
        ranges = [
            (base + off, meta.engine_segment_address + region.offset_bytes + start * row_bytes, size)
            for off, size, (region, row_bytes) in zip(offsets, sizes, planes, strict=True)
            if size
        ]
        with self._lock:
            if ranges:
                local, peer, lengths = (list(column) for column in zip(*ranges, strict=True))
                self.transfer.read(meta.engine_session, local, peer, lengths)
            return [
                self._staging[off : off + size].clone().view(n, row_bytes)
                for off, size, (_, row_bytes) in zip(offsets, sizes, planes, strict=True)
            ]

    def close(self) -> None:
        self.transfer.close()  # unregisters the staging buffer first
