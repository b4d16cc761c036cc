"""Faults and waits on the vLLM servers of a P/D test (``test_vllm_pd``): a request in flight on a
thread of its own, a server stopped and resumed over and over, the wait until a server is idle, and
the reuse gate's waits a prefill logged."""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
from collections.abc import Iterator

from vllm_support import completion

from kvoffload_testing.prom import scrape
from svcruntime.processgroup import signal_group


def in_flight(url: str, body: list[int], outcome: dict) -> threading.Thread:
    """``body`` sent to ``url`` on a thread of its own (started): ``outcome`` gets its answer or error, and when."""

    def client() -> None:
        try:
            outcome["answer"] = completion(url, body, 8, timeout_s=180)["choices"][0]["text"]
        except Exception as exc:  # noqa: BLE001 - the error is an outcome under test
            outcome["error"] = str(exc)
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=client)
    thread.start()
    return thread


def idle(url: str, within_s: float) -> float:
    """Seconds until the server at ``url`` runs no request and holds no KV block (AssertionError past
    ``within_s``)."""
    t0 = time.monotonic()
    while True:
        m = scrape(url)
        if m.total("vllm:num_requests_running") == 0 and m.total("vllm:kv_cache_usage_perc") == 0:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, f"{url} still holds requests or KV"
        time.sleep(0.2)


def gate_waits(prefill_log: str) -> list[float]:
    """The seconds each of the prefill's shared-buffer steps waited at the reuse gate, from its log."""
    return [float(w) for w in re.findall(r"kvoffload_shared_step\b.*?gate_wait_s=([\d.]+)", prefill_log)]


@contextlib.contextmanager
def slowed(proc, stopped_s: float, running_s: float) -> Iterator[None]:
    """``proc`` stopped ``stopped_s``, run ``running_s``, over and over while the block runs."""
    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            signal_group(proc, signal.SIGSTOP, 0)
            time.sleep(stopped_s)
            signal_group(proc, signal.SIGCONT, 0)
            time.sleep(running_s)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        signal_group(proc, signal.SIGCONT, 0)
