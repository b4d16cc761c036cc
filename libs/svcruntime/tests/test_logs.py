import io
import json

import structlog

from svcruntime.logs import REQUEST_IDS, configure_logging


def test_linked_wire_ids_log_under_the_proxy_request_id(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)  # configure_logging prints to the stderr of its call
    configure_logging("svc")
    log = structlog.get_logger("t")
    REQUEST_IDS.link("cmpl-1-0", "trace-abc")
    REQUEST_IDS.link("same", "same")  # nothing to rewrite
    try:
        log.info("a", request_id="cmpl-1-0")
        log.info("b", request_id="same")
        log.info("c", request_id="other")
        REQUEST_IDS.unlink("cmpl-1-0")
        log.info("d", request_id="cmpl-1-0")
    finally:
        REQUEST_IDS.unlink("cmpl-1-0")
        REQUEST_IDS.unlink("same")
        structlog.reset_defaults()  # later tests must not print into this test's buffer
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    got = [(e["event"], e["request_id"], e.get("child_id")) for e in lines]
    assert got == [("a", "trace-abc", "cmpl-1-0"), ("b", "same", None), ("c", "other", None), ("d", "cmpl-1-0", None)]
    assert all(e["service"] == "svc" for e in lines)


def test_lines_from_many_threads_and_both_loggers_stay_whole(monkeypatch):
    """structlog loggers and stdlib loggers (e.g. aiohttp's access log) writing at once from many
    threads: every line is one JSON object (a line written as text, then newline, by one thread
    could get another thread's line in between)."""
    import logging
    import threading

    class SlowStream(io.StringIO):  # a write that lets other threads run, like a real stream's flush
        def write(self, text: str) -> int:
            n = super().write(text)
            threading.Event().wait(0.0001)
            return n

    out = SlowStream()
    monkeypatch.setattr("sys.stderr", out)
    configure_logging("svc")
    slog, plain = structlog.get_logger("t"), logging.getLogger("t.access")
    start = threading.Barrier(8)

    def work(i: int) -> None:
        start.wait()
        for j in range(100):
            if i % 2:
                slog.info("s", thread=i, n=j)
            else:
                plain.info("p %d %d", i, j)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers[:] = []
    lines = out.getvalue().splitlines()
    assert len(lines) == 800
    events = [json.loads(x) for x in lines]
    assert sum(e["event"] == "s" for e in events) == 400
