"""The decode's queue: requests beyond the sequence slots are admitted at once, pull their KV into
host blocks (indexer keys staged on the host) while they wait, then decode exactly as if they had
had a slot from the start; a request the host pool cannot hold yet waits for blocks, FIFO."""

import pytest
from queue_support import N, Sink, push

from dsamodel.presets import tiny_model
from kvoffload_decode.admission import TooLarge, default_max_queued
from kvoffload_decode.loop import DecodeLoop
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder
from openai_api.sampling_params import SamplingParams


def _loop(max_num_seqs: int, pool_bytes: int = 8 << 20) -> tuple[DecodeLoop, object]:
    model = tiny_model(dtype="float32")
    pool = build.decode_pool(model, 16, pool_bytes)
    lp = DecodeLoop(
        SparseDecoder(model, pool, topk_buffer_size=64, max_num_seqs=max_num_seqs, max_model_len=256),
        model.config.eos_token_id,
    )
    return lp, pool


def test_a_queued_request_pulls_without_a_slot_and_decodes_like_one_that_had_it():
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref, ref_pool = _loop(1)
    try:  # the reference: the request had a sequence slot from the start
        sink = Sink()
        ref.expect_remote("b", list(range(N)), params, sink)
        assert ref.decoder.seqs["b"].seq_slot is not None
        push(ref, "b", 2)
        assert sink.done.wait(30)
        expected = sink.tokens
    finally:
        ref.close()
        ref_pool.close()

    lp, pool = _loop(1)
    try:
        a, b = Sink(), Sink()
        lp.expect_remote("a", list(range(N)), SamplingParams(max_tokens=200, ignore_eos=True), a)
        lp.expect_remote("b", list(range(N)), params, b)
        assert lp.decoder.seqs["b"].seq_slot is None  # queued: its KV lands in host blocks + staging
        push(lp, "b", 2)  # b's prefill finishes first: it must wait for a's slot
        assert lp.check_prompt_complete("b") == ""
        assert not b.done.wait(0.3) and not b.tokens
        push(lp, "a", 1)
        assert a.done.wait(60) and b.done.wait(60)
        assert b.tokens == expected
        st = lp.stats()
        assert st["sequences"] == 0 and st["queued"] == 0 and pool.stats().used_bytes == 0
        assert lp.decoder.free_slots == 1
    finally:
        lp.close()
        pool.close()


def test_a_request_the_pool_cannot_hold_yet_waits_for_blocks_fifo():
    model = tiny_model(dtype="float32")
    block_bytes = build.decode_geometry(model, 16, 1 << 20).block_bytes
    blocks_per_request = -(-(N + 1) // 16)  # 3
    lp, pool = _loop(4, pool_bytes=block_bytes * (blocks_per_request + 1))  # room for one request
    try:
        reserved = []
        a, b, c = Sink(), Sink(), Sink()
        lp.expect_remote("a", list(range(N)), SamplingParams(max_tokens=2, ignore_eos=True), a)
        rb = lp.expect_remote(
            "b",
            list(range(N)),
            SamplingParams(max_tokens=2, ignore_eos=True),
            b,
            on_reserved=lambda: reserved.append("b"),
        )
        rc = lp.expect_remote("c", [1], SamplingParams(max_tokens=2), c, on_reserved=lambda: reserved.append("c"))
        assert not rb.reserved and not rc.reserved  # c would fit, but it waits behind b (FIFO)
        st = lp.stats()
        assert st["waiting_for_blocks"] == 2 and st["ledger_open_queued"] == 2
        push(lp, "a", 1)
        assert a.done.wait(30)
        with lp.lock:  # "done" is emitted just before a's blocks are freed, under the lock
            assert reserved[:1] == ["b"] and rb.reserved
        assert lp.cancel("b", "client left")
        assert reserved == ["b", "c"] and rc.reserved
        assert lp.cancel("c", "client left")
        assert lp.stats()["sequences"] == 0 and pool.stats().used_bytes == 0
    finally:
        lp.close()
        pool.close()


def test_a_prompt_larger_than_the_whole_pool_is_refused_at_once():
    model = tiny_model(dtype="float32")
    block_bytes = build.decode_geometry(model, 16, 1 << 20).block_bytes
    lp, pool = _loop(2, pool_bytes=block_bytes * 2)
    try:
        with pytest.raises(TooLarge, match="host pool"):
            lp.expect_remote("big", list(range(N)), SamplingParams(max_tokens=2), lambda *e: None)
        assert lp.stats()["pending"] == 0 and lp.stats()["ledger_open"] == 0
    finally:
        lp.close()
        pool.close()


def test_default_queue_limit_is_sized_from_slots_and_host_pool():
    lp, pool = _loop(2, pool_bytes=8 << 20)
    try:
        g = pool.geometry
        assert default_max_queued(lp.decoder) == max(8, g.num_blocks * 16 // 64)
    finally:
        lp.close()
        pool.close()
