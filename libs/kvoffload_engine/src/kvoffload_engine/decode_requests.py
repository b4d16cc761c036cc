"""The requests a ``SparseDecoder`` holds: admission, host-pool blocks and prompt rows.

A request is admitted in two moves: ``reserve`` takes the host-pool blocks of its prompt (its
pulled indexer keys wait in host staging rows), ``bind`` gives it a sequence slot, the device row
of the indexer cache (and of the hot buffer) it steps in; ``admit`` does both. Prompt rows are
installed layer by layer (``write_prompt_layer``: whole blocks with one copy each, the ragged edges
row by row), blocks are added as a request grows, and ``finish`` frees everything it held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcore.hotcache.cache import HotCache
from kvcore.hotcache.gather import scatter_rows
from kvcore.pool.attached import AttachedPool
from kvcore.pool.block_keys import request_block_key
from kvcore.pool.host_pool import HostPoolBackend
from kvoffload_engine.prefetch import MissPrefetcher


@dataclass
class DecodeSeq:
    """One admitted request: its device row (``seq_slot``; None while it waits for one), length and
    host-pool blocks. An unbound request keeps its pulled indexer keys in host staging rows until
    ``bind`` copies them into the device row it gets."""

    request_id: str
    seq_slot: int | None
    num_tokens: int = 0  # tokens whose KV is written
    block_keys: list[bytes] = field(default_factory=list)
    # runs of consecutive pool blocks, [first logical block, first pool block, length], in order:
    # a pulled prompt is installed with one copy per run (usually one), no per-call index math
    runs: list[list[int]] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # pool block of each logical block
    staged_index: torch.Tensor | None = None  # unbound: [L, rows, Di] on the host
    staged_full: torch.Tensor | None = None  # unbound with keep_device_kv_cache: [L, rows, W]

    @property
    def num_blocks(self) -> int:
        return len(self.block_keys)


class DecodeRequests:
    """Admission and bookkeeping of a ``SparseDecoder``'s requests. The state is the decoder's,
    set in ``SparseDecoder.__init__``; this class holds the methods that change which requests
    hold which sequence slots and host-pool blocks."""

    pool: HostPoolBackend | AttachedPool  # a TP follower's: rank 0's pool, attached
    native: bool
    block_size: int
    max_model_len: int
    max_blocks: int
    indexer: torch.Tensor  # [L, S, rows, Di]
    full: torch.Tensor | None  # [L, S, rows, W] with keep_device_kv_cache
    hotcache: HotCache | None
    prefetcher: MissPrefetcher | None
    block_table: torch.Tensor  # [S, max_blocks] int32, host
    seqs: dict[str, DecodeSeq]
    _free_slots: list[int]
    _planes: list[int]

    @property
    def free_slots(self) -> int:
        """Sequence slots (device rows) free now."""
        return len(self._free_slots)

    def can_admit(self, num_tokens: int) -> bool:
        """Side-effect-free: a sequence slot and host blocks for ``num_tokens`` are available."""
        return bool(self._free_slots) and self.can_reserve(num_tokens)

    def can_reserve(self, num_tokens: int) -> bool:
        """Side-effect-free: host blocks for ``num_tokens`` are available (no sequence slot needed)."""
        if num_tokens > self.max_model_len:
            return False
        return self.pool.can_alloc(_probe_keys(-(-num_tokens // self.block_size)))

    def admit(self, request_id: str, num_tokens: int) -> DecodeSeq:
        """Reserve a device row and host-pool blocks for ``num_tokens`` prompt tokens."""
        if not self._free_slots:
            raise RuntimeError(f"decode is full: all {self.indexer.shape[1]} sequence slots are in use")
        seq = self.reserve(request_id, num_tokens)
        self.bind(request_id)
        return seq

    def reserve(self, request_id: str, num_tokens: int) -> DecodeSeq:
        """Reserve host-pool blocks for ``num_tokens`` prompt tokens, without a device row: the prompt
        can be installed (its indexer keys go to host staging rows) while the request waits for a
        sequence slot; ``bind`` gives it one before it may step."""
        if request_id in self.seqs:
            raise ValueError(f"request {request_id!r} is already admitted")
        if not 1 <= num_tokens <= self.max_model_len:
            raise ValueError(f"prompt of {num_tokens} tokens: must be 1..max_model_len={self.max_model_len}")
        seq = DecodeSeq(request_id, None)
        self._grow(seq, num_tokens)
        rows = seq.num_blocks * self.block_size
        seq.staged_index = torch.zeros((self.indexer.shape[0], rows, self.indexer.shape[-1]), dtype=self.indexer.dtype)
        if self.full is not None:
            seq.staged_full = torch.zeros((self.full.shape[0], rows, self.full.shape[-1]), dtype=self.full.dtype)
        self.seqs[request_id] = seq
        return seq

    def bind(self, request_id: str) -> None:
        """Give a reserved request a free device row and move its staged prompt rows into it. The
        caller guarantees no ``write_prompt_layer`` of this request runs meanwhile."""
        seq = self.seqs[request_id]
        if seq.seq_slot is not None:
            return
        if not self._free_slots:
            raise RuntimeError(f"decode is full: all {self.indexer.shape[1]} sequence slots are in use")
        slot = self._free_slots.pop()
        seq.seq_slot = slot
        self.block_table[slot, : seq.num_blocks] = torch.tensor(seq.block_ids, dtype=torch.int32)
        # an unbound request holds its prompt rows on the host (``reserve``; full rows with a full cache)
        assert seq.staged_index is not None
        n = seq.staged_index.shape[1]
        self.indexer[:, slot, :n] = seq.staged_index.to(self.indexer.device)
        if self.full is not None:
            assert seq.staged_full is not None
            self.full[:, slot, :n] = seq.staged_full.to(self.full.device)
        seq.staged_index = seq.staged_full = None

    def write_prompt_layer(
        self, request_id: str, layer: int, kv: torch.Tensor, index_k: torch.Tensor, start: int = 0
    ) -> None:
        """Install rows [start, start + n) of ``layer`` (any cache layer, MTP included): kv [n, W] into
        the host pool, index_k [n, Di] into the device indexer cache."""
        seq = self.seqs[request_id]
        n = kv.shape[0]
        if start < 0 or start + n > seq.num_blocks * self.block_size or index_k.shape[0] != n:
            raise ValueError(
                f"rows [{start}, {start + n}) ({n} kv, {index_k.shape[0]} index) exceed the "
                f"{seq.num_blocks} admitted blocks of request {request_id!r}"
            )
        if not 0 <= layer < self.indexer.shape[0]:
            raise ValueError(f"layer {layer} outside 0..{self.indexer.shape[0] - 1}")
        self._install_rows(seq, layer, start, as_row_bytes(kv))
        if seq.seq_slot is None:  # waiting for a device row: stage on the host
            assert seq.staged_index is not None  # set by ``reserve`` until ``bind``
            seq.staged_index[layer, start : start + n] = index_k.to(seq.staged_index.device)
            if seq.staged_full is not None:
                seq.staged_full[layer, start : start + n] = kv.to(seq.staged_full.device)
            return
        self.indexer[layer, seq.seq_slot, start : start + n] = index_k.to(self.indexer.device)
        if self.full is not None:
            self.full[layer, seq.seq_slot, start : start + n] = kv.to(self.full.device)

    def _install_rows(self, seq: DecodeSeq, layer: int, start: int, rows: torch.Tensor) -> None:
        """rows [n, row_bytes] -> the host pool at positions [start, start + n): whole blocks with one
        block copy each, the ragged edges row by row (native scatter)."""
        plane = self.pool.plane(self._planes[layer])  # [num_blocks, block_size, row_bytes]
        bs, n = self.block_size, rows.shape[0]
        first_full = -(-start // bs)  # first block that starts inside the range
        end_full = (start + n) // bs  # one past the last block that ends inside it
        if end_full > first_full:
            lo, hi = first_full * bs - start, end_full * bs - start
            for first, pool_block, length in seq.runs:  # runs of consecutive pool blocks: one memcpy each
                a, b = max(first, first_full), min(first + length, end_full)
                if a < b:
                    plane[pool_block + a - first : pool_block + b - first].copy_(
                        rows[a * bs - start : b * bs - start].view(b - a, bs, -1)
                    )
            edges = torch.cat((torch.arange(0, lo), torch.arange(hi, n))) if lo or hi < n else None
        else:
            edges = torch.arange(n)
        if edges is not None and edges.numel():
            scatter_rows(plane, self._slot_mapping(seq, edges + start), rows[edges].contiguous(), native=self.native)

    def set_prompt_done(self, request_id: str, num_tokens: int) -> None:
        """Every layer of the first ``num_tokens`` rows is installed."""
        self.seqs[request_id].num_tokens = num_tokens

    def finish(self, request_id: str) -> None:
        """Free the request's device row, hot-cache residency and host blocks."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        if self.hotcache is not None:
            self.hotcache.finish(request_id)
        if self.prefetcher is not None:
            self.prefetcher.forget(request_id)
        self.pool.remove(seq.block_keys)
        if seq.seq_slot is not None:
            self.block_table[seq.seq_slot] = -1
            self._free_slots.append(seq.seq_slot)

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Host blocks for the request's first ``num_tokens`` tokens (those it lacks are allocated)."""
        self._grow(self.seqs[request_id], num_tokens)

    def _grow(self, seq: DecodeSeq, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size)
        if need > self.max_blocks:
            raise ValueError(f"request {seq.request_id!r} would exceed max_model_len={self.max_model_len}")
        keys = [request_block_key(seq.request_id, b) for b in range(seq.num_blocks, need)]
        if keys:
            ids = self.pool.alloc(keys)
            if seq.seq_slot is not None:
                self.block_table[seq.seq_slot, seq.num_blocks : need] = torch.tensor(ids, dtype=torch.int32)
            t = torch.tensor(ids)
            cuts = [0, *((t[1:] != t[:-1] + 1).nonzero().flatten() + 1).tolist(), len(ids)]
            for a, b in zip(cuts, cuts[1:]):
                last = seq.runs[-1] if seq.runs else None
                if last is not None and last[1] + last[2] == ids[a] and last[0] + last[2] == seq.num_blocks + a:
                    last[2] += b - a  # continues the previous run
                else:
                    seq.runs.append([seq.num_blocks + a, ids[a], b - a])
            seq.block_keys.extend(keys)
            seq.block_ids.extend(ids)

    def _slot_mapping(self, seq: DecodeSeq, positions: torch.Tensor) -> torch.Tensor:
        blocks = torch.tensor(seq.block_ids, dtype=torch.int64)[positions // self.block_size]  # [n]
        return blocks * self.block_size + positions % self.block_size  # [n] int64


def as_row_bytes(rows: torch.Tensor) -> torch.Tensor:
    """[n, W] rows on any device -> contiguous CPU uint8 [n, W * itemsize]."""
    rows = rows.detach().to("cpu").contiguous()
    return rows.view(torch.uint8).view(rows.shape[0], -1)


def _probe_keys(n: int) -> list[bytes]:
    return [request_block_key("\x00admission-probe", b) for b in range(n)]
