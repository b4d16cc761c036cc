"""``StepStats.h2d_bytes`` counts the bytes the copies into the hot buffers moved, where they happen,
not the hot cache's miss counter: a load handed fewer rows than the misses moves (and counts) fewer
bytes, with miss prefetch on or off, while hits and misses stay as the hot cache resolved them."""

from __future__ import annotations

import pytest
import torch
from engine_support import decode_pool, hand_trace, tiny

from kvoffload_engine.decode import SparseDecoder
from kvoffload_engine.trace_topk import TraceTopK

BS = 16
K = 64  # the tiny preset's index_topk


def _decoder(model, override, prefetch: bool):
    pool = decode_pool(model, BS)
    dec = SparseDecoder(
        model,
        pool,
        topk_buffer_size=K,
        max_num_seqs=2,
        max_model_len=512,
        topk_override=override,
        miss_prefetch=prefetch,
    )
    return dec, pool


def _install(dec, model, ids, prompt_len):
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    for rid in ids:
        dec.admit(rid, prompt_len + 1)
    for layer in range(len(model.cache_layers)):
        for rid in ids:
            kv = torch.randn(prompt_len, cfg.kv_row_width, generator=gen).to(model.dtype)
            index_k = torch.randn(prompt_len, cfg.index_head_dim, generator=gen).to(model.dtype)
            dec.write_prompt_layer(rid, layer, kv, index_k)
    for rid in ids:
        dec.set_prompt_done(rid, prompt_len)


@pytest.mark.parametrize("prefetch", [False, True])
def test_h2d_bytes_are_the_rows_the_copies_moved(monkeypatch, prefetch):
    model = tiny(torch.float32, False)
    row_bytes = model.config.kv_row_width * 4
    ids = ["a", "b"]
    override = TraceTopK(hand_trace(), ids, num_layers=4)
    dec, pool = _decoder(model, override, prefetch)
    handed: list[int] = []  # the rows each host-pool gather was handed, after the staged ones
    real_load = SparseDecoder._load

    def half_load(self, layer, seq_slots, miss_rows, miss_tokens, miss_slots):
        keep = (miss_rows.numel() + 1) // 2  # a load that drops half of what it should copy
        handed.append(keep)
        return real_load(self, layer, seq_slots, miss_rows[:keep], miss_tokens[:keep], miss_slots[:keep])

    try:
        _install(dec, model, ids, 200)
        tokens = torch.tensor([5, 9])
        dec.step(ids, tokens)  # step 0: cold, every selection a miss
        st = dec.last_step
        assert st.misses == 4 * 2 * K and st.h2d_bytes == st.misses * row_bytes  # every miss copied once
        monkeypatch.setattr(SparseDecoder, "_load", half_load)
        for _ in range(2):
            handed.clear()
            dec.step(ids, tokens)
            st = dec.last_step
            assert st.misses == 4 * 2 * 16 and st.hits == 4 * 2 * (K - 16)  # 16 new per request and layer
            early = st.prefetch_hits if prefetch else 0  # misses copied from the prefetch staging
            assert len(handed) == 4 and (sum(handed) + early) * row_bytes == st.h2d_bytes
            assert st.h2d_bytes < st.misses * row_bytes  # fewer rows copied than missed, fewer bytes counted
    finally:
        if dec.prefetcher is not None:
            dec.prefetcher.close()
        pool.close()
