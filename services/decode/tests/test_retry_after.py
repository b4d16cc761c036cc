"""The decode's ``Retry-After`` (``kvoffload_decode.queue_wait``): the wait after which the refused
request, sent again, would be admitted by the queue's pace — the starts ahead of it and those of the
requests told to come back before it, past the bound or the queue's limit, 10 % longer, capped at
what OpenAI's client follows — for a refusal by the estimate, by the queue's limit, or after a wait
past the bound."""

import time

import pytest
from queue_support import N, Sink, push

from dsamodel.presets import tiny_model
from kvoffload_decode.loop import DecodeLoop
from kvoffload_decode.queue_wait import DecodeFull, QueueWaitExceeded, StartPace
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder
from openai_api.sampling_params import SamplingParams


def _loop(max_queue_wait_s: float):
    model = tiny_model(dtype="float32")
    pool = build.decode_pool(model, 16, 8 << 20)
    decoder = SparseDecoder(model, pool, topk_buffer_size=64, max_num_seqs=1, max_model_len=512)
    return DecodeLoop(decoder, model.config.eos_token_id, max_queue_wait_s=max_queue_wait_s), pool


def _busy(lp: DecodeLoop, queued: int) -> None:
    """The one slot taken by a long request, ``queued`` more admitted behind it."""
    lp.expect_remote("running", list(range(N)), SamplingParams(max_tokens=100_000, ignore_eos=True), Sink())
    push(lp, "running")
    deadline = time.monotonic() + 30
    while lp.stats()["running"] != 1:
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.01)
    for i in range(queued):
        lp.expect_remote(f"q{i}", list(range(N)), SamplingParams(max_tokens=4), Sink())


def _refused(lp: DecodeLoop, rid: str) -> DecodeFull:
    with pytest.raises(DecodeFull) as refused:
        lp.expect_remote(rid, list(range(N)), SamplingParams(max_tokens=4), Sink())
    return refused.value


def test_an_estimate_of_90_s_against_a_bound_of_60_s_says_retry_after_about_30_s():
    pace = StartPace(interval_s=1.0)
    assert pace.estimate_s(89) == 90.0
    assert pace.retry_after_s(0.0, 89, 60.0, 1024) == 33  # 30 s past the bound, 10 % longer: not 1


def test_requests_refused_together_come_back_in_turn_and_each_is_admitted():
    """One start a second; 8 requests refused at once each come back after their Retry-After and the
    estimate admits them on that try."""
    lp, pool = _loop(max_queue_wait_s=10.0)
    try:
        lp.pace.interval_s = 1.0
        _busy(lp, 10)  # the next would start in 11 s, past 10
        hints = [int(_refused(lp, f"r{i}").retry_after_s) for i in range(8)]
        assert hints == sorted(hints) and len(set(hints)) == 8, hints  # told the excess alone: 1 s each
    finally:
        lp.close()
        pool.close()
    pace, ahead, bound = StartPace(interval_s=1.0), 10, 10.0
    due = sorted(pace.retry_after_s(0.0, ahead, bound, 1024) for _ in range(8))
    assert due == hints
    for t in range(1, due[-1] + 1):  # one start a second; the returns due join the queue
        ahead -= 1
        for _ in range(due.count(t)):
            estimate = pace.estimate_s(ahead)
            assert estimate is not None and estimate <= bound, (t, estimate)  # admitted on its return
            ahead += 1


def test_a_full_queue_says_when_it_has_room():
    lp, pool = _loop(max_queue_wait_s=60.0)
    try:
        lp.pace.interval_s = 2.0
        lp.max_queued = 3
        _busy(lp, 3)
        first, second = _refused(lp, "a"), _refused(lp, "b")
        assert "queue is full" in str(first) and "retry after 3 s" in str(first)
        assert first.retry_after_s == 3  # one start (2 s) frees a place: 10 % longer, rounded up
        assert second.retry_after_s == 5  # and one more for the request told to come back before it
    finally:
        lp.close()
        pool.close()


def test_a_request_queued_past_the_bound_is_told_when_it_would_be_admitted():
    lp, pool = _loop(max_queue_wait_s=1.0)
    try:
        sinks = {rid: Sink() for rid in ("a", "b", "c", "d")}
        lp.expect_remote("a", list(range(N)), SamplingParams(max_tokens=100_000, ignore_eos=True), sinks["a"])
        for rid in ("b", "c", "d"):
            lp.expect_remote(rid, list(range(N)), SamplingParams(max_tokens=4), sinks[rid])
        lp.pace.interval_s = 5.0  # measured from here on: one start every 5 s
        for rid in ("a", "b", "c", "d"):
            push(lp, rid)  # a holds the only slot for far longer than the bound; b, c, d complete, waiting
        assert sinks["b"].done.wait(10) and sinks["c"].done.wait(10) and sinks["d"].done.wait(10)
        hints = sorted(int(s.errors[0].retry_after_s) for s in (sinks["b"], sinks["c"], sinks["d"]))
        assert all(isinstance(sinks[r].errors[0], QueueWaitExceeded) for r in "bcd")
        # each refused as the queue's last: behind the 2 others (queued or told to come back), 15 s to
        # start, 14 s past the bound: 10 % longer, rounded up (before: 1 s, from the queue's depth)
        assert hints == [16, 16, 16], hints
        assert lp.cancel("a", "done with it")
    finally:
        lp.close()
        pool.close()


def test_a_wait_longer_than_openais_client_follows_is_capped_and_no_pace_says_none():
    pace = StartPace(interval_s=1.0)
    assert pace.retry_after_s(0.0, 499, 60.0, 1024) == 60  # 440 s past the bound: capped
    assert StartPace().retry_after_s(0.0, 499, 60.0, 1024) is None  # the admission's depth rule then
    assert pace.retry_after_s(0.0, 5, 0.0, 1024) == 1  # no bound, room in the queue
