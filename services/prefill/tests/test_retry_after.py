"""The prefill's ``Retry-After`` (``kvoffload_prefill.queue_bound``): the wait after which the refused
request, sent again, would be admitted by the same estimate — the queue's excess over the bound and
the runs of the requests told to come back before it, 10 % longer, capped at what OpenAI's client
follows — so requests refused together come back in turn and are admitted, not refused again."""

from __future__ import annotations

import pytest

from kvoffload_prefill import queue_bound
from kvoffload_prefill.queue_bound import MAX_RETRY_AFTER_S, PrefillBusy, PrefillQueue

RUN_S = 1.0  # a run of 1000 prompt tokens, as fitted (one size: tokens over a rate)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fitted(bound_s: float) -> tuple[PrefillQueue, Clock]:
    """A queue whose fit says a 1000-token run takes ``RUN_S`` (``MIN_RUNS`` runs measured)."""
    clock = Clock()
    queue = PrefillQueue(bound_s=bound_s, clock=clock)
    for _ in range(queue_bound.MIN_RUNS):
        turn = queue.admit("warm", 1000)
        queue.wait(turn)
        clock.now += RUN_S
        queue.ran(turn)
        queue.leave(turn)
    assert queue.model.seconds(1000) == pytest.approx(RUN_S)
    return queue, clock


class Engine:
    """The engine running the queue's turns in arrival order, each ``RUN_S`` long on the clock (the
    fitted pace): ``seconds`` of 1000-token runs admitted first (under a bound lifted meanwhile)."""

    def __init__(self, queue: PrefillQueue, clock: Clock, seconds: int) -> None:
        self.queue, self.clock = queue, clock
        bound, queue.bound_s = queue.bound_s, 0.0
        self.waiting = [queue.admit(f"q{i}", 1000) for i in range(seconds)]
        queue.bound_s = bound
        self.running = self.waiting.pop(0)
        queue.wait(self.running)

    def step(self) -> None:
        """The running run ends; the next one starts."""
        self.clock.now += RUN_S
        self.queue.ran(self.running)
        self.queue.leave(self.running)
        self.running = self.waiting.pop(0)
        self.queue.wait(self.running)  # first, the engine free: at once

    def admit(self, request_id: str) -> None:
        self.waiting.append(self.queue.admit(request_id, 1000))


def refused(queue: PrefillQueue, request_id: str) -> int:
    with pytest.raises(PrefillBusy) as info:
        queue.admit(request_id, 1000)
    return int(info.value.retry_after_s)


def test_an_estimate_of_90_s_against_a_bound_of_60_s_says_retry_after_about_30_s():
    queue, clock = fitted(bound_s=60)
    Engine(queue, clock, 90)
    assert refused(queue, "late") == 33  # the 30 s it is past the bound, 10 % longer: not 1


def test_requests_refused_together_come_back_in_turn_and_each_is_admitted():
    """The engine runs the queue at the fitted pace; 8 requests refused at once each come back after
    their Retry-After and are admitted on that try. Told the queue's excess alone (1 s each), they
    all came back together and all but one were refused again."""
    queue, clock = fitted(bound_s=10)
    start = clock.now
    engine = Engine(queue, clock, 11)  # 11 s of runs: the next request would start in 11 s, past 10
    hints = {f"r{i}": refused(queue, f"r{i}") for i in range(8)}
    assert sorted(hints.values()) == list(hints.values()) and len(set(hints.values())) == 8, hints
    due = {rid: start + wait for rid, wait in hints.items()}
    admitted: list[str] = []
    while due:
        engine.step()
        for rid in [r for r, at in due.items() if at <= clock.now]:
            engine.admit(rid)  # refused again: PrefillBusy fails the test
            admitted.append(rid)
            del due[rid]
    assert admitted == list(hints) and queue.stats()["rejected_by_estimate"] == 8


def test_a_request_that_follows_its_hint_lands_within_the_bound_with_room_to_spare():
    queue, clock = fitted(bound_s=20)
    engine = Engine(queue, clock, 45)
    wait = refused(queue, "late")
    assert wait == 28  # (45 - 20) x 1.1, rounded up
    for _ in range(wait):
        engine.step()
    assert queue.stats()["queued"] == 45 - 1 - wait  # and the running one: 17 s ahead, within 20
    engine.admit("late")


def test_a_request_that_waited_past_the_bound_is_told_when_it_would_be_admitted():
    queue, clock = fitted(bound_s=10)
    engine = Engine(queue, clock, 30)
    late = engine.waiting[-1]
    clock.now += 10.5  # the running run stalls past the bound: its rest counts 0, 29 runs wait
    with pytest.raises(queue_bound.QueueWaitExceeded, match="retry after 20 s") as info:
        queue.wait(late)
    assert info.value.retry_after_s == 20  # 28 runs queued once it left: (28 - 10) x 1.1, rounded up
    assert queue.stats()["queue_timeouts"] == 1


def test_a_wait_longer_than_openais_client_follows_is_capped_and_no_fit_or_no_bound_says_1_s():
    queue, clock = fitted(bound_s=60)
    Engine(queue, clock, 200)
    assert refused(queue, "late") == MAX_RETRY_AFTER_S == 60  # 140 s past the bound: the client would not follow
    fresh = PrefillQueue(bound_s=10, clock=clock)  # no run fitted: no estimate
    assert fresh._retry_after_s(clock.now, 1000) == 1
    unbounded, _ = fitted(bound_s=0)
    Engine(unbounded, clock, 100)
    assert unbounded._retry_after_s(clock.now, 1000) == 1  # only the cap on requests in service refuses
