"""How long a prompt waits in the prefill's queue before its engine run starts, and the bound on it.

The engine prefills one prompt at a time; the others wait their turn, in arrival order
(``PrefillQueue``). A waiting request of a P/D prefill is named in the heartbeats to its decode (the
decode sees it as served), so the decode's own ``--max-queue-wait-s`` does not cover this wait: the
prefill bounds it (``--max-queue-wait-s``, ``DEFAULT_MAX_QUEUE_WAIT_S``; 0: no bound) twice:

- at admission, from an estimate: the engine time of the prompts queued ahead (those waiting, and
  what is left of the one running). A run of ``n`` prompt tokens takes ``c + n / rate`` seconds: a
  fixed part (lookups, pool allocation, the hand-off to the decode) and a part per token, fitted by
  least squares over recent runs (``RunModel``: smoothed sums, ``ALPHA``; prefix-cache hits included,
  so the fit is the workload's; while the runs seen are all of one size, no fixed part). Tokens over
  a single rate alone were wrong both ways on mixed prompts: a queue of short prompts is mostly fixed
  costs, a queue of long ones mostly tokens. A request the estimate puts past the bound is refused at
  once (HTTP 429, ``Retry-After`` the estimate's excess over the bound). Before the first run there is
  no estimate, and none refuses.
- as a guarantee: a request still waiting for its turn when the bound has passed leaves the queue and
  is refused then (``QueueWaitExceeded``, 429 before any byte), whatever the estimate said.

A request also leaves the queue when its decode no longer waits for it (the client went away): the
waiter asks ``cancelled()`` every ``POLL_S``. At most ``MAX_IN_SERVICE`` requests are in service at
once (waiting, running, or awaiting their decodes' reads; each holds a thread): one more is refused
at once. The bound is on the wait before the engine run; the run itself, however long the prompt,
is service.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_QUEUE_WAIT_S = 60.0
ALPHA = 0.2  # weight of the newest run in the rate
POLL_S = 0.5  # how often a waiting request asks whether its decode still wants it
MAX_IN_SERVICE = 256  # requests waiting, running or awaiting reads at once (the HTTP side's threads)


class PrefillBusy(RuntimeError):
    """A request refused (HTTP 429): the queue would hold it too long, or is full."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueWaitExceeded(PrefillBusy):
    """A queued request did not reach the engine within the bound: refused (HTTP 429)."""


class Abandoned(RuntimeError):
    """A queued request left the queue: its decode no longer waits for it."""


class RunModel:
    """The engine time of a run of ``n`` prompt tokens, ``fixed_s + n * per_token_s``, fitted by least
    squares over the runs seen, each weighted by ``ALPHA`` against the ones before (module doc)."""

    def __init__(self) -> None:
        self.runs = 0
        self._n = self._t = self._nn = self._nt = 0.0  # smoothed n, t, n^2, n*t

    def add(self, tokens: int, seconds: float) -> None:
        w = 1.0 if self.runs == 0 else ALPHA
        n, t = float(tokens), max(0.0, seconds)
        self._n += w * (n - self._n)
        self._t += w * (t - self._t)
        self._nn += w * (n * n - self._nn)
        self._nt += w * (n * t - self._nt)
        self.runs += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed_s, per_token_s); None before the first run (or with no tokens seen)."""
        if self.runs == 0 or self._n <= 0:
            return None
        var = self._nn - self._n * self._n
        if var > (0.01 * self._n) ** 2:  # runs of different sizes: fixed part and slope
            per = (self._nt - self._n * self._t) / var
            fixed = self._t - per * self._n
            if per > 0 and fixed >= 0:
                return fixed, per
            if per > 0:  # the line crosses below zero: through the origin
                return 0.0, self._nt / self._nn
        return 0.0, self._t / self._n  # one size seen (or no slope): tokens over a rate

    def seconds(self, tokens: float) -> float | None:
        """The estimated engine time of a run of ``tokens`` prompt tokens (None: no fit yet)."""
        f = self.fit()
        return None if f is None else f[0] + f[1] * tokens


@dataclass(eq=False)
class Turn:
    """One request's place: its prompt tokens and when it was admitted (monotonic)."""

    request_id: str
    tokens: int
    admitted: float
    started: float | None = None  # when its engine run began
    done: bool = False


