"""Sparse-offload decode: a continuous batch over a host KV pool and a hot top-k device buffer.

The full main KV of every request lives in a host pool (one plane per layer, blocks owned by the
request). The device keeps only the indexer cache and, per request and layer, a hot buffer of
``topk_buffer_size`` slots. One step, per layer (DESIGN §1)::

    write the new token's KV row to the host pool          # native scatter
    append its indexer key to the device indexer cache
    select the top-k past tokens                           # lightning indexer
    hot cache: each selected token -> slot, misses listed  # kvcore.hotcache.cache
    gather the misses from the host pool into their slots  # native gather
    sparse attention over the selected slots, in top-k order

``keep_device_kv_cache=True`` also keeps the full KV on device and attends the same top-k from it
(the reference of I2). Requests join and leave between steps; residency is keyed by request.

**Miss prefetch** (``miss_prefetch=True``): while a layer runs, the rows the next layer is predicted
to miss are gathered on a background thread; its misses found there skip the host-pool gather
(``kvoffload_engine.prefetch``; results unchanged, I2). ``StepStats`` counts the rows loaded early,
the misses they served, the loads dropped as late and the seconds the step spent loading misses on
its critical path.

**Top-k override** (benchmarks and tests): ``topk_override`` replaces the indexer's choice with a
given one, e.g. a trace (``kvoffload_engine.topk_override`` says what it is given and must return).

Admission, prompt install and the requests' bookkeeping are ``kvoffload_engine.decode_requests``'s
(``SparseDecoder`` is a ``DecodeRequests``); this module is the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dsamodel.model import DSAModel
from dsamodel.served import ServedModel, index_keys, index_topk
from kvcore.config.names import DEFAULT_HOT_CACHE_POLICY
from kvcore.device import DeviceAllocator
from kvcore.hotcache.cache import HotCache
from kvcore.hotcache.gather import gather_rows, scatter_rows
from kvcore.pool.attached import AttachedPool
from kvcore.pool.host_pool import HostPoolBackend
from kvoffload_engine.decode_requests import DecodeRequests, DecodeSeq, as_row_bytes
from kvoffload_engine.prefetch import MissPrefetcher
from kvoffload_engine.topk_override import TopkOverride, overridden_topk


@dataclass
class StepStats:
    """What the last step moved: hot-cache hits/misses and host-to-device bytes (``h2d_bytes``: the
    bytes of the rows copied into the hot buffers, counted at each copy, gathered from the host pool
    or taken from the prefetch staging: every miss's row, early or not); with miss prefetch, the
    rows loaded early (``prefetched``), the misses they served (``prefetch_hits``: their H2D was off
    the critical path) and ``load_s``, the seconds the step spent loading misses on its critical
    path (gathers, copies from staging, waits for a prefetch)."""

    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0
    prefetch_late: int = 0  # layers whose early load was not done in time (dropped)
    load_s: float = 0.0
    layer_hits: dict[int, int] = field(default_factory=dict)
    layer_misses: dict[int, int] = field(default_factory=dict)

    def layer_hit_rate(self, layer: int) -> float:
        total = self.layer_hits.get(layer, 0) + self.layer_misses.get(layer, 0)
        return self.layer_hits.get(layer, 0) / total if total else 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class SparseDecoder(DecodeRequests):
    """Decode engine state for up to ``max_num_seqs`` requests of up to ``max_model_len`` tokens."""

    def __init__(
        self,
        model: ServedModel,
        pool: HostPoolBackend | AttachedPool,
        *,
        topk_buffer_size: int,
        max_num_seqs: int,
        max_model_len: int,
        keep_device_kv_cache: bool = False,
        allocator: DeviceAllocator | None = None,
        native: bool = True,
        topk_override: TopkOverride | None = None,
        hot_cache_policy: str = DEFAULT_HOT_CACHE_POLICY,
        miss_prefetch: bool = False,
    ) -> None:
        cfg = model.config
        self.model, self.pool = model, pool
        self.block_size = pool.geometry.block_size
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.topk = index_topk(model)  # a model without an indexer cannot decode sparsely: ValueError
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
        width, dtype = cfg.kv_row_width, model.dtype
        self.max_blocks = -(-max_model_len // self.block_size)
        rows = self.max_blocks * self.block_size
        # indexer: [L, S, rows, Di]; hot: [L, S, capacity, W]; full (debug only): [L, S, rows, W]
        idx_dtype, idx_width = model.index_codec.storage(dtype)  # fp8 indexer: uint8 rows of keys + scales
        self.indexer = self.allocator.zeros((n_layers, max_num_seqs, rows, idx_width), idx_dtype, "decode.indexer")
        self.hot = (
            None
            if keep_device_kv_cache
            else self.allocator.zeros((n_layers, max_num_seqs, topk_buffer_size, width), dtype, "decode.hot")
        )
        self.full = (
            self.allocator.zeros((n_layers, max_num_seqs, rows, width), dtype, "decode.full_kv")
            if keep_device_kv_cache
            else None
        )
        self.hotcache = (
            None
            if keep_device_kv_cache
            else HotCache(topk_buffer_size, n_layers, native=native, policy=hot_cache_policy)
        )
        self.prefetcher = (
            MissPrefetcher(self.hotcache, native=native) if miss_prefetch and self.hotcache is not None else None
        )
        self._gather_in_place = self.indexer.device.type == "cpu"  # else: staging + one copy per layer
        self.block_table = torch.full((max_num_seqs, self.max_blocks), -1, dtype=torch.int32)  # host
        self.seqs: dict[str, DecodeSeq] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.last_step = StepStats()
        self.topk_override = topk_override  # kvoffload_engine.topk_override: replaces the indexer's choice

    # ---- one step -----------------------------------------------------------------------------

    def step(self, request_ids: list[str], tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per request and return next-token logits [R, V] (float32)."""
        if tokens.shape != (len(request_ids),):
            raise ValueError(f"tokens must be [R] = [{len(request_ids)}], got {list(tokens.shape)}")
        logits, _ = self.forward(request_ids, [[int(t)] for t in tokens])
        for r in request_ids:
            self.commit(r, self.seqs[r].num_tokens + 1)
        return logits

    def forward(self, request_ids: list[str], tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Base layers over ``tokens[r]`` at positions ``num_tokens[r]...``: (logits [N, V], h [N, D]).

        The first token of each request is final; the others are a speculative suffix (drafts): their
        KV is written but stays out of the hot cache, and ``commit`` decides how much became final.
        """
        seqs = [self.seqs[r] for r in request_ids]
        if len(tokens) != len(seqs) or any(not t for t in tokens):
            raise ValueError("tokens must give at least one token for every request")
        for seq, toks in zip(seqs, tokens):
            self._grow(seq, seq.num_tokens + len(toks))
        flat = torch.tensor([t for toks in tokens for t in toks], dtype=torch.long)  # [N]
        rows = torch.tensor([r for r, toks in enumerate(tokens) for _ in toks], dtype=torch.long)  # [N]
        offsets = torch.tensor([j for toks in tokens for j in range(len(toks))], dtype=torch.long)  # [N]
        start = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long)  # [R]
        stable = [s.num_tokens + 1 for s in seqs]
        h = self.model.embed(flat.to(self.model.device))  # [N, D]
        stats = StepStats()
        if self.prefetcher is not None:
            self.prefetcher.cancel()  # anything a failed step left behind
        layers = self.model.layers
        for j, layer in enumerate(layers):
            after = layers[j + 1].cache_index if j + 1 < len(layers) else None
            h = self._layer(layer, h, request_ids, rows, start[rows] + offsets, offsets, stable, stats, after)
        self.last_step = stats
        return self.model.logits(h), h

    def commit(self, request_id: str, num_tokens: int) -> None:
        """The request's first ``num_tokens`` tokens have final KV in every base layer."""
        seq = self.seqs[request_id]
        if not 0 <= num_tokens <= seq.num_blocks * self.block_size:
            raise ValueError(f"commit of {num_tokens} tokens: only {seq.num_blocks} blocks are allocated")
        seq.num_tokens = num_tokens

    def mtp_forward(
        self, request_ids: list[str], positions: list[list[int]], h_prev: torch.Tensor, next_tokens: list[list[int]]
    ) -> torch.Tensor:
        """The MTP layer at final ``positions`` (its cache grows there): draft logits [M, V].

        ``h_prev`` [M, D] is the base model's final-normed hidden state at those positions and
        ``next_tokens`` the token that follows each (DeepSeek MTP); all of it is final.
        """
        model = self.model
        if not isinstance(model, DSAModel):  # Engine and the decode service refuse drafting without an MTP layer
            raise ValueError("MTP drafting needs a DSA model with an MTP layer")
        layer = model.mtp[0]
        rows = torch.tensor([r for r, ps in enumerate(positions) for _ in ps], dtype=torch.long)  # [M]
        offsets = torch.tensor([j for ps in positions for j in range(len(ps))], dtype=torch.long)  # [M]
        pos = torch.tensor([p for ps in positions for p in ps], dtype=torch.long)  # [M]
        nxt = torch.tensor([t for ts in next_tokens for t in ts], dtype=torch.long, device=self.model.device)
        stable = [ps[-1] + 1 for ps in positions]
        h = model.mtp_input(h_prev, nxt, depth=0)  # [M, D]
        h = self._layer(layer, h, request_ids, rows, pos, offsets, stable, StepStats())
        return model.mtp_logits(h, depth=0)

    def _layer(
        self, layer, h, request_ids, rows, positions, offsets, stable, stats: StepStats, prefetch_for: int | None = None
    ) -> torch.Tensor:
        """One cache layer for N tokens (request ``rows[n]`` at ``positions[n]``) -> h [N, D];
        with miss prefetch on, starts loading the predicted misses of cache layer ``prefetch_for``."""
        i, dev = layer.cache_index, self.model.device
        slots = torch.tensor([self.seqs[r].seq_slot for r in request_ids], dtype=torch.long)[rows]  # [N]
        mapping = (
            self.block_table[slots, positions // self.block_size].to(torch.int64) * self.block_size
            + positions % self.block_size
        )  # [N]
        slots_dev, pos_dev = slots.to(dev), positions.to(dev)
        proj = layer.project(h, pos_dev)
        scatter_rows(self.pool.plane(self._planes[i]), mapping, as_row_bytes(proj.kv), native=self.native)
        codec = self.model.index_codec
        self.indexer[i, slots_dev, pos_dev] = codec.encode(index_keys(proj))
        keys = codec.decode(self.indexer[i, slots_dev, : int(positions.max()) + 1])  # [N, C, Di]
        topk = layer.select_batched(proj, keys, pos_dev, self.topk)  # [N, k]
        if self.topk_override is not None:
            topk = overridden_topk(self.topk_override, i, [request_ids[r] for r in rows.tolist()], positions, topk)
        if self.full is not None:
            self.full[i, slots_dev, pos_dev] = proj.kv
            kv_rows = self.full[i][slots_dev[:, None], topk.clamp(min=0)]  # [N, k, W]
        elif int(offsets.max()) == 0:  # one token per request (no drafts): one hot-cache step, no reordering
            if self.prefetcher is not None and prefetch_for is not None:
                stats.prefetched += self.prefetcher.start(
                    prefetch_for,
                    request_ids,
                    self.pool.plane(self._planes[prefetch_for]),
                    self.block_table[slots],
                    topk,
                    positions,
                    self._hot_buffer(prefetch_for),
                )
            kv_rows = self._hot_rows(i, request_ids, slots, topk, stable, stats)
        else:
            kv_rows = torch.empty(topk.shape + (proj.kv.shape[-1],), dtype=proj.kv.dtype, device=dev)
            for j in range(int(offsets.max()) + 1):  # the j-th token of every request: one hot-cache step
                sel = (offsets == j).nonzero().flatten()  # [R_j]
                ids = [request_ids[r] for r in rows[sel].tolist()]
                kv_rows[sel.to(dev)] = self._hot_rows(
                    i, ids, slots[sel], topk[sel.to(dev)], [stable[r] for r in rows[sel].tolist()], stats
                )
        return layer.finish(h, layer.attend(proj, kv_rows, topk >= 0))

    def _hot_rows(self, layer, request_ids, seq_slots, topk, stable, stats: StepStats) -> torch.Tensor:
        """Resolve the top-k against the hot cache, gather misses, return rows [R, k, W] in top-k order."""
        assert self.hotcache is not None  # built with the hot buffers (no keep_device_kv_cache)
        res = self.hotcache.resolve(layer, request_ids, topk.cpu().contiguous(), stable)
        hot = self._hot_buffer(layer)  # [S, capacity, W]
        t0 = time.perf_counter()
        miss_rows, miss_tokens, miss_slots = res.miss_rows, res.miss_tokens, res.miss_slots
        staged = None
        if self.prefetcher is not None:
            late = self.prefetcher.late
            staged = self.prefetcher.take(layer)
            stats.prefetch_late += self.prefetcher.late - late
            self.prefetcher.observe(layer, request_ids, miss_rows)
        if staged is not None and miss_rows.numel():  # misses loaded early: copy them from staging
            found, at = staged.find(miss_rows, miss_tokens)  # [M], [F]
            if bool(found.any()):
                early = staged.rows[at.to(staged.rows.device)]  # [F, W]
                hot[seq_slots[miss_rows[found].long()].to(hot.device), miss_slots[found].long().to(hot.device)] = early
                stats.h2d_bytes += early.numel() * early.element_size()
                stats.prefetch_hits += int(at.numel())
                rest = ~found
                miss_rows, miss_tokens, miss_slots = miss_rows[rest], miss_tokens[rest], miss_slots[rest]
        stats.h2d_bytes += self._load(layer, seq_slots, miss_rows, miss_tokens, miss_slots)
        stats.load_s += time.perf_counter() - t0
        stats.hits += res.num_hits
        stats.misses += res.num_misses
        stats.layer_hits[layer] = stats.layer_hits.get(layer, 0) + res.num_hits
        stats.layer_misses[layer] = stats.layer_misses.get(layer, 0) + res.num_misses
        slots = res.slots.to(torch.long).clamp(min=0).to(hot.device)  # [R, k]
        return hot[seq_slots.to(hot.device)[:, None], slots]  # [R, k, W]

    def _hot_buffer(self, layer: int) -> torch.Tensor:
        """The hot rows [S, capacity, W] of ``layer``; they exist unless keep_device_kv_cache."""
        assert self.hot is not None, "no hot buffers: this decoder keeps the whole KV cache on the device"
        return self.hot[layer]

    def _load(
        self,
        layer: int,
        seq_slots: torch.Tensor,
        miss_rows: torch.Tensor,
        miss_tokens: torch.Tensor,
        miss_slots: torch.Tensor,
    ) -> int:
        """Gather misses (batch row, token, hot slot; [M] each) from the host pool into their slots;
        returns the bytes copied into the hot buffer (the rows handed to the gather, or the staged
        rows copied to the device)."""
        hot, m = self._hot_buffer(layer), miss_rows.numel()  # hot: [S, capacity, W]
        if m and self._gather_in_place:  # host memory: gather straight into the hot buffer
            dst = hot.view(torch.uint8)  # [S, capacity, row_bytes]
            gather_rows(
                self.pool.plane(self._planes[layer]),
                self.block_table[seq_slots],
                miss_rows,
                miss_tokens,
                dst,
                seq_slots.to(torch.int32),
                miss_slots,
                native=self.native,
            )
            return miss_rows.numel() * dst.shape[-1]
        if m:  # accelerator: gather into host staging rows, then one copy into the slots
            staging = torch.empty(
                (1, m, hot.shape[-1] * hot.element_size()), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )  # [1, M, row_bytes]
            gather_rows(
                self.pool.plane(self._planes[layer]),
                self.block_table[seq_slots],
                miss_rows,
                miss_tokens,
                staging,
                torch.zeros(seq_slots.numel(), dtype=torch.int32),
                torch.arange(m, dtype=torch.int32),
                native=self.native,
            )
            rows = staging[0].to(hot.device, non_blocking=True).view(hot.dtype).view(m, -1)  # [M, W]
            hot[seq_slots[miss_rows.long()].to(hot.device), miss_slots.long().to(hot.device)] = rows
            return rows.numel() * rows.element_size()
        return 0
