"""``kvoffload bench load``'s polite burst (``burst_polite``): the burst case's requests sent at once,
each client retrying a 429 after its ``Retry-After`` as OpenAI's Python client does — how many tries
does a request take when every client follows the hint?

A client's pause before a retry (``retry_delay_s``) is OpenAI's Python client's (``openai`` 3.x,
``_calculate_retry_timeout`` and ``_should_retry``): a ``Retry-After`` in (0, ``MAX_RETRY_AFTER_S``]
seconds is followed as given; one past it is not retried (the request fails); without one, an
exponential backoff from ``INITIAL_RETRY_DELAY_S`` up to ``MAX_RETRY_DELAY_S``, less up to 25 %
jitter. Unlike that client's default of 2 retries, the cap here is generous (``MAX_RETRIES``): the
count of retries is the figure, not the cap. Only a 429 is retried; any other error, or a client
timeout (``client_timeout_s`` for the first byte of each try, as in the burst), fails the request —
the stack owes every request an answer within its bounds.

Reported: ``requests``, ``streamed``, ``ok`` (answered: the first token of a stream, or the whole
JSON answer), ``failed`` (anything else, timed out included), ``timed_out``, ``retries`` (429s
retried), ``retries_per_request`` (``retries`` over ``requests``), ``rejected_429`` (every 429
answer), ``not_followed`` (429s without a ``Retry-After`` the client follows), ``retry_after_s``
(the distinct hints given), ``max_retries``, ``answer_p50_s`` / ``answer_max_s`` (a request's first
send to its answer's first byte, its waits included) and ``wall_s`` (the burst's send to its last
answer). Goals (``kvoffload_bench.load``): ``retries_per_request`` <= ``GOAL_RETRIES_PER_REQUEST``,
every request answered, none failed.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
import time

from kvoffload_bench.load_burst import one_try

MAX_RETRY_AFTER_S = 120.0  # openai 3.x: a longer Retry-After is not retried (1.x: 60 s, then backoff)
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
MAX_RETRIES = 20  # generous: openai's default is 2
GOAL_RETRIES_PER_REQUEST = 3.0


def retry_delay_s(retry_after: str | None, retries_done: int, rng: random.Random) -> float | None:
    """The pause before the next try after a 429 whose ``Retry-After`` header is ``retry_after``
    (after ``retries_done`` retries), as OpenAI's Python client computes it; None: it does not retry."""
    try:
        hint = float(retry_after) if retry_after is not None else None
    except ValueError:
        hint = None
    if hint is not None and hint > MAX_RETRY_AFTER_S:
        return None
    if hint is not None and hint > 0:
        return hint
    return min(INITIAL_RETRY_DELAY_S * 2.0**retries_done, MAX_RETRY_DELAY_S) * (1 - 0.25 * rng.random())


def _client(
    url: str, prompt: list[int], max_tokens: int, stream: bool, start: threading.Event, timeout_s: float, seed: int
) -> dict:
    """One polite client: tries until answered, refused past its cap, or failed."""
    rng = random.Random(seed)
    start.wait()
    t0 = time.perf_counter()
    rec: dict = {"outcome": "failed", "retries": 0, "rejected": 0, "not_followed": 0, "hints": set()}
    while True:
        got = one_try(url, prompt, max_tokens, stream, timeout_s)
        if got["outcome"] != "rejected_429":
            rec["outcome"] = got["outcome"]
            if "error" in got:
                rec["error"] = got["error"]
            if got["first_s"] is not None:
                rec["answer_s"] = time.perf_counter() - t0
            return rec
        rec["rejected"] += 1
        if got["retry_after_s"] is not None:
            rec["hints"].add(got["retry_after_s"])
        delay = retry_delay_s(got["retry_after"], rec["retries"], rng)
        if delay is None or got["retry_after_s"] is None or got["retry_after_s"] <= 0:
            rec["not_followed"] += 1
        if delay is None or rec["retries"] >= MAX_RETRIES:
            rec["error"] = f"429 after {rec['retries']} retries (Retry-After {got['retry_after']})"
            return rec
        rec["retries"] += 1
        time.sleep(delay)


def polite_burst(url: str, work: list[tuple[list[int], int]], client_timeout_s: float) -> dict:
    """``work`` ((prompt, max_tokens) each; every other one streamed) at ``url`` at once, each client
    polite (module doc)."""
    jobs = [(prompt, max_tokens, i % 2 == 0) for i, (prompt, max_tokens) in enumerate(work)]
    start = threading.Event()
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [
            pool.submit(_client, url, p, m, s, start, client_timeout_s, seed) for seed, (p, m, s) in enumerate(jobs)
        ]
        time.sleep(0.5)  # every client thread is up and waiting
        t0 = time.perf_counter()
        start.set()
        recs = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    return summary(recs, sum(s for _, _, s in jobs), client_timeout_s, wall)


def summary(recs: list[dict], streamed: int, client_timeout_s: float, wall_s: float) -> dict:
    """The polite burst's figures (module doc) from its clients' records."""
    answers = sorted(r["answer_s"] for r in recs if r["outcome"] == "ok")
    retries = sum(r["retries"] for r in recs)
    return {
        "requests": len(recs),
        "streamed": streamed,
        "ok": sum(r["outcome"] == "ok" for r in recs),
        "failed": sum(r["outcome"] != "ok" for r in recs),
        "timed_out": sum(r["outcome"] == "timed_out" for r in recs),
        "retries": retries,
        "retries_per_request": retries / len(recs) if recs else None,
        "rejected_429": sum(r["rejected"] for r in recs),
        "not_followed": sum(r["not_followed"] for r in recs),
        "retry_after_s": sorted({h for r in recs for h in r["hints"]}),
        "max_retries": MAX_RETRIES,
        "client_timeout_s": client_timeout_s,
        "answer_p50_s": answers[len(answers) // 2] if answers else None,
        "answer_max_s": answers[-1] if answers else None,
        "wall_s": wall_s,
        "errors": sorted({r["error"] for r in recs if "error" in r})[:5],
    }
