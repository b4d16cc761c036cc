"""How long a prompt waits in the prefill's queue before its engine run starts, and the bound on it.

The engine prefills one prompt at a time; the others wait their turn, in arrival order
(``PrefillQueue``). A waiting request of a P/D prefill is named in the heartbeats to its decode (the
decode sees it as served), so the decode's own ``--max-queue-wait-s`` does not cover this wait: the
prefill bounds it (``--max-queue-wait-s``, ``DEFAULT_MAX_QUEUE_WAIT_S``; 0: no bound) twice:

- at admission, from an estimate: the engine time of the prompts queued ahead (those waiting, and
  what is left of the one running). A run of ``n`` prompt tokens takes a fixed part (lookups, pool
  allocation, the hand-off to the decode), a part per token and a part per token squared (attention
  over the prompt), each fitted by least squares over the latest runs (``RunModel``, ``WINDOW``;
  prefix-cache hits included, so the fit is the workload's). Tokens over a single rate were wrong both
  ways on mixed prompts: a queue of short prompts is mostly fixed costs, a queue of long ones costs
  more per token than short runs do. A request the estimate puts past the bound is refused at once
  (HTTP 429 with ``Retry-After``, below). Until ``MIN_RUNS`` runs are fitted
  the estimate refuses nothing: a fresh prefill's first run, often a short prompt that is all fixed
  cost on a cold process, read as a rate once put a 4096-token run at 46 s instead of 1.6 and refused
  229 of a 256-client burst that it would have served within its bound.
- as a guarantee: a request still waiting for its turn when the bound has passed leaves the queue and
  is refused then (``QueueWaitExceeded``, 429 before any byte), whatever the estimate said.

Every refusal's ``Retry-After`` is the wait after which the same request, sent again, would be
admitted by the same estimate: the engine time ahead of a request queued now, plus the engine time
of the refused requests already told to come back before it (``Returns``: each counts its own run
until its ``Retry-After`` is due, when it is back in the queue or gone), minus the bound — it lands
when the queue ahead has drained to the bound — made ``RETRY_SLACK`` longer (an engine slower than
its fit over that wait) and rounded up to whole seconds, within [1, ``MAX_RETRY_AFTER_S``]. Without
the returns counted, the requests refused together each heard the queue's excess alone (1 s beside
an estimate of 60.0 s), came back together and all but one were refused again (issue 44: about 31
tries a request in a 96-request burst). Requests refused in turn come back in turn, each to the room
the ones before it left. A client that follows it is refused again when fresh requests took that
room meanwhile, or when its wait was longer than ``MAX_RETRY_AFTER_S`` (the longest OpenAI's Python
client follows: 60 s in its 1.x releases, 120 s later). Before ``MIN_RUNS`` runs are fitted, or
without a bound (``0``: only the cap on requests in service refuses), it is 1 s.

A request also leaves the queue when its decode no longer waits for it (the client went away): the
waiter asks ``cancelled()`` every ``POLL_S``. At most ``MAX_IN_SERVICE`` requests are in service at
once (waiting, running, or awaiting their decodes' reads; each holds a thread): one more is refused
at once. The bound is on the wait before the engine run; the run itself, however long the prompt,
is service.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_QUEUE_WAIT_S = 60.0
WINDOW = 64  # the latest runs the engine's time is fitted over
MIN_RUNS = 4  # runs fitted before the estimate refuses anyone (the bound's guarantee holds from the start)
PROBE_TOKENS = 4096  # the prompt length the refusals and Stats quote the fitted run time of
POLL_S = 0.5  # how often a waiting request asks whether its decode still wants it
MAX_IN_SERVICE = 256  # requests waiting, running or awaiting reads at once (the HTTP side's threads)
MAX_RETRY_AFTER_S = 60  # the longest Retry-After given (module doc): OpenAI's Python client follows up to 60 s
RETRY_SLACK = 0.1  # a Retry-After is this much longer than the estimate's excess over the bound


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
    """The engine time of a run of ``n`` prompt tokens: ``fixed_s + n * token_s + n**2 * square_s`` (the
    lookups and the hand-off; the work per token; attention over the prompt), each term >= 0, fitted by
    least squares over the last ``WINDOW`` runs: of the subsets of those terms, the one with
    non-negative coefficients that fits them best, with no more terms than distinct sizes seen (one
    size seen: tokens over a rate)."""

    TERMS = (
        ("fixed", "token", "square"),
        ("fixed", "token"),
        ("token", "square"),
        ("fixed", "square"),
        ("token",),
        ("square",),
        ("fixed",),
    )

    def __init__(self) -> None:
        self._runs: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (kilotokens, seconds)
        self._coef: dict[str, float] | None = None  # per term, in seconds per token, per token**2

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._runs.append((tokens / 1000, max(0.0, seconds)))
            self._coef = self._solve()

    def _solve(self) -> dict[str, float] | None:
        import torch  # the prefill has it loaded; kilotokens keep the squares well-conditioned

        k = torch.tensor([r[0] for r in self._runs], dtype=torch.float64)
        t = torch.tensor([r[1] for r in self._runs], dtype=torch.float64)
        cols = {"fixed": torch.ones_like(k), "token": k, "square": k * k}
        sizes = len({r[0] for r in self._runs})
        tie = 1e-9 * float((t * t).sum())  # fits closer than this are equal: the earlier terms win
        best: tuple[float, tuple[str, ...], list[float]] | None = None
        for terms in self.TERMS:
            if len(terms) > sizes:
                continue
            x = torch.stack([cols[c] for c in terms], 1)
            coef = torch.linalg.lstsq(x, t[:, None]).solution[:, 0]
            if bool((coef < 0).any()):
                continue
            resid = float(((x @ coef - t) ** 2).sum())
            if best is None or resid < best[0] - tie:
                best = (resid, terms, coef.tolist())
        if best is None:
            return None
        got = dict(zip(best[1], best[2], strict=True))
        return {
            "fixed": got.get("fixed", 0.0),
            "token": got.get("token", 0.0) / 1e3,
            "square": got.get("square", 0.0) / 1e6,
        }

    @property
    def runs(self) -> int:
        """Runs the fit is over (the latest ``WINDOW``)."""
        return len(self._runs)

    def fit(self) -> dict[str, float] | None:
        """The terms (``fixed`` s, ``token`` s per token, ``square`` s per token**2); None before a run."""
        return self._coef

    def seconds(self, tokens: float) -> float | None:
        """The estimated engine time of a run of ``tokens`` prompt tokens (None: no fit yet)."""
        c = self._coef
        return None if c is None else c["fixed"] + c["token"] * tokens + c["square"] * tokens * tokens


class Returns:
    """Refused requests told to come back and not due yet: when each is due (its ``Retry-After``) and
    the engine time its run will add to the queue then."""

    def __init__(self) -> None:
        self._due: list[tuple[float, float]] = []  # a heap of (due, seconds)
        self._seconds = 0.0

    def promise(self, due: float, seconds: float) -> None:
        heapq.heappush(self._due, (due, seconds))
        self._seconds += seconds

    def seconds(self, now: float) -> float:
        """The engine time of the returns not due at ``now`` (those due are back in the queue, or gone)."""
        while self._due and self._due[0][0] <= now:
            self._seconds -= heapq.heappop(self._due)[1]
        if not self._due:
            self._seconds = 0.0  # no float residue
        return self._seconds


@dataclass(eq=False)
class Turn:
    """One request's place: its prompt tokens and when it was admitted (monotonic)."""

    request_id: str
    tokens: int
    admitted: float
    wake: threading.Condition  # its waiter's, on the queue's lock
    started: float | None = None  # when its engine run began
    done: bool = False


