"""Sparse-offload decode: a continuous batch over a host KV pool and a hot top-k device buffer.

The full main KV of every request lives in a host pool (one plane per layer, blocks owned by the
request). The device keeps only the indexer cache and, per request and layer, a hot buffer of
``topk_buffer_size`` slots. One step, per layer (DESIGN §1)::

    write the new token's KV row to the host pool          # native scatter
    append its indexer key to the device indexer cache
    select the top-k past tokens                           # lightning indexer
    hot cache: each selected token -> slot, misses listed  # kvcore.hotcache
    gather the misses from the host pool into their slots  # native gather
    sparse attention over the selected slots, in top-k order

``keep_device_kv_cache=True`` also keeps the full KV on device and attends the same top-k from it
(the reference of I2). Requests join and leave between steps; residency is keyed by request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvcore.blockkeys import request_block_key
from kvcore.device import DeviceAllocator
from kvcore.gather import gather_rows, scatter_rows
from kvcore.hostpool import HostPoolBackend
from kvcore.hotcache import HotCache

from dsamodel.attention import batched_indexer_topk, sparse_mla_attention
from dsamodel.model import DSAModel


@dataclass
class DecodeSeq:
    """One admitted request: its device row (``seq_slot``), length and host-pool blocks."""

    request_id: str
    seq_slot: int
    num_tokens: int = 0  # tokens whose KV is written
    block_keys: list[bytes] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_keys)


@dataclass
class StepStats:
    """What the last step moved: hot-cache hits/misses and host-to-device bytes."""

    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class SparseDecoder:
    """Decode engine state for up to ``max_num_seqs`` requests of up to ``max_model_len`` tokens."""

    def __init__(
        self,
        model: DSAModel,
        pool: HostPoolBackend,
        *,
        topk_buffer_size: int,
        max_num_seqs: int,
        max_model_len: int,
        keep_device_kv_cache: bool = False,
        allocator: DeviceAllocator | None = None,
        native: bool = True,
    ) -> None:
        cfg = model.config
        self.model, self.pool = model, pool
        self.block_size = pool.geometry.block_size
        self.max_model_len = max_model_len
        self.topk = cfg.index_topk
        if topk_buffer_size < self.topk or topk_buffer_size % self.block_size:
            raise ValueError(
                f"topk_buffer_size={topk_buffer_size} must be >= index_topk={self.topk} and divisible by "
                f"block_size={self.block_size}"
            )
        self.keep_device_kv_cache = keep_device_kv_cache
        self.native = native
        n_layers = len(model.cache_layers)
        self._planes = [pool.geometry.plane_index(i, "main") for i in range(n_layers)]
        self.allocator = allocator or DeviceAllocator(model.device)
        width, idx_width, dtype = cfg.kv_row_width, cfg.index_head_dim, model.dtype
        self.max_blocks = -(-max_model_len // self.block_size)
        rows = self.max_blocks * self.block_size
        # indexer: [L, S, rows, Di]; hot: [L, S, capacity, W]; full (debug only): [L, S, rows, W]
        self.indexer = self.allocator.zeros((n_layers, max_num_seqs, rows, idx_width), dtype, "decode.indexer")
        self.hot = None if keep_device_kv_cache else self.allocator.zeros(
            (n_layers, max_num_seqs, topk_buffer_size, width), dtype, "decode.hot")
        self.full = self.allocator.zeros((n_layers, max_num_seqs, rows, width), dtype, "decode.full_kv") \
            if keep_device_kv_cache else None
        self.hotcache = None if keep_device_kv_cache else HotCache(topk_buffer_size, n_layers, native=native)
        self.block_table = torch.full((max_num_seqs, self.max_blocks), -1, dtype=torch.int32)  # host
        self.seqs: dict[str, DecodeSeq] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.last_step = StepStats()

    # ---- admission ----------------------------------------------------------------------------

    def can_admit(self, num_tokens: int) -> bool:
        """Side-effect-free: a sequence slot and host blocks for ``num_tokens`` are available."""
        if not self._free_slots or num_tokens > self.max_model_len:
            return False
        return self.pool.can_alloc(_probe_keys(-(-num_tokens // self.block_size)))

    def admit(self, request_id: str, num_tokens: int) -> DecodeSeq:
        """Reserve a device row and host-pool blocks for ``num_tokens`` prompt tokens."""
        if request_id in self.seqs:
            raise ValueError(f"request {request_id!r} is already admitted")
        if not 1 <= num_tokens <= self.max_model_len:
            raise ValueError(f"prompt of {num_tokens} tokens: must be 1..max_model_len={self.max_model_len}")
        if not self._free_slots:
            raise RuntimeError(f"decode is full: all {self.indexer.shape[1]} sequence slots are in use")
        seq = DecodeSeq(request_id, self._free_slots.pop())
        try:
            self._grow(seq, num_tokens)
        except BaseException:
            self._free_slots.append(seq.seq_slot)
            raise
        self.seqs[request_id] = seq
        return seq

    def write_prompt_layer(self, request_id: str, layer: int, kv: torch.Tensor, index_k: torch.Tensor) -> None:
        """Install ``layer``'s prompt rows: kv [P, W] into the host pool, index_k [P, Di] on device."""
        seq = self.seqs[request_id]
        p = kv.shape[0]
        if p > seq.num_blocks * self.block_size or index_k.shape[0] != p:
            raise ValueError(f"prompt rows ({p} kv, {index_k.shape[0]} index) exceed the {seq.num_blocks} admitted blocks")
        positions = torch.arange(p)
        scatter_rows(self.pool.plane(self._planes[layer]), self._slot_mapping(seq, positions),
                     _bytes(kv), native=self.native)
        self.indexer[layer, seq.seq_slot, :p] = index_k.to(self.indexer.device)
        if self.full is not None:
            self.full[layer, seq.seq_slot, :p] = kv.to(self.full.device)

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
        self.block_table[seq.seq_slot] = -1
        self.pool.remove(seq.block_keys)
        self._free_slots.append(seq.seq_slot)

    def _grow(self, seq: DecodeSeq, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size)
        if need > self.max_blocks:
            raise ValueError(f"request {seq.request_id!r} would exceed max_model_len={self.max_model_len}")
        keys = [request_block_key(seq.request_id, b) for b in range(seq.num_blocks, need)]
        if keys:
            ids = self.pool.alloc(keys)
            self.block_table[seq.seq_slot, seq.num_blocks:need] = torch.tensor(ids, dtype=torch.int32)
            seq.block_keys.extend(keys)

    def _slot_mapping(self, seq: DecodeSeq, positions: torch.Tensor) -> torch.Tensor:
        blocks = self.block_table[seq.seq_slot, positions // self.block_size].to(torch.int64)  # [n]
        return blocks * self.block_size + positions % self.block_size  # [n] int64

    # ---- one step -----------------------------------------------------------------------------

    def step(self, request_ids: list[str], tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per request and return next-token logits [R, V] (float32)."""
        seqs = [self.seqs[r] for r in request_ids]
        if tokens.shape != (len(seqs),):
            raise ValueError(f"tokens must be [R] = [{len(seqs)}], got {list(tokens.shape)}")
        for seq in seqs:
            self._grow(seq, seq.num_tokens + 1)
        model = self.model
        dev = model.device
        positions = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long)  # [R]
        seq_slots = torch.tensor([s.seq_slot for s in seqs], dtype=torch.long)  # [R]
        mapping = self.block_table[seq_slots, positions // self.block_size].to(torch.int64) \
            * self.block_size + positions % self.block_size  # [R]
        ctx = int(positions.max()) + 1
        stable = (positions + 1).tolist()  # every written token is final (no speculative suffix)
        stats = StepStats()
        h = model.embed(tokens.to(dev))  # [R, D]
        pos_dev = positions.to(dev)
        for layer in model.layers:  # MTP layers take no part in plain (non-speculative) decode
            i = layer.cache_index
            proj = layer.project(h, pos_dev)
            scatter_rows(self.pool.plane(self._planes[i]), mapping, _bytes(proj.kv), native=self.native)
            self.indexer[i, seq_slots.to(dev), pos_dev] = proj.index_k
            keys = self.indexer[i, seq_slots.to(dev), :ctx]  # [R, C, Di]
            topk = batched_indexer_topk(proj.index_q, proj.index_w, keys, pos_dev, self.topk)  # [R, k]
            valid = topk >= 0
            if self.full is not None:
                self.full[i, seq_slots.to(dev), pos_dev] = proj.kv
                rows = self.full[i][seq_slots.to(dev)[:, None], topk.clamp(min=0)]  # [R, k, W]
            else:
                rows = self._hot_rows(i, request_ids, seq_slots, topk, stable, stats)
            lat = sparse_mla_attention(proj.q_latent, proj.q_rope, rows, valid, layer.softmax_scale)
            h = layer.finish(h, lat)
        for seq in seqs:
            seq.num_tokens += 1
        self.last_step = stats
        return model.logits(h)

    def _hot_rows(self, layer, request_ids, seq_slots, topk, stable, stats: StepStats) -> torch.Tensor:
        """Resolve the top-k against the hot cache, gather misses, return rows [R, k, W] in top-k order."""
        res = self.hotcache.resolve(layer, request_ids, topk.cpu().contiguous(), stable)
        hot = self.hot[layer]  # [S, capacity, W]
        if res.miss_rows.numel():
            gather_rows(
                self.pool.plane(self._planes[layer]), self.block_table[seq_slots], res.miss_rows,
                res.miss_tokens, hot.view(torch.uint8) if hot.dtype != torch.uint8 else hot,
                seq_slots.to(torch.int32), res.miss_slots, native=self.native,
            )
        stats.hits += res.num_hits
        stats.misses += res.num_misses
        stats.h2d_bytes += res.num_misses * hot.shape[-1] * hot.element_size()
        slots = res.slots.to(torch.long).clamp(min=0).to(hot.device)  # [R, k]
        return hot[seq_slots.to(hot.device)[:, None], slots]  # [R, k, W]


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """[n, W] rows on any device -> contiguous CPU uint8 [n, W * itemsize]."""
    rows = rows.detach().to("cpu").contiguous()
    return rows.view(torch.uint8).view(rows.shape[0], -1)


def _probe_keys(n: int) -> list[bytes]:
    return [request_block_key("\x00admission-probe", b) for b in range(n)]
