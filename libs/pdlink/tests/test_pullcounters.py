"""``pdlink.pullcounters.PullCounters``: the names every consumer's Stats and /metrics read, exact
sums under many threads, snapshots that never tear, ``take`` for readers of the sums since the last
report."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdlink.pullcounters import COUNTERS, PullCounters

STATS_KEYS = {
    "read_done",
    "read_failed",
    "read_retries",
    "bytes_read",
    "read_ms_total",
    "reads_shared_memory",
    "reads_streamed",
    "reads_engine",
    "heartbeats",
}  # what Stats, /metrics and the kvoffload tools read


def test_counters_have_the_names_stats_and_metrics_read():
    assert set(COUNTERS) == STATS_KEYS
    assert PullCounters().snapshot() == dict.fromkeys(STATS_KEYS, 0)


def test_a_pull_counts_its_bytes_for_the_prefill_tp_rank_it_read_from():
    c = PullCounters()
    c.add_read(1, 300, 2.0)
    c.add_read(0, 100, 1.0)
    c.add_read(1, 5, 0.5)
    assert c.snapshot() == {
        **dict.fromkeys(STATS_KEYS, 0),
        "read_done": 3,
        "bytes_read": 405,
        "read_ms_total": 3.5,
        "bytes_read_prefill_tp_rank_0": 100,
        "bytes_read_prefill_tp_rank_1": 305,
    }


def test_counters_are_exact_under_16_threads():
    c = PullCounters()
    threads, per_thread = 16, 10_000
    start = threading.Barrier(threads)

    def work(i: int) -> None:
        start.wait()
        for _ in range(per_thread):
            c.increment("read_done")
            c.add(bytes_read=3, read_ms_total=0.5)
            if i % 2:
                c.increment("heartbeats")

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(work, range(threads)))
    snap = c.snapshot()
    assert snap["read_done"] == threads * per_thread
    assert snap["bytes_read"] == 3 * threads * per_thread
    assert snap["read_ms_total"] == 0.5 * threads * per_thread
    assert snap["heartbeats"] == threads // 2 * per_thread
    assert snap["read_failed"] == snap["read_retries"] == 0


def test_a_snapshot_never_shows_half_of_an_add():
    """``add`` of several counters is one step: a reader sees bytes_read == 7 * read_done always
    (the metrics' average read_ms_total / read_done relies on the same)."""
    c = PullCounters()
    stop = threading.Event()
    torn: list[dict] = []

    def writer() -> None:
        while not stop.is_set():
            c.add(read_done=1, bytes_read=7)

    def reader() -> None:
        for _ in range(20_000):
            s = c.snapshot()
            if s["bytes_read"] != 7 * s["read_done"]:
                torn.append(s)

    writers = [threading.Thread(target=writer) for _ in range(4)]
    for t in writers:
        t.start()
    try:
        reader()
    finally:
        stop.set()
        for t in writers:
            t.join()
    assert not torn, torn[:3]
    assert c.snapshot()["read_done"] > 0


def test_a_snapshot_is_a_copy():
    c = PullCounters()
    c.add(read_done=2, bytes_read=10)
    snap = c.snapshot()
    snap["read_done"] = 99
    snap["made_up"] = 1
    assert c.snapshot() == {**dict.fromkeys(STATS_KEYS, 0), "read_done": 2, "bytes_read": 10}
    c.increment("read_done")
    assert snap["read_done"] == 99  # the earlier snapshot does not follow


def test_an_unknown_counter_is_refused_and_nothing_is_added():
    c = PullCounters()
    with pytest.raises(KeyError, match="reads_done"):
        c.add(read_done=1, reads_done=1)  # a typo anywhere adds nothing
    with pytest.raises(KeyError):
        c.increment("nope")
    assert c.snapshot() == dict.fromkeys(STATS_KEYS, 0)


def test_take_returns_the_sums_since_the_last_take_and_starts_again_at_zero():
    c = PullCounters()
    c.add_read(0, 100, 1.5)
    c.increment("heartbeats")
    assert c.take() == {
        **dict.fromkeys(STATS_KEYS, 0),
        "read_done": 1,
        "bytes_read": 100,
        "read_ms_total": 1.5,
        "heartbeats": 1,
        "bytes_read_prefill_tp_rank_0": 100,
    }
    assert c.take() == dict.fromkeys(STATS_KEYS, 0)
    c.add_read(2, 7, 0.25)
    assert c.take() == {
        **dict.fromkeys(STATS_KEYS, 0),
        "read_done": 1,
        "bytes_read": 7,
        "read_ms_total": 0.25,
        "bytes_read_prefill_tp_rank_2": 7,
    }
