"""How long a request waits in the decode's queue before it starts decoding, and the bound on it.

A request *starts* when it joins the running batch (its first token is handed out). Before that it
is served (its prefill runs, its KV is pulled) or it waits in one of the decode's queues: for host
blocks (the pool is full), or, its prompt complete, for a sequence slot (the batch is full). The
decode bounds the time a request waits there (``--max-queue-wait-s``, ``DEFAULT_MAX_QUEUE_WAIT_S``;
0: no bound; a long prefill is service, never refused for its length) twice:

- at admission, from an estimate, when the batch is full (no free sequence slot: the request will
  wait for one): ``StartPace`` measures the queue's pace, the interval between two starts while a
  backlog remained (a request still queued after the first of them started), so an idle decode's
  gaps never count; the mean of the latest ``WINDOW`` intervals, once ``MIN_INTERVALS`` were
  measured. Starts come in bursts (a batch's slots free together), so a short average swings: in a
  256-client round (mean interval 0.15 s) an EWMA of weight 0.2 ranged 0.05-0.35 s and refused
  requests that then started within 40 s of a 60 s bound; the mean of 64 stayed in 0.11-0.19 s.
  A new request behind ``ahead`` queued ones starts in about ``(ahead + 1) * interval``; over the
  bound it is refused at once (HTTP 429 with ``Retry-After``, below). The
  pace covers whatever limits the starts — prefill, pull or the batch — without modelling each, so
  the estimate also counts its own prefill: it errs towards refusing early, when the bound is near.
  Before ``MIN_INTERVALS`` measured intervals there is no estimate, and nothing is refused by one.
- as a guarantee: a request that has waited past the bound is refused then (``QueueWaitExceeded``,
  HTTP 429 before any byte of its answer), so no request waits in these queues past the bound
  without an answer, whatever the estimate said (a burst on a fresh decode has no pace measured yet).

Every refusal's ``Retry-After`` (``StartPace.retry_after_s``) is the wait after which the same
request, sent again, would be admitted by the same estimate: counted in starts, the requests queued
ahead of it plus the refused ones already told to come back before it (each counts until its
``Retry-After`` is due, when it is back in the queue or gone), past what the bound admits — or, the
queue at its limit (``--max-queued-requests``), past what the limit admits, whichever is more — at
one start per measured interval; made ``RETRY_SLACK`` longer (a pace slower than measured over that
wait) and rounded up to whole seconds, within [1, ``MAX_RETRY_AFTER_S``]. The refused requests
counted in it keep the ones refused together from hearing the same short wait and coming back
together (the prefill's rule, ``kvoffload_prefill.queue_bound``, has the longer account).
``MAX_RETRY_AFTER_S`` is the longest OpenAI's Python client follows (60 s in its 1.x releases). Before
a pace is measured the decode's admission gives 1 s, up to 5 s for a queue many times deeper than
the batch.

Not bounded here: the wait for the prefill itself. A prefill that has the request sends heartbeats
for it while it queues behind other prompts, so the decode sees that wait as service; the prefill
bounds it (``kvoffload_prefill.queue_bound``: its queued prompt tokens and measured rate).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

DEFAULT_MAX_QUEUE_WAIT_S = 60.0
EXPIRY_SCAN_S = 0.1  # how often the loop looks for requests past the bound (and at once when one waits for blocks)
WINDOW = 64  # latest intervals the pace is the mean of (8 batches of the default 8 slots)
MIN_INTERVALS = 8  # intervals measured before the pace estimates anything
MAX_RETRY_AFTER_S = 60  # the longest Retry-After given (module doc): OpenAI's Python client follows up to 60 s
RETRY_SLACK = 0.1  # a Retry-After is this much longer than the wait the pace predicts


class DecodeFull(RuntimeError):
    """A new request is refused at once (HTTP 429): the queue is full, or would hold it too long."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueWaitExceeded(DecodeFull):
    """A queued request did not start within the bound: refused (HTTP 429) and freed."""


@dataclass
class StartPace:
    """The interval between request starts under a backlog (module doc); ``interval_s`` None until
    ``MIN_INTERVALS`` were measured. It also keeps the refused requests told to come back (when each
    is due), which the next refusals' ``Retry-After`` counts."""

    interval_s: float | None = None
    _last_start: float | None = None  # monotonic time of the previous start that left a backlog
    _gaps: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _returns: list[float] = field(default_factory=list)  # a heap of the times refused requests are due back

    def started(self, now: float, backlog: bool) -> None:
        """A request started at ``now``; ``backlog``: other admitted requests are still queued."""
        if self._last_start is not None:
            self._gaps.append(max(0.0, now - self._last_start))
            if len(self._gaps) >= MIN_INTERVALS:
                self.interval_s = sum(self._gaps) / len(self._gaps)
        self._last_start = now if backlog else None

    def estimate_s(self, ahead: int) -> float | None:
        """A new request's wait behind ``ahead`` queued requests; None before any pace was measured."""
        return None if self.interval_s is None else (ahead + 1) * self.interval_s

    def returns(self, now: float) -> int:
        """Refused requests told to come back and not due at ``now`` (those due are back, or gone)."""
        while self._returns and self._returns[0] <= now:
            heapq.heappop(self._returns)
        return len(self._returns)

    def retry_after_s(self, now: float, ahead: int, bound_s: float, limit: int) -> int | None:
        """A refusal's ``Retry-After`` (module doc) for a request behind ``ahead`` queued ones, under the
        bound ``bound_s`` (0: none) and the queue limit ``limit``; the request is counted as due back
        then. None before a pace is measured."""
        if self.interval_s is None:
            return None
        before = ahead + self.returns(now)  # the requests that start before it
        past_bound = (before + 1) * self.interval_s - bound_s if bound_s else 0.0
        past_limit = (before + 1 - limit) * self.interval_s
        wait = min(MAX_RETRY_AFTER_S, max(1, math.ceil(max(past_bound, past_limit) * (1 + RETRY_SLACK))))
        heapq.heappush(self._returns, now + wait)
        return wait


def refusal(estimate_s: float, ahead: int, pace: StartPace, bound_s: float, retry_after_s: int) -> DecodeFull:
    """The 429 of a request the estimate puts past the bound."""
    return DecodeFull(
        f"the decode would start this request in about {estimate_s:.1f} s ({ahead} queued ahead of it, one "
        f"starting every {pace.interval_s:.2f} s), past its bound --max-queue-wait-s={bound_s:g}; "
        f"retry after {retry_after_s} s",
        retry_after_s=retry_after_s,
    )


def expired(waited_s: float, bound_s: float, retry_after_s: float) -> QueueWaitExceeded:
    """The 429 of a request still queued after the bound."""
    return QueueWaitExceeded(
        f"the request waited {waited_s:.1f} s in the decode's queue without starting, past its bound "
        f"--max-queue-wait-s={bound_s:g}; retry later",
        retry_after_s=retry_after_s,
    )
