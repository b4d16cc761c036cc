"""The bound on a request's wait in the decode's queue (``kvoffload_decode.queue_wait``): the pace
counts only starts under a backlog; a request that waited past the bound is refused (a 429's
``QueueWaitExceeded``) and frees everything it held, one whose prefill runs is served, not
waiting; once a pace is measured, a request it puts past the bound is refused at admission, with a
``Retry-After`` of the excess; 0 turns the bound off."""

import time

import pytest
from queue_support import N, Sink, push

from dsamodel.presets import tiny_model
from kvoffload_decode.loop import DecodeLoop
from kvoffload_decode.queue_wait import MIN_INTERVALS, WINDOW, DecodeFull, QueueWaitExceeded, StartPace
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder
from openai_api.sampling_params import SamplingParams


def _loop(max_queue_wait_s: float, max_num_seqs: int = 1):
    model = tiny_model(dtype="float32")
    pool = build.decode_pool(model, 16, 8 << 20)
    decoder = SparseDecoder(model, pool, topk_buffer_size=64, max_num_seqs=max_num_seqs, max_model_len=512)
    return DecodeLoop(decoder, model.config.eos_token_id, max_queue_wait_s=max_queue_wait_s), pool


def _until(cond, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_pace_counts_only_starts_under_a_backlog():
    pace = StartPace()
    assert pace.estimate_s(5) is None  # nothing measured: no estimate
    pace.started(10.0, backlog=False)  # an idle decode's start: the next gap is not a service interval
    pace.started(50.0, backlog=True)
    for i in range(1, MIN_INTERVALS):  # intervals of 2 s: too few yet for an estimate
        pace.started(50.0 + 2 * i, backlog=True)
        assert pace.interval_s is None and pace.estimate_s(4) is None
    now = 50.0 + 2 * MIN_INTERVALS
    pace.started(now, backlog=False)  # the gap after a backlog start counts; the one after this does not
    assert pace.interval_s == 2.0 and pace.estimate_s(0) == 2.0 and pace.estimate_s(4) == 10.0
    pace.started(now + 500.0, backlog=True)
    assert pace.interval_s == 2.0


def test_the_pace_is_the_mean_of_the_latest_intervals_so_a_burst_of_starts_does_not_swing_it():
    """Starts come in bursts (a batch's slots free together): 7 at once, then one 1.2 s later. The
    pace is their mean over the window (0.15 s), not the last few: an average that followed them
    (an EWMA of weight 0.2) read up to 0.33 s after each long gap, twice the queue's real pace."""
    pace, now = StartPace(), 0.0
    pace.started(now, backlog=True)
    for _ in range(4 * WINDOW // 8):
        for gap in (0.0,) * 7 + (1.2,):
            now += gap
            pace.started(now, backlog=True)
            if pace.interval_s is not None and len(pace._gaps) == WINDOW:
                assert pace.interval_s == pytest.approx(0.15)
    assert pace.interval_s == pytest.approx(0.15)
    for _ in range(WINDOW):  # the window forgets: a slower decode reads as slower
        now += 1.0
        pace.started(now, backlog=True)
    assert pace.interval_s == pytest.approx(1.0)


def test_a_request_queued_past_the_bound_is_refused_and_frees_what_it_held():
    lp, pool = _loop(max_queue_wait_s=1.0)
    try:
        a, b = Sink(), Sink()
        lp.expect_remote("a", list(range(N)), SamplingParams(max_tokens=100_000, ignore_eos=True), a)
        lp.expect_remote("b", list(range(N)), SamplingParams(max_tokens=4, ignore_eos=True), b)
        lp.expect_remote("c", list(range(N)), SamplingParams(max_tokens=4, ignore_eos=True), c := Sink())
        push(lp, "a")
        push(lp, "b")  # complete, but a holds the only slot for far longer than the bound
        # c's prefill never ends here: it is being served, not waiting, however long that takes
        began = time.monotonic()
        assert b.done.wait(10) and not b.tokens
        waited = time.monotonic() - began
        assert 0.5 < waited < 3.0, waited
        (refused,) = b.errors
        assert isinstance(refused, QueueWaitExceeded) and isinstance(refused, DecodeFull)
        assert "waited" in str(refused) and "--max-queue-wait-s=1" in str(refused) and refused.retry_after_s >= 1
        time.sleep(1.0)  # c: two bounds since its admission
        st = lp.stats()
        assert st["queue_timeouts"] == 1 and st["queued"] == 1 and st["running"] == 1 and st["ledger_open"] == 2
        assert not c.done.is_set() and not a.done.is_set() and a.tokens  # c still served, a goes on
        assert lp.cancel("a", "done with it") and lp.cancel("c", "done with it")
        assert lp.stats()["sequences"] == 0 and pool.stats().used_bytes == 0
    finally:
        lp.close()
        pool.close()


def test_with_a_measured_pace_a_request_past_the_bound_is_refused_at_admission():
    lp, pool = _loop(max_queue_wait_s=3.0)
    try:
        lp.pace.interval_s = 1.0  # as measured: one start a second
        lp.expect_remote("running", list(range(N)), SamplingParams(max_tokens=100_000, ignore_eos=True), Sink())
        push(lp, "running")  # the one slot taken: new requests will wait for it
        _until(lambda: lp.stats()["running"] == 1)
        for i in range(3):  # the third, behind 2, starts in about 3 s: within the bound
            lp.expect_remote(f"q{i}", list(range(N)), SamplingParams(max_tokens=4), Sink())
        with pytest.raises(DecodeFull) as refused:  # behind 3: about 4 s
            lp.expect_remote("late", list(range(N)), SamplingParams(max_tokens=4), Sink())
        assert "about 4.0 s (3 queued ahead of it, one starting every 1.00 s)" in str(refused.value)
        assert "past its bound --max-queue-wait-s=3; retry after 2 s" in str(refused.value)
        assert refused.value.retry_after_s == 2  # 1 s past the bound, 10 % longer, rounded up
        st = lp.stats()
        assert (st["rejected"], st["rejected_by_estimate"], st["queued"], st["ledger_open"]) == (1, 1, 3, 4)
    finally:
        lp.close()
        pool.close()


def test_a_bound_of_zero_never_refuses_by_time():
    lp, pool = _loop(max_queue_wait_s=0)
    try:
        lp.pace.interval_s = 100.0
        lp.expect_remote("a", list(range(N)), SamplingParams(max_tokens=4), Sink())
        lp.expect_remote("b", list(range(N)), SamplingParams(max_tokens=4), Sink())
        assert lp.stats()["queued"] == 2
        with pytest.raises(ValueError, match="max_queue_wait_s=-1"):
            DecodeLoop(lp.decoder, None, max_queue_wait_s=-1)
    finally:
        lp.close()
        pool.close()