class PrefillQueue:
    """Turns at the engine in arrival order, each wait bounded by ``bound_s`` (module doc)."""

    def __init__(self, bound_s: float = DEFAULT_MAX_QUEUE_WAIT_S, clock: Callable[[], float] = time.monotonic) -> None:
        if bound_s < 0:
            raise ValueError(f"--max-queue-wait-s = {bound_s} must be >= 0 (0: no bound)")
        self.bound_s, self.clock = bound_s, clock
        self._cond = threading.Condition()
        self._waiting: deque[Turn] = deque()
        self._running: Turn | None = None
        self._in_service = 0
        self.model = RunModel()  # the engine time of a run, learnt from the runs
        # Stats names: the decode's for the same things
        self.counters = {"rejected_by_estimate": 0, "rejected_queue_full": 0, "queue_timeouts": 0, "abandoned": 0}

    @property
    def rate_tokens_per_s(self) -> float | None:
        """Prompt tokens per second of engine run beyond its fixed part; None before the first run."""
        f = self.model.fit()
        return 1.0 / f[1] if f is not None and f[1] > 0 else None

    def _ahead_s(self, now: float) -> float | None:
        """The wait of a request queued now: the engine time of the runs ahead; None without a fit."""
        f = self.model.fit()
        if f is None:
            return None
        fixed, per = f
        ahead = sum(fixed + per * t.tokens for t in self._waiting)
        if self._running is not None and self._running.started is not None:
            ahead += max(0.0, fixed + per * self._running.tokens - (now - self._running.started))
        return ahead

    def _retry_after_s(self, ahead_s: float | None) -> float:
        """A refusal's ``Retry-After``: the estimate's excess over the bound, at least 1 s."""
        return max(1, math.ceil((ahead_s or 0) - self.bound_s))

    def admit(self, request_id: str, tokens: int) -> Turn:
        """A place in the queue, or ``PrefillBusy`` when it is full or the estimate is past the bound."""
        with self._cond:
            now = self.clock()
            if self._in_service >= MAX_IN_SERVICE:
                self.counters["rejected_queue_full"] += 1
                raise PrefillBusy(
                    f"the prefill has {self._in_service} requests in service, its limit; retry later",
                    retry_after_s=self._retry_after_s(self._ahead_s(now)),
                )
            ahead = self._ahead_s(now)
            if self.bound_s and ahead is not None and ahead > self.bound_s:
                self.counters["rejected_by_estimate"] += 1
                fixed, per = self.model.fit() or (0.0, 0.0)
                raise PrefillBusy(
                    f"the prefill would start this request in about {ahead:.1f} s ({len(self._waiting)} queued "
                    f"ahead of it, {1 / per:.0f} prompt tokens/s and {fixed:.2f} s per run), past its bound "
                    f"--max-queue-wait-s={self.bound_s:g}; retry later",
                    retry_after_s=self._retry_after_s(ahead),
                )
            turn = Turn(request_id, tokens, now)
            self._waiting.append(turn)
            self._in_service += 1
            return turn

    def wait(self, turn: Turn, cancelled: Callable[[], str] = lambda: "") -> None:
        """Block until ``turn`` may run the engine (it is first and the engine is free); raises
        ``QueueWaitExceeded`` past the bound, ``Abandoned`` when ``cancelled()`` names a reason —
        either way ``turn`` has left the queue."""
        with self._cond:
            while self._running is not None or self._waiting[0] is not turn:
                now = self.clock()
                left = self.bound_s - (now - turn.admitted) if self.bound_s else POLL_S
                why = "" if left <= 0 else cancelled()
                if left <= 0 or why:
                    self._waiting.remove(turn)
                    self._cond.notify_all()  # the next one may be first now
                    if why:
                        self.counters["abandoned"] += 1
                        raise Abandoned(why)
                    self.counters["queue_timeouts"] += 1
                    raise QueueWaitExceeded(
                        f"the request waited {now - turn.admitted:.1f} s in the prefill's queue without "
                        f"starting, past its bound --max-queue-wait-s={self.bound_s:g}; retry later",
                        retry_after_s=self._retry_after_s(self._ahead_s(now)),
                    )
                self._cond.wait(min(left, POLL_S))
            self._waiting.popleft()
            self._running, turn.started = turn, self.clock()

    def ran(self, turn: Turn) -> None:
        """``turn``'s engine run ended (or failed): the engine is free; the rate learns its pace."""
        with self._cond:
            if self._running is turn and turn.started is not None:
                self.model.add(turn.tokens, self.clock() - turn.started)
                self._running = None
                self._cond.notify_all()

    def leave(self, turn: Turn) -> None:
        """``turn``'s request is done with (answered, failed, refused): out of service."""
        with self._cond:
            if not turn.done:
                turn.done = True
                self._in_service -= 1
                if turn in self._waiting:  # never waited (its worker failed before): the next may be first
                    self._waiting.remove(turn)
                    self._cond.notify_all()

    def stats(self) -> dict[str, float]:
        with self._cond:
            rate, fit = self.rate_tokens_per_s, self.model.fit()
            return {
                **self.counters,
                "queued": len(self._waiting),
                "queued_tokens": sum(t.tokens for t in self._waiting),
                "in_service": self._in_service,
                "rate_tokens_per_s": round(rate, 1) if rate is not None else 0.0,
                "run_fixed_s": round(fit[0], 4) if fit is not None else 0.0,
                "max_queue_wait_s": self.bound_s,
            }
