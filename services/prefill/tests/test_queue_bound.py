"""``PrefillQueue``: turns at the engine in arrival order, refused from the estimate at admission, or
after waiting past the bound, or when the decode drops the request; the rate learnt from the runs."""

from __future__ import annotations

import re
import threading
import time

import pytest

from kvoffload_prefill import queue_bound
from kvoffload_prefill.queue_bound import Abandoned, PrefillBusy, PrefillQueue, QueueWaitExceeded, Turn


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_once(queue: PrefillQueue, clock: Clock, tokens: int, seconds: float) -> None:
    """One request through the engine, ``seconds`` long on ``clock``."""
    turn = queue.admit("warm", tokens)
    queue.wait(turn)
    clock.now += seconds
    queue.ran(turn)
    queue.leave(turn)


def busy(bound_s: float) -> tuple[PrefillQueue, Turn]:
    """A queue whose engine request "a" holds; the turn of "a"."""
    queue = PrefillQueue(bound_s=bound_s)
    first = queue.admit("a", 10)
    queue.wait(first)  # the engine is free: at once
    return queue, first


def waiter(queue: PrefillQueue, turn, order: list, cancelled=lambda: "") -> threading.Thread:
    """A thread that waits for ``turn``, records its request id (or its error), runs and leaves."""

    def go() -> None:
        try:
            queue.wait(turn, cancelled)
            order.append(turn.request_id)
            queue.ran(turn)
        except PrefillBusy as exc:
            order.append(exc)
        except Abandoned as exc:
            order.append(exc)
        finally:
            queue.leave(turn)

    t = threading.Thread(target=go)
    t.start()
    return t


def test_turns_go_in_arrival_order_one_at_a_time():
    queue, first = busy(30)
    order: list = []
    threads = [waiter(queue, queue.admit(rid, 10), order) for rid in ("b", "c", "d")]
    time.sleep(0.2)
    assert order == [] and queue.stats()["queued"] == 3  # the engine is a's
    queue.ran(first)
    queue.leave(first)
    for t in threads:
        t.join(5)
    assert order == ["b", "c", "d"]
    assert queue.stats()["in_service"] == 0 and queue.stats()["queued"] == 0


