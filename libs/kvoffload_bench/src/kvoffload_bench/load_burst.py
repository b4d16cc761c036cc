"""``kvoffload bench load``'s burst case: many mixed requests sent at once, with no retry, as a new
user's first try does — does every request get an answer (its first token, or a 429 with
``Retry-After``) instead of waiting with no byte?

The requests (``kvoffload_bench.load``'s workload: prompts log-uniform in [10, ``max_prompt``]
tokens, ``max_tokens`` uniform in [1, ``max_tokens``]) leave at the same moment, every other one
streamed. A client waits at most
``client_timeout_s`` for its first byte (by default the larger of the decode's and the prefill's
``--max-queue-wait-s`` plus ``TIMEOUT_MARGIN_S``: the bound, and room for the service a request
gets before it starts — its prefill and pull). Each request ends as one of:

- ``ok``: answered (a stream's first token, or a whole JSON answer);
- ``rejected_429``: refused with 429 (its ``Retry-After`` kept in ``retry_after_s``; a 429 without
  one counts in ``retry_after_missing``);
- ``timed_out``: no byte within ``client_timeout_s`` — what the bound exists to prevent;
- ``failed``: any other error.

Reported with the decode's own counts (``queue_timeouts``, ``rejected_by_estimate``,
``start_interval_s``), the prefill's (``prefill_queue_timeouts``, ``prefill_rejected_by_estimate``,
``prefill_rejected_queue_full``; ``prefill_rate_tokens_per_s``, ``prefill_run_fixed_s`` and
``prefill_run_4k_s``, the fit its estimate uses) and ``first_answer_p50_s`` / ``first_answer_max_s``
(send to the first byte of the answer, whatever it was). The goals (``kvoffload_bench.load_report``):
``timed_out`` 0, ``failed`` 0 and at least one request answered — a burst whose every request got
a 5xx has nothing timed out. ``kvoffload_bench.load_polite`` sends such a burst again with clients
that retry after the ``Retry-After`` given (``one_try`` is the try both send).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import threading
import time
import urllib.error
import urllib.request

TIMEOUT_MARGIN_S = 60.0


def _one(url: str, prompt: list[int], max_tokens: int, stream: bool, start: threading.Event, timeout_s: float) -> dict:
    """One request sent once ``start`` is set (``one_try``)."""
    start.wait()
    return one_try(url, prompt, max_tokens, stream, timeout_s)


def one_try(url: str, prompt: list[int], max_tokens: int, stream: bool, timeout_s: float) -> dict:
    """One request: its outcome and the time to the first byte of its answer; a 429's ``Retry-After``
    as sent (``retry_after``) and in seconds (``retry_after_s``, None when absent or not a number)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read(1)  # a stream's first event, or the JSON answer's first byte
            first = time.perf_counter() - t0
            resp.read()
        return {"outcome": "ok", "first_s": first}
    except urllib.error.HTTPError as e:
        first = time.perf_counter() - t0
        e.read()
        if e.code == 429:
            hint = e.headers.get("Retry-After")
            seconds = float(hint) if hint is not None and hint.strip().replace(".", "", 1).isdigit() else None
            return {"outcome": "rejected_429", "first_s": first, "retry_after": hint, "retry_after_s": seconds}
        return {"outcome": "failed", "first_s": first, "error": f"HTTP {e.code}"}
    except TimeoutError:
        return {"outcome": "timed_out", "first_s": None}
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError | socket.timeout):
            return {"outcome": "timed_out", "first_s": None}
        return {"outcome": "failed", "first_s": None, "error": repr(e.reason)}


def client_timeout(bounds_s: tuple[float, float], client_timeout_s: float | None) -> float:
    """A client's wait for the first byte: ``client_timeout_s``, by default the larger bound plus
    ``TIMEOUT_MARGIN_S`` (module doc)."""
    return client_timeout_s if client_timeout_s is not None else max(bounds_s) + TIMEOUT_MARGIN_S


def burst(
    url: str, work: list[tuple[list[int], int]], bounds_s: tuple[float, float], client_timeout_s: float | None
) -> dict:
    """``work`` ((prompt, max_tokens) each; every other one streamed) at ``url`` at once (module doc);
    the (decode's, prefill's) bounds ``bounds_s`` name the default client timeout."""
    jobs = [(prompt, max_tokens, i % 2 == 0) for i, (prompt, max_tokens) in enumerate(work)]
    timeout_s = client_timeout(bounds_s, client_timeout_s)
    start = threading.Event()
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(_one, url, p, m, s, start, timeout_s) for p, m, s in jobs]
        time.sleep(0.5)  # every client thread is up and waiting
        start.set()
        recs = [f.result() for f in futures]
    firsts = sorted(r["first_s"] for r in recs if r["first_s"] is not None)
    count = {k: sum(r["outcome"] == k for r in recs) for k in ("ok", "rejected_429", "timed_out", "failed")}
    return {
        "requests": len(jobs),
        "streamed": sum(s for _, _, s in jobs),
        **count,
        "errors": sorted({r["error"] for r in recs if "error" in r})[:5],
        "retry_after_s": sorted({r["retry_after_s"] for r in recs if r.get("retry_after_s") is not None}),
        "retry_after_missing": sum(r["outcome"] == "rejected_429" and r["retry_after_s"] is None for r in recs),
        "client_timeout_s": timeout_s,
        "max_queue_wait_s": bounds_s[0],
        "prefill_max_queue_wait_s": bounds_s[1],
        "first_answer_p50_s": firsts[len(firsts) // 2] if firsts else None,
        "first_answer_max_s": firsts[-1] if firsts else None,
    }
