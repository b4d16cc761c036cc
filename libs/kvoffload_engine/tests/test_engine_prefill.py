"""I1: buffer reuse changes memory, never results (logits and every saved host-pool byte)."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_support import prefill_engine, prefill_pool, saved_bytes, seeded_prompt, tiny

from dsamodel.dense_reference import forward_dense
from kvoffload_engine.prefill import PrefillRequest

BS = 4
LONG = 41 * BS + 3  # >= 40 blocks, with a partial tail
_REFERENCE: dict = {}


def _run(model, prompt, *, buffers, independent, chunk_size, prefetch=2):
    pool = prefill_pool(model, BS)
    eng = prefill_engine(
        model, pool, buffers=buffers, independent=independent, chunk_size=chunk_size, prefetch=prefetch
    )
    try:
        res = eng.run(PrefillRequest("req", prompt))
        out = (res.logits.clone(), res.first_token, saved_bytes(pool, res.keys), eng.allocator.stats().peak_bytes)
        eng.release(res)
        assert pool.stats().live_leases == 0
        assert eng.gates.stats()["held_slots"] == 0
        return out
    finally:
        eng.close()
        pool.close()


def _reference(model, prompt, chunk_size):
    key = (id(model), prompt.numel(), chunk_size)
    if key not in _REFERENCE:
        _REFERENCE[key] = _run(model, prompt, buffers=None, independent="all", chunk_size=chunk_size)
    return _REFERENCE[key]


def _assert_same(got, want):
    assert torch.equal(got[0], want[0])
    assert got[1] == want[1]
    assert len(got[2]) == len(want[2])
    for a, b in zip(got[2], want[2]):
        assert torch.equal(a, b)


# Every (B, independent, MTP) plan against the all-independent run, over a chunk/prompt grid: each
# chunk size (under a block, a block, several blocks and a tail, one token) meets a one-token prompt,
# a prompt one token short of a block or a whole block, and a long prompt with a partial tail.
PLANS = list(itertools.product([1, 2, 3, "N-1"], [[0], [0, -1], "all"], [True, False]))
GRID = [(BS - 1, 1), (BS - 1, BS), (BS - 1, LONG), (BS, BS - 1), (BS, LONG), (3 * BS + 5, 1), (3 * BS + 5, BS)]
GRID += [(3 * BS + 5, LONG), (1, BS), (1, 2 * BS + 1)]


@pytest.mark.parametrize("buffers, independent, mtp", PLANS)
def test_i1_reuse_is_bit_identical_fp32(buffers, independent, mtp):
    model = tiny(torch.float32, mtp)
    n = len(model.cache_layers)
    b = n - 1 if buffers == "N-1" else buffers
    for chunk, length in GRID:
        prompt = seeded_prompt(length, seed=length)
        _assert_same(
            _run(model, prompt, buffers=b, independent=independent, chunk_size=chunk), _reference(model, prompt, chunk)
        )


@pytest.mark.parametrize("buffers, independent", [(1, [0]), (2, [0, -1]), (3, "all")])
def test_i1_reuse_is_bit_identical_bf16(buffers, independent):
    model = tiny(torch.bfloat16, True)
    for chunk, length in [(BS - 1, LONG), (3 * BS + 5, LONG), (BS, BS), (1, 1)]:
        prompt = seeded_prompt(length, seed=length)
        _assert_same(
            _run(model, prompt, buffers=buffers, independent=independent, chunk_size=chunk),
            _reference(model, prompt, chunk),
        )


def test_long_prompt_with_chunk_size_one():
    model = tiny(torch.float32, True)
    prompt = seeded_prompt(LONG, seed=7)
    _assert_same(_run(model, prompt, buffers=1, independent=[0], chunk_size=1), _reference(model, prompt, 1))


def test_prefill_agrees_with_the_dense_model():
    model = tiny(torch.float32, True)
    prompt = seeded_prompt(300, seed=3)
    logits = _run(model, prompt, buffers=2, independent=[0], chunk_size=37)[0]
    torch.testing.assert_close(logits, forward_dense(model, prompt)[-1], rtol=1e-4, atol=1e-4)


def test_reuse_really_shrinks_device_memory():
    model = tiny(torch.float32, True)
    prompt = seeded_prompt(64)
    reuse = _run(model, prompt, buffers=1, independent=[0], chunk_size=16)[3]
    full = _run(model, prompt, buffers=None, independent="all", chunk_size=16)[3]
    assert reuse * 5 == full * 2  # 2 slots (layer 0 + one shared) instead of 5


def test_shared_memory_layer_buffers_change_nothing():
    import uuid

    from kvcore.pool.segment import SharedSegment

    model = tiny(torch.float32, True)
    prompt = seeded_prompt(3 * BS + 1, seed=5)
    pool = prefill_pool(model, BS)
    name = f"test-buffers-{uuid.uuid4().hex[:8]}"
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=BS + 1, buffer_segment=name)
    try:
        res = eng.run(PrefillRequest("req", prompt))
        got = (res.logits.clone(), res.first_token, saved_bytes(pool, res.keys))
        # another mapping of the segment sees the last layer's rows where the engine wrote them
        seg = SharedSegment.attach(name)
        last = len(model.cache_layers) - 1
        slot = eng.plan.slot_of(last)
        plane = seg.plane(eng.buffers.plane_of[(slot, "main")]).view(model.dtype).view(-1, model.config.kv_row_width)
        assert torch.equal(plane[: prompt.numel()], eng.buffers.main(last)[: prompt.numel()])
        seg.close()
        eng.release(res)
    finally:
        eng.close()
        pool.close()
    _assert_same(got, _reference(model, prompt, BS + 1))


def test_a_cancelled_request_stops_between_layers_and_leaves_nothing_held():
    """``PrefillRequest.cancelled`` (its reader went away) ends the request before the next layer:
    PrefillError naming the layer and why; no slot, lease or request object stays behind, and the
    engine serves the next request exactly as before."""
    from kvoffload_engine.prefill import PrefillError

    model = tiny(torch.float32, True)
    pool = prefill_pool(model, BS)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=BS + 1)
    asked = []

    def cancelled() -> str:
        asked.append(1)
        return "the decode went away" if len(asked) > 3 else ""

    try:
        prompt = seeded_prompt(5 * BS + 2, seed=3)
        with pytest.raises(PrefillError, match=r"stopped before layer \d+: the decode went away"):
            eng.run(PrefillRequest("gone", prompt, cancelled=cancelled))
        assert len(asked) == 4
        assert eng.gates.stats()["held_slots"] == 0 and pool.stats().live_leases == 0
        res = eng.run(PrefillRequest("next", prompt))
        eng.release(res)
        assert pool.stats().live_leases == 0 and eng.gates.stats()["held_slots"] == 0
    finally:
        eng.close()
        pool.close()
    want = _run(model, prompt, buffers=None, independent="all", chunk_size=BS + 1)
    assert torch.equal(res.logits, want[0])


def test_an_announce_that_raises_fails_its_readers_instead_of_holding_the_slot():
    """If telling a reader fails (its decode vanished), that reader can never answer: the slot's
    read is failed at once, the request ends with the error, and no slot waits for a timeout."""
    model = tiny(torch.float32, False)
    pool = prefill_pool(model, BS)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=64)
    calls = []

    def announce(ticket, req, start, end):
        calls.append(ticket.layer)
        if len(calls) == 2:
            raise ConnectionError("decode gone")
        ticket.read_done(next(iter(ticket.readers)))

    eng.announce = announce
    try:
        with pytest.raises(ConnectionError, match="decode gone"):
            eng.run(PrefillRequest("r", seeded_prompt(3 * BS, seed=5), readers=frozenset({"decode"})))
        assert eng.gates.stats()["held_slots"] == 0 and pool.stats().live_leases == 0
    finally:
        eng.close()
        pool.close()