def test_the_end_of_a_run_wakes_only_the_next_in_line_and_at_once(monkeypatch):
    """A run's end wakes the first waiter, not all of them (each wake of 200 queued requests took the
    engine thread's GIL), and the turns still follow one another without waiting for a poll."""
    monkeypatch.setattr(queue_bound, "POLL_S", 30.0)  # only wakes move a waiter here
    queue, first = busy(60)
    order: list = []
    asked: dict[str, int] = {}

    def counted(rid: str):
        def cancelled() -> str:
            asked[rid] = asked.get(rid, 0) + 1
            return ""

        return cancelled

    ids = [f"r{i}" for i in range(20)]
    threads = [waiter(queue, queue.admit(rid, 10), order, cancelled=counted(rid)) for rid in ids]
    deadline = time.monotonic() + 5
    while len(asked) < len(ids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert asked == dict.fromkeys(ids, 1)  # each waiter checked once, then slept
    t0 = time.monotonic()
    queue.ran(first)  # r0 runs, then r1, ... each woken by the previous run's end
    queue.leave(first)
    for t in threads:
        t.join(5)
    assert order == ids and time.monotonic() - t0 < 5  # not a 30 s poll
    # a waiter is woken only when it is first: the check at entry, then none (r0 went at the first
    # wake, which ends its loop before a check)
    assert asked == dict.fromkeys(ids, 1), asked


def test_the_estimate_refuses_at_admission_what_would_wait_past_the_bound():
    clock = Clock()
    queue = PrefillQueue(bound_s=10, clock=clock)
    assert queue.rate_tokens_per_s is None
    for _ in range(queue_bound.MIN_RUNS):
        run_once(queue, clock, 1000, 2.0)  # 500 tokens/s
    assert queue.rate_tokens_per_s == pytest.approx(500)
    running = queue.admit("running", 1000)
    queue.wait(running)
    clock.now += 1.0  # half of it left: 500 tokens, 1 s
    queued = [queue.admit(f"q{i}", 1000) for i in range(4)]  # +8 s: 9 s ahead of the next
    assert queue.stats()["queued_tokens"] == 4000
    fits = queue.admit("fits", 3000)  # 9 s <= 10: admitted, whatever its own length
    with pytest.raises(
        PrefillBusy, match=r"about 15\.0 s \(5 queued ahead.*4096 prompt tokens takes about 8\.19 s.*wait-s=10;"
    ) as info:
        queue.admit("late", 10)  # 1 + 8 + 6 s ahead
    assert info.value.retry_after_s == 6  # the excess over the bound (5 s), 10 % longer, rounded up
    clock.now += 0.9  # the running one nearly done: 14.1 s ahead, and "late" (0.02 s) due back before
    with pytest.raises(PrefillBusy, match="retry after 5 s") as info:
        queue.admit("later", 10)
    assert info.value.retry_after_s == 5  # 4.12 s past the bound, 10 % longer, rounded up
    assert queue.stats()["rejected_by_estimate"] == 2 and queue.stats()["queued"] == 5
    assert len(queued) == 4 and fits.tokens == 3000


def test_the_estimate_refuses_nobody_until_it_has_fitted_a_few_runs():
    """One run is no pace: a fresh prefill's first run (a short prompt, a cold process) read as a rate
    would refuse a burst it can serve. Until MIN_RUNS runs, admission follows the bound alone."""
    clock = Clock()
    queue = PrefillQueue(bound_s=10, clock=clock)
    run_once(queue, clock, 10, 0.3)  # 33 tokens/s: 4096 tokens "in 123 s"
    assert queue.stats()["run_4k_s"] > 10
    turns = [queue.admit(f"q{i}", 1000) for i in range(queue_bound.MIN_RUNS)]  # "30 s each": admitted
    for t in turns:
        queue.wait(t)
        clock.now += 0.3
        queue.ran(t)
        queue.leave(t)
    assert queue.model.runs == queue_bound.MIN_RUNS + 1 and queue.stats()["rejected_by_estimate"] == 0
    running = queue.admit("running", 1000)
    queue.wait(running)
    ahead = [queue.admit(f"a{i}", 1000) for i in range(33)]  # 0.3 s each now: the last 9.9 s ahead
    with pytest.raises(PrefillBusy, match=r"would start this request in about 10\.2 s \(33 queued"):
        queue.admit("late", 1000)
    assert queue.stats()["rejected_by_estimate"] == 1 and len(ahead) == 33


def test_a_request_still_waiting_at_the_bound_leaves_the_queue_with_429():
    queue, first = busy(0.4)
    order: list = []
    started = time.monotonic()
    late = waiter(queue, queue.admit("b", 10), order)
    late.join(5)
    waited = time.monotonic() - started
    assert 0.35 < waited < 1.5, waited
    assert len(order) == 1 and isinstance(order[0], QueueWaitExceeded)
    said = re.search(r"waited (\d+\.\d) s in the prefill's queue without starting", str(order[0]))
    assert said and 0.4 <= float(said[1]) <= waited + 0.05, order  # a busy machine wakes it late
    assert "--max-queue-wait-s=0.4" in str(order[0])
    stats = queue.stats()
    assert stats["queue_timeouts"] == 1 and stats["queued"] == 0 and stats["in_service"] == 1  # a's
    queue.ran(first)
    queue.leave(first)
    after = queue.admit("c", 10)
    queue.wait(after)  # nothing left behind in the queue: at once


def test_the_next_in_line_is_first_once_the_one_ahead_timed_out():
    queue, first = busy(0.3)
    order: list = []
    b = waiter(queue, queue.admit("b", 10), order)
    time.sleep(0.2)
    c_turn = queue.admit("c", 10)  # admitted 0.2 s later: its bound passes later
    b.join(5)
    queue.ran(first)  # the engine is free after b left: c runs
    c = waiter(queue, c_turn, order)
    c.join(5)
    assert isinstance(order[0], QueueWaitExceeded) and order[1] == "c", order


def test_a_request_its_decode_dropped_leaves_the_queue():
    queue, first = busy(30)
    order: list = []
    dropped = threading.Event()
    t = waiter(queue, queue.admit("b", 10), order, cancelled=lambda: "the client went away" if dropped.is_set() else "")
    time.sleep(0.1)
    dropped.set()
    t.join(queue_bound.POLL_S + 2)
    assert len(order) == 1 and isinstance(order[0], Abandoned) and "client went away" in str(order[0])
    assert queue.stats()["abandoned"] == 1 and queue.stats()["queued"] == 0


def test_the_requests_in_service_are_capped(monkeypatch):
    monkeypatch.setattr(queue_bound, "MAX_IN_SERVICE", 2)
    queue = PrefillQueue(bound_s=30)
    a, b = queue.admit("a", 1), queue.admit("b", 1)
    with pytest.raises(PrefillBusy, match="2 requests in service, its limit"):
        queue.admit("c", 1)
    assert queue.stats()["rejected_queue_full"] == 1
    queue.leave(a)  # a never waited (its worker failed first): b is first now, and c has room
    queue.wait(b)
    queue.admit("c", 1)
    queue.leave(b)
    queue.leave(b)  # leaving twice counts once
    assert queue.stats()["in_service"] == 1


def test_no_bound_refuses_nothing_and_times_nothing_out():
    clock = Clock()
    queue = PrefillQueue(bound_s=0, clock=clock)
    run_once(queue, clock, 10, 10.0)  # 1 token/s
    running = queue.admit("r", 10_000)
    queue.wait(running)
    waiting = [queue.admit(f"w{i}", 10_000) for i in range(5)]  # hours ahead: admitted
    clock.now += 3600
    order: list = []
    t = waiter(queue, waiting[0], order)
    time.sleep(0.2)
    assert order == [] and t.is_alive()  # still waiting, not timed out
    queue.ran(running)
    t.join(5)
    assert order == ["w0"]


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="must be >= 0"):
        PrefillQueue(bound_s=-1)


