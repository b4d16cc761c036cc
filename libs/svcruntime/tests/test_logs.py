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
