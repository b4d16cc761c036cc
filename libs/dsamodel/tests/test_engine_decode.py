"""I2: sparse offload changes memory, never results — decode logits equal keep_device_kv_cache."""

from __future__ import annotations

import pytest
import torch
from engine_support import seeded_prompt, tiny

from dsamodel.engine.engine import Engine, EngineConfig
from dsamodel.reference import generate_dense
from dsamodel.sampling import SamplingParams

BS = 16


def _schedule(model, *, keep: bool, topk_buffer_size: int, native: bool = True):
    """4 requests of different lengths; one joins at step 10, one leaves at step 20. Logits per step."""
    eng = Engine(model, EngineConfig(block_size=BS, max_model_len=1024, max_num_seqs=4, chunk_size=128,
                                     buffers=2, topk_buffer_size=topk_buffer_size, keep_device_kv_cache=keep,
                                     prefill_pool_bytes=16 << 20, decode_pool_bytes=16 << 20, native=native))
    steps: list[tuple[list[str], torch.Tensor]] = []
    real_step = eng.decoder.step

    def recording_step(ids, tokens):
        logits = real_step(ids, tokens)
        steps.append((list(ids), logits.clone()))
        return logits

    eng.decoder.step = recording_step
    try:
        eng.add_request("a", seeded_prompt(300, 1), SamplingParams(max_tokens=70))
        eng.add_request("b", seeded_prompt(45, 2), SamplingParams(max_tokens=20))
        eng.add_request("c", seeded_prompt(130, 3), SamplingParams(max_tokens=66, temperature=0.8, top_p=0.9, seed=5))
        for i in range(200):
            if i == 10:
                eng.add_request("d", seeded_prompt(200, 4), SamplingParams(max_tokens=40))
            eng.step()
            if not (eng.waiting or eng.running):
                break
        stats = eng.decoder.last_step
        assert not eng.decoder.seqs and eng.decode_pool.stats().used_blocks == 0
        return steps, stats
    finally:
        eng.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("topk_buffer_size", [128, 64])  # 64 == index_topk: no spare slots
def test_i2_sparse_offload_equals_keep_device(dtype, topk_buffer_size):
    model = tiny(dtype, True)
    sparse, _ = _schedule(model, keep=False, topk_buffer_size=topk_buffer_size)
    keep, _ = _schedule(model, keep=True, topk_buffer_size=topk_buffer_size)
    assert len(sparse) == len(keep) >= 64
    assert any(len(ids) == 4 for ids, _ in sparse)  # the batch really held 4
    assert {"b"} - set(sparse[-1][0]) == {"b"}  # b left before the end
    for (ids_s, lg_s), (ids_k, lg_k) in zip(sparse, keep):
        assert ids_s == ids_k
        assert torch.equal(lg_s, lg_k)


def test_native_and_reference_hot_cache_give_identical_logits():
    model = tiny(torch.float32, True)
    native, _ = _schedule(model, keep=False, topk_buffer_size=64, native=True)
    reference, _ = _schedule(model, keep=False, topk_buffer_size=64, native=False)
    for (_, a), (_, b) in zip(native, reference):
        assert torch.equal(a, b)


def test_engine_greedy_tokens_match_the_dense_model():
    model = tiny(torch.float32, True)
    prompts = [seeded_prompt(n, n).tolist() for n in (1, BS - 1, 333)]
    params = SamplingParams(max_tokens=10)
    eng = Engine(model, EngineConfig(block_size=BS, max_model_len=1024, max_num_seqs=4, chunk_size=100,
                                     prefill_pool_bytes=16 << 20, decode_pool_bytes=16 << 20))
    try:
        got = eng.generate(prompts, params)
    finally:
        eng.close()
    assert got == [generate_dense(model, p, params) for p in prompts]


def test_decode_moves_only_misses_and_hits_most():
    model = tiny(torch.float32, True)
    _, stats = _schedule(model, keep=False, topk_buffer_size=128)
    assert stats.hits > 0 and stats.h2d_bytes == stats.misses * model.config.kv_row_width * 4