def test_the_run_model_learns_a_fixed_part_and_a_part_per_token():
    model = queue_bound.RunModel()
    assert model.fit() is None and model.seconds(100) is None
    model.add(1000, 1.1)
    assert model.fit() == pytest.approx({"fixed": 0.0, "token": 0.0011, "square": 0.0})  # one size: a rate
    for _ in range(10):  # short and long prompts alternate: 0.1 s per run + 1 ms per token
        model.add(10, 0.11)
        model.add(1200, 1.3)
    f = model.fit()
    assert f["fixed"] == pytest.approx(0.1, abs=0.01) and f["token"] == pytest.approx(0.001, rel=0.02)
    assert model.seconds(10) == pytest.approx(0.11, abs=0.01) and model.seconds(1200) == pytest.approx(1.3, rel=0.02)


def test_the_run_model_learns_the_cost_that_grows_with_the_square_of_the_prompt():
    """Attention over the prompt: 0.05 s + 0.2 ms per token + 0.1 us per token squared, over mixed sizes."""
    model = queue_bound.RunModel()
    for n in (10, 300, 1000, 2500, 6000) * 4:
        model.add(n, 0.05 + 2e-4 * n + 1e-7 * n * n)
    f = model.fit()
    assert f == pytest.approx({"fixed": 0.05, "token": 2e-4, "square": 1e-7}, rel=1e-3, abs=1e-6)
    assert model.seconds(4096) == pytest.approx(0.05 + 0.8192 + 1.6777, rel=1e-3)
    assert len(model._runs) == 20 and queue_bound.WINDOW >= 20
    for _ in range(queue_bound.WINDOW):  # only the latest runs count: the engine got twice as slow
        for n in (10, 300, 1000, 2500, 6000):
            model.add(n, 2 * (0.05 + 2e-4 * n + 1e-7 * n * n))
    assert model.seconds(4096) == pytest.approx(2 * (0.05 + 0.8192 + 1.6777), rel=1e-3)


def test_a_queue_of_short_prompts_is_estimated_by_their_fixed_costs():
    """22 short prompts ahead are 2.4 s of engine time, 23 are 2.5 s: the 24th is refused under a 2.45 s
    bound, where their tokens alone (0.26 s) would have admitted hundreds."""
    clock = Clock()
    queue = PrefillQueue(bound_s=2.45, clock=clock)
    for _ in range(10):
        run_once(queue, clock, 10, 0.11)
        run_once(queue, clock, 1200, 1.3)
    assert queue.stats()["run_fixed_s"] == pytest.approx(0.1, abs=0.01)
    assert queue.rate_tokens_per_s == pytest.approx(1000, rel=0.02)
    assert queue.stats()["run_4k_s"] == pytest.approx(0.1 + 4.096, rel=0.02)
    ahead = [queue.admit(f"s{i}", 10) for i in range(23)]
    with pytest.raises(PrefillBusy, match=r"about 2\.5 s \(23 queued ahead.*4096 prompt tokens takes about 4\.2\d s"):
        queue.admit("short", 10)
    assert len(ahead) == 23


def test_a_queue_of_long_prompts_is_not_charged_the_short_ones_overhead_per_token():
    """After mixed runs, 40 prompts of 1,200 tokens ahead are 52 s: admitted under a 55 s bound (tokens
    over the smoothed rate of the same runs would say 55.5 s and refuse)."""
    clock = Clock()
    queue = PrefillQueue(bound_s=55, clock=clock)
    for _ in range(10):
        run_once(queue, clock, 10, 0.11)
        run_once(queue, clock, 1200, 1.3)
    for i in range(40):
        queue.admit(f"l{i}", 1200)
    queue.admit("next", 1200)  # 40 x 1.3 s = 52 s ahead: within the bound
    assert queue.stats()["rejected_by_estimate"] == 0
