"""I2: sparse offload changes memory, never results — decode logits equal keep_device_kv_cache."""

from __future__ import annotations

import pytest
import torch
from engine_support import seeded_prompt, tiny

from dsamodel.dense_reference import generate_dense
from kvoffload_engine.engine import Engine, EngineConfig
from openai_api.sampling_params import SamplingParams

BS = 16


def _schedule(model, *, keep: bool, topk_buffer_size: int, native: bool = True):
    """4 requests of different lengths; one joins at step 10, one leaves at step 20. Logits per step."""
    eng = Engine(
        model,
        EngineConfig(
            block_size=BS,
            max_model_len=1024,
            max_num_seqs=4,
            chunk_size=128,
            buffers=2,
            topk_buffer_size=topk_buffer_size,
            keep_device_kv_cache=keep,
            prefill_pool_bytes=16 << 20,
            decode_pool_bytes=16 << 20,
            native=native,
        ),
    )
    steps: list[tuple[list[str], torch.Tensor]] = []
    real_forward = eng.decoder.forward

    def recording_forward(ids, tokens):
        out = real_forward(ids, tokens)
        steps.append((list(ids), out[0].clone()))
        return out

    eng.decoder.forward = recording_forward
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


@pytest.mark.parametrize(
    ("dtype", "fp8_indexer"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
    ids=["fp32", "bf16", "bf16-fp8-indexer"],
)
@pytest.mark.parametrize("topk_buffer_size", [128, 64])  # 64 == index_topk: no spare slots
def test_i2_sparse_offload_equals_keep_device(dtype, fp8_indexer, topk_buffer_size):
    model = tiny(dtype, True, fp8_indexer)
    sparse, _ = _schedule(model, keep=False, topk_buffer_size=topk_buffer_size)
    keep, _ = _schedule(model, keep=True, topk_buffer_size=topk_buffer_size)
    assert len(sparse) == len(keep) >= 64
    assert any(len(ids) == 4 for ids, _ in sparse)  # the batch really held 4
    assert {"b"} - set(sparse[-1][0]) == {"b"}  # b left before the end
    for (ids_s, lg_s), (ids_k, lg_k) in zip(sparse, keep, strict=True):
        assert ids_s == ids_k
        assert torch.equal(lg_s, lg_k)


def test_native_and_reference_hot_cache_give_identical_logits():
    model = tiny(torch.float32, True)
    native, _ = _schedule(model, keep=False, topk_buffer_size=64, native=True)
    reference, _ = _schedule(model, keep=False, topk_buffer_size=64, native=False)
    assert len(native) == len(reference) > 0  # a shorter (or empty) run is a failure, not fewer checks
    for (ids_a, a), (ids_b, b) in zip(native, reference, strict=True):
        assert ids_a == ids_b
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8_indexer", [False, True], ids=["plain-indexer", "fp8-indexer"])
def test_engine_greedy_tokens_match_the_dense_model(fp8_indexer):
    model = tiny(torch.float32, True, fp8_indexer)
    prompts = [seeded_prompt(n, n).tolist() for n in (1, BS - 1, 333)]
    params = SamplingParams(max_tokens=10)
    eng = Engine(
        model,
        EngineConfig(
            block_size=BS,
            max_model_len=1024,
            max_num_seqs=4,
            chunk_size=100,
            prefill_pool_bytes=16 << 20,
            decode_pool_bytes=16 << 20,
        ),
    )
    try:
        got = eng.generate(prompts, params)
    finally:
        eng.close()
    assert got == [generate_dense(model, p, params) for p in prompts]


def test_decode_moves_only_misses_and_hits_most():
    model = tiny(torch.float32, True)
    _, stats = _schedule(model, keep=False, topk_buffer_size=128)
    assert stats.hits > 0 and stats.h2d_bytes == stats.misses * model.config.kv_row_width * 4
    assert sorted(stats.layer_hits) == list(range(model.config.num_hidden_layers))
    assert sum(stats.layer_hits.values()) == stats.hits and sum(stats.layer_misses.values()) == stats.misses


def test_accelerator_staging_path_gives_identical_logits():
    """The path an accelerator takes (gather into host staging, then one copy), exercised on CPU."""
    model = tiny(torch.float32, True)
    direct, _ = _schedule(model, keep=False, topk_buffer_size=64)
    real_init = Engine.__init__

    def staged_init(self, *a, **kw):
        real_init(self, *a, **kw)
        self.decoder._gather_in_place = False

    Engine.__init__ = staged_init
    try:
        staged, _ = _schedule(model, keep=False, topk_buffer_size=64)
    finally:
        Engine.__init__ = real_init
    assert len(direct) == len(staged) > 0  # a shorter (or empty) run is a failure, not fewer checks
    for (ids_a, a), (ids_b, b) in zip(direct, staged, strict=True):
        assert ids_a == ids_b
        assert torch.equal(a, b)


class _OracleDrafts(Engine):
    """Drafts from the known greedy continuation, every third one wrong: the tiny model's random MTP
    head is almost never right, and both verification outcomes must be exercised."""

    oracle: dict[str, list[int]] = {}

    def _propose(self, seq, draft_logits):
        truth = self.oracle.get(seq.request_id, [])
        i = len(seq.output_ids)
        if i >= len(truth):
            return super()._propose(seq, draft_logits)
        return truth[i] if i % 3 else (truth[i] + 1) % 256


SPEC_PROMPTS = (150, 77, 200)
SPEC_PARAMS = [
    SamplingParams(max_tokens=64),
    SamplingParams(max_tokens=40),
    SamplingParams(max_tokens=30, temperature=0.7, seed=3),
]  # the sampled one never drafts


def _spec_run(model, *, keep: bool, oracle: dict | None = None, topk_buffer_size: int = 64):
    cls = _OracleDrafts if oracle is not None else Engine
    eng = cls(
        model,
        EngineConfig(
            block_size=BS,
            max_model_len=1024,
            max_num_seqs=4,
            chunk_size=128,
            buffers=2,
            topk_buffer_size=topk_buffer_size,
            keep_device_kv_cache=keep,
            prefill_pool_bytes=16 << 20,
            decode_pool_bytes=16 << 20,
            num_speculative_tokens=1,
        ),
    )
    eng.oracle = oracle or {}
    steps = []
    real = eng.decoder.forward

    def recording(ids, tokens):
        out = real(ids, tokens)
        steps.append((list(ids), [list(t) for t in tokens], out[0].clone()))
        return out

    eng.decoder.forward = recording
    try:
        out = eng.generate([seeded_prompt(n, n).tolist() for n in SPEC_PROMPTS], SPEC_PARAMS)
        assert not eng.decoder.seqs and eng.decode_pool.stats().used_blocks == 0
        return out, steps, (eng.num_drafts, eng.num_accepted)
    finally:
        eng.close()


def _greedy_truth(model):
    return {
        f"gen-{i}": generate_dense(model, seeded_prompt(n, n).tolist(), SPEC_PARAMS[i])
        for i, n in enumerate(SPEC_PROMPTS[:2])
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_i2_with_speculative_suffix_invalidation(dtype):
    """Drafts are written then rejected or accepted: a rejected position is rewritten next step, so a
    stale hot-cache entry would make sparse offload differ from keep_device_kv_cache."""
    model = tiny(dtype, True)
    truth = _greedy_truth(model)
    out_s, steps_s, (drafts, accepted) = _spec_run(model, keep=False, oracle=truth)
    out_k, steps_k, _ = _spec_run(model, keep=True, oracle=truth)
    assert 0 < accepted < drafts  # both outcomes happened, many times
    assert accepted >= 10 and drafts - accepted >= 10
    assert out_s == out_k and len(steps_s) == len(steps_k)
    assert steps_s  # the sequences decoded at all
    for (ids_s, tok_s, lg_s), (ids_k, tok_k, lg_k) in zip(steps_s, steps_k, strict=True):
        assert (ids_s, tok_s) == (ids_k, tok_k)
        assert torch.equal(lg_s, lg_k)


def test_speculative_greedy_tokens_match_plain_decoding():
    model = tiny(torch.float32, True)
    truth = _greedy_truth(model)
    for oracle in (truth, None):  # oracle drafts (accepts and rejects), then the model's own MTP drafts
        out, _, (drafts, _) = _spec_run(model, keep=False, oracle=oracle)
        assert drafts > 0
        assert out[:2] == [truth["gen-0"], truth["gen-1"]]


@pytest.mark.parametrize("start, n", [(0, 64), (0, 37), (5, 11), (13, 70), (16, 16), (31, 1)])
def test_prompt_rows_land_where_the_block_table_says(start, n):
    """Whole blocks are copied in runs, ragged edges row by row: same bytes as row-by-row scatter."""
    from engine_support import decode_pool

    from kvoffload_engine.decode import SparseDecoder

    model = tiny(torch.float32, True)
    pool = decode_pool(model, BS)
    try:
        dec = SparseDecoder(model, pool, topk_buffer_size=64, max_num_seqs=2, max_model_len=256)
        seq = dec.admit("r", 30)
        dec.admit("other", 40)  # its blocks land between r's first blocks and the ones r grows into
        dec._grow(seq, max(start + n, 2 * BS) + BS)
        table = dec.block_table[seq.seq_slot, : seq.num_blocks]
        assert bool((table[1:] != table[:-1] + 1).any())  # more than one run of pool blocks
        kv = torch.randn(n, model.config.kv_row_width)
        dec.write_prompt_layer("r", 2, kv, torch.zeros(n, model.config.index_head_dim), start=start)
        plane = pool.plane(pool.geometry.plane_index(2, "main")).view(-1, kv.shape[1] * 4)
        pos = torch.arange(start, start + n)
        rows = dec.block_table[seq.seq_slot, pos // BS].long() * BS + pos % BS
        assert torch.equal(plane[rows], kv.view(torch.uint8).view(n, -1))
    finally:
        pool.close()


def test_a_cancelled_request_frees_its_state_and_changes_no_other_result():
    """``Engine.cancel`` of a waiting and of a running request: the others' tokens equal a run
    without them, and nothing of the cancelled ones is left (decode state, decode pool blocks).
    The engine also runs over a prefill pool it was given, which it leaves open on close."""
    from kvoffload_engine import build

    model = tiny(torch.float32, True)
    cfg = EngineConfig(
        block_size=BS,
        max_model_len=1024,
        max_num_seqs=2,
        chunk_size=128,
        buffers=2,
        prefill_pool_bytes=16 << 20,
        decode_pool_bytes=16 << 20,
    )
    alone = Engine(model, cfg)
    try:
        want = alone.generate([seeded_prompt(120, 1)], SamplingParams(max_tokens=24))[0]
    finally:
        alone.close()
    pool = build.prefill_pool(model, BS, 16 << 20)
    eng = Engine(model, cfg, prefill_pool=pool)
    try:
        keep = eng.add_request("keep", seeded_prompt(120, 1), SamplingParams(max_tokens=24))
        eng.add_request("run", seeded_prompt(200, 2), SamplingParams(max_tokens=50))
        eng.add_request("wait", seeded_prompt(90, 3), SamplingParams(max_tokens=50))  # max_num_seqs 2: queued
        for _ in range(5):
            eng.step()
        assert [s.request_id for s in eng.waiting] == ["wait"]
        assert eng.cancel("wait") and eng.cancel("run") and not eng.cancel("run")
        assert set(eng.decoder.seqs) == {"keep"}
        while eng.waiting or eng.running:
            eng.step()
        assert keep.output_ids == want
        assert not eng.decoder.seqs and eng.decode_pool.stats().used_blocks == 0
    finally:
        eng.close()
    assert pool.stats().complete_objects > 0  # still open: the caller owns it
    pool.close()