class PrefillQueue:
    """Turns at the engine in arrival order, each wait bounded by ``bound_s`` (module doc)."""

    def __init__(self, bound_s: float = DEFAULT_MAX_QUEUE_WAIT_S, clock: Callable[[], float] = time.monotonic) -> None:
        if bound_s < 0:
            raise ValueError(f"--max-queue-wait-s = {bound_s} must be >= 0 (0: no bound)")
        self.bound_s, self.clock = bound_s, clock
        self._lock = threading.Lock()  # each turn waits on a condition of its own over it (``Turn.wake``)
        self._waiting: deque[Turn] = deque()
        self._running: Turn | None = None
        self._in_service = 0
        self.model = RunModel()  # the engine time of a run, learnt from the runs
        self.returns = Returns()  # the refused requests told when to come back
        # Stats names: the decode's for the same things
        self.counters = {"rejected_by_estimate": 0, "rejected_queue_full": 0, "queue_timeouts": 0, "abandoned": 0}

    @property
    def rate_tokens_per_s(self) -> float | None:
        """Prompt tokens per second of the per-token term; None before the first run or without it."""
        f = self.model.fit()
        return 1.0 / f["token"] if f is not None and f["token"] > 0 else None

    def _ahead_s(self, now: float) -> float | None:
        """The wait of a request queued now: the engine time of the runs ahead; None without a fit."""
        m = self.model
        if m.fit() is None:
            return None
        ahead = sum(m.seconds(t.tokens) or 0.0 for t in self._waiting)
        if self._running is not None and self._running.started is not None:
            ahead += max(0.0, (m.seconds(self._running.tokens) or 0.0) - (now - self._running.started))
        return ahead

    def _retry_after_s(self, now: float, tokens: int) -> int:
        """A refusal's ``Retry-After`` for a request of ``tokens`` prompt tokens (module doc): when the
        estimate would admit it, counting the returns promised before it; it is promised too."""
        ahead = self._ahead_s(now)
        if not self.bound_s or ahead is None or self.model.runs < MIN_RUNS:
            return 1
        excess = ahead + self.returns.seconds(now) - self.bound_s
        wait = min(MAX_RETRY_AFTER_S, max(1, math.ceil(excess * (1 + RETRY_SLACK))))
        self.returns.promise(now + wait, self.model.seconds(tokens) or 0.0)
        return wait

    def admit(self, request_id: str, tokens: int) -> Turn:
        """A place in the queue, or ``PrefillBusy`` when it is full or the estimate is past the bound."""
        with self._lock:
            now = self.clock()
            if self._in_service >= MAX_IN_SERVICE:
                self.counters["rejected_queue_full"] += 1
                wait = self._retry_after_s(now, tokens)
                raise PrefillBusy(
                    f"the prefill has {self._in_service} requests in service, its limit; retry after {wait} s",
                    retry_after_s=wait,
                )
            ahead = self._ahead_s(now)
            if self.bound_s and ahead is not None and self.model.runs >= MIN_RUNS and ahead > self.bound_s:
                self.counters["rejected_by_estimate"] += 1
                wait = self._retry_after_s(now, tokens)
                raise PrefillBusy(
                    f"the prefill would start this request in about {ahead:.1f} s ({len(self._waiting)} queued "
                    f"ahead of it; a run of {PROBE_TOKENS} prompt tokens takes about "
                    f"{self.model.seconds(PROBE_TOKENS) or 0.0:.2f} s here), past its bound "
                    f"--max-queue-wait-s={self.bound_s:g}; retry after {wait} s",
                    retry_after_s=wait,
                )
            turn = Turn(request_id, tokens, now, threading.Condition(self._lock))
            self._waiting.append(turn)
            self._in_service += 1
            return turn

    def wait(self, turn: Turn, cancelled: Callable[[], str] = lambda: "") -> None:
        """Block until ``turn`` may run the engine (it is first and the engine is free); raises
        ``QueueWaitExceeded`` past the bound, ``Abandoned`` when ``cancelled()`` names a reason —
        either way ``turn`` has left the queue."""
        with self._lock:
            while self._running is not None or self._waiting[0] is not turn:
                now = self.clock()
                left = self.bound_s - (now - turn.admitted) if self.bound_s else POLL_S
                why = "" if left <= 0 else cancelled()
                if left <= 0 or why:
                    self._waiting.remove(turn)
                    self._wake_first()
                    if why:
                        self.counters["abandoned"] += 1
                        raise Abandoned(why)
                    self.counters["queue_timeouts"] += 1
                    wait = self._retry_after_s(now, turn.tokens)
                    raise QueueWaitExceeded(
                        f"the request waited {now - turn.admitted:.1f} s in the prefill's queue without "
                        f"starting, past its bound --max-queue-wait-s={self.bound_s:g}; retry after {wait} s",
                        retry_after_s=wait,
                    )
                turn.wake.wait(min(left, POLL_S))
            self._waiting.popleft()
            self._running, turn.started = turn, self.clock()

    def ran(self, turn: Turn) -> None:
        """``turn``'s engine run ended (or failed): the engine is free; the rate learns its pace."""
        with self._lock:
            if self._running is turn and turn.started is not None:
                self.model.add(turn.tokens, self.clock() - turn.started)
                self._running = None
                self._wake_first()

    def leave(self, turn: Turn) -> None:
        """``turn``'s request is done with (answered, failed, refused): out of service."""
        with self._lock:
            if not turn.done:
                turn.done = True
                self._in_service -= 1
                if turn in self._waiting:  # never waited (its worker failed before): the next may be first
                    self._waiting.remove(turn)
                    self._wake_first()

    def _wake_first(self) -> None:
        """Wakes the first waiter, the only one that may run next (under the lock). One wake, not one
        per waiter: with 200 requests queued, each run's end woke 200 threads, each to take the GIL
        from the engine's thread and go back to sleep."""
        if self._waiting:
            self._waiting[0].wake.notify()

    def stats(self) -> dict[str, float]:
        with self._lock:
            rate, fit, probe = self.rate_tokens_per_s, self.model.fit(), self.model.seconds(PROBE_TOKENS)
            return {
                **self.counters,
                "queued": len(self._waiting),
                "queued_tokens": sum(t.tokens for t in self._waiting),
                "in_service": self._in_service,
                "rate_tokens_per_s": round(rate, 1) if rate is not None else 0.0,
                "run_fixed_s": round(fit["fixed"], 4) if fit is not None else 0.0,
                "run_4k_s": round(probe, 3) if probe is not None else 0.0,  # a run of PROBE_TOKENS
                "max_queue_wait_s": self.bound_s,
            }
