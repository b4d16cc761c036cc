"""The remote D2H connector's bookkeeping, without vLLM: what each step sends, what has landed.

Producer, scheduler side (``SendPlanner``): a request whose ``kv_transfer_params`` name a decode
(``remote_host``/``remote_port``, as the proxy's ``/v1/metaserver`` hands them to the prefill) is
sent as its prompt is computed: every step that computes prompt tokens ``[s, e)`` of it yields a
``Send`` of the token range ``[0 or s, e)`` (the first send of a request starts at 0, so a local
prefix-cache hit reaches the decode too) with the request's vLLM block ids per KV cache group as the
scheduler holds them in that step (a sliding window's blocks that fell out of it are vLLM's null
block there, never the stale ids a worker's block table keeps). Only prompt tokens are sent: the
decode computes the last one itself.

Consumer, worker side (``Coverage``, one per KV cache group): which tokens of every layer of the
group of one request have landed in its vLLM blocks. Between vLLM engines the unit of transfer is
the whole block (a block's bytes are not token-contiguous), so a range ``[s, e)`` moves blocks
``s // bs .. ceil(e / bs) - 1`` (``bs``: the group's block size), and the last of them may be valid
only in part. Ranges may land in any order, and a block copied early holds fewer valid tokens than
the same block copied later: a block is written only when the copy at hand holds more valid tokens
than the one already there, so an older, shorter copy never overwrites a newer one. Blocks before
``first_block`` (the decode's own prefix-cache hit) and blocks that are the decode's null block (a
sliding window's blocks outside the window) are not needed: never written, never pulled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvoffload_vllm.kv_groups import NULL_BLOCK
from openai_api.body import RequestError
from openai_api.transfer_params import KVTransferParams


@dataclass(frozen=True)
class Peer:
    """Where a request's KV goes (producer) or came from (consumer): the control endpoints of the
    decode's TP ranks, in rank order (``KVTransferParams.decode_endpoints``), and the id both sides
    use for the request (the proxy's child id)."""

    transfer_id: str
    endpoints: tuple[str, ...]

    @property
    def endpoint(self) -> str:
        """The control endpoint of the decode's TP rank 0 (the one it registered)."""
        return self.endpoints[0]

    @property
    def decode_tp(self) -> int:
        return len(self.endpoints)


@dataclass(frozen=True)
class Send:
    """Tokens ``[start, end)`` of request ``req_id`` are computed by the end of this step;
    ``block_ids[g]``: its vLLM blocks of KV cache group g in this step."""

    req_id: str
    peer: Peer
    start: int
    end: int
    prompt_len: int
    block_ids: tuple[tuple[int, ...], ...]


def peer_of(params: KVTransferParams | None) -> Peer | None:
    """The decode a prefill request sends to, from its ``kv_transfer_params``; None when they name
    none. ValueError when the params name a decode incompletely."""
    if params is None or not params.names_decode:
        return None
    if not params.remote_host or params.remote_port is None or not params.request_id:
        raise ValueError(
            f"kv_transfer_params must give remote_host (str), remote_port (1..65535) and request_id "
            f"(str) together; got {params.wire()!r}"
        )
    try:
        return Peer(params.request_id, tuple(params.decode_endpoints()))  # checks every TP rank's port
    except RequestError as exc:
        raise ValueError(str(exc)) from None


@dataclass
class _Outgoing:
    peer: Peer
    prompt_len: int
    sent_to: int = 0  # prompt tokens covered by sends so far


class SendPlanner:
    """Producer scheduler side: per request its decode; per step its sends."""

    def __init__(self) -> None:
        self._reqs: dict[str, _Outgoing] = {}

    def allocated(self, req_id: str, peer: Peer, prompt_len: int) -> None:
        if req_id not in self._reqs:
            self._reqs[req_id] = _Outgoing(peer, prompt_len)

    def sends(self, req_id: str) -> bool:
        """Whether ``req_id`` goes to a decode."""
        return req_id in self._reqs

    def step(self, req_id: str, block_ids: Sequence[Sequence[int]], computed: int, scheduled: int) -> Send | None:
        """One scheduled step of ``req_id``: ``block_ids`` all its blocks per KV cache group now;
        ``computed`` tokens before the step, ``scheduled`` in it. None when nothing is to send."""
        req = self._reqs.get(req_id)
        if req is None:
            return None
        end = min(computed + scheduled, req.prompt_len)
        if end <= req.sent_to:
            return None
        start, req.sent_to = req.sent_to, end
        return Send(req_id, req.peer, start, end, req.prompt_len, tuple(tuple(ids) for ids in block_ids))

    def finished(self, req_id: str) -> bool:
        """Forget ``req_id``; True if anything of it was sent (its blocks must outlive the reads)."""
        req = self._reqs.pop(req_id, None)
        return req is not None and req.sent_to > 0


def blocks_of(start: int, end: int, block_size: int) -> range:
    """The block indices that hold tokens ``[start, end)``."""
    return range(start // block_size, -(-end // block_size)) if end > start else range(0)


class Coverage:
    """Consumer side: valid tokens per (layer, block) of one KV cache group (``num_layers`` layers,
    ``block_size`` tokens per block) of one request's ``num_tokens`` to load into its ``block_ids``;
    with ``slices`` > 1 per (layer, slice, block): each block of a layer is filled by that many
    prefill ranks' head slices (``kvoffload_vllm.d2h_tp``), row ``layer × slices + slice``."""

    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        block_size: int,
        first_block: int = 0,
        block_ids: Sequence[int] = (),
        slices: int = 1,
    ) -> None:
        self.num_tokens, self.block_size, self.first_block = num_tokens, block_size, first_block
        self.num_layers, self.slices = num_layers, slices
        nblocks = -(-num_tokens // block_size)
        self.needed = torch.tensor(
            [min(block_size, num_tokens - b * block_size) for b in range(nblocks)], dtype=torch.int32
        )
        ids = torch.tensor(block_ids[:nblocks], dtype=torch.long)
        self.needed[: len(ids)][ids == NULL_BLOCK] = 0  # the null block's tokens are not this decode's to hold
        self.valid = torch.zeros((num_layers * slices, nblocks), dtype=torch.int32)
        self.valid[:, :first_block] = self.needed[:first_block]

    def to_write(self, row: int, start: int, end: int) -> torch.Tensor:
        """Indices (into ``blocks_of(start, end)``) of the blocks of ``row`` (a layer, or a layer's
        slice) a copy of ``[start, end)`` improves."""
        blocks = blocks_of(start, min(end, self.num_tokens), self.block_size)
        if not len(blocks):
            return torch.empty(0, dtype=torch.long)
        b = torch.arange(blocks.start, blocks.stop)
        have = (torch.clamp(end - b * self.block_size, max=self.block_size)).to(torch.int32)
        valid = self.valid[row, blocks.start : blocks.stop]
        better = (have > valid) & (valid < self.needed[blocks.start : blocks.stop])
        return torch.nonzero(better).flatten()

    def landed(self, row: int, start: int, end: int, written: torch.Tensor) -> None:
        """The blocks ``written`` (from ``to_write``) of ``[start, end)`` of ``row`` are in place."""
        blocks = blocks_of(start, min(end, self.num_tokens), self.block_size)
        idx = written + blocks.start
        have = torch.clamp(end - idx * self.block_size, max=self.block_size).to(torch.int32)
        self.valid[row, idx] = torch.maximum(self.valid[row, idx], torch.minimum(have, self.needed[idx]))

    def layers_done(self) -> int:
        done = (self.valid >= self.needed).all(dim=1).view(self.num_layers, self.slices)
        return int(done.all(dim=1).sum())

    @property
    def complete(self) -> bool:
        return bool((self.valid >= self.needed).all())
