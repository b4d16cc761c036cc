"""The error each fault of the fault suite gives (``kvoffload_testing.fault_catalog.wrong_error``): not
"any 50x", but the fault's status and a message naming the service it hit, as the proxy and the
services phrase it; the runner counting a wrong one, and the status read from HTTP and from SSE; and
``bench faults`` on a fake stack not meeting its goal while a request is still open. No processes but
a local HTTP server."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload_testing.fault_tally import LEAK_KEYS, RunRecord, summarize


def _names() -> dict[str, tuple[str, ...]]:
    from kvoffload_testing.fault_catalog import peer_names
    from kvoffload_testing.stack import StackConfig

    return peer_names(
        StackConfig(
            model=Path("m"),
            log_dir=Path("l"),
            proxy_port=9000,
            prefill_ports=(8100,),
            decode_ports=(8200,),
            kv_port=20050,
        )
    )


# errors as the client records them (``_request``), phrased as the proxy and the services phrase them
PREFILL_DIED = (
    'HTTP 502: {"error": {"message": "prefiller http://127.0.0.1:8100 failed while sending the request: '
    'ServerDisconnectedError: Server disconnected", "type": "upstream_error", "code": 502}}'
)
PREFILL_QUIET = (
    'HTTP 502: {"error": {"message": "decoder http://127.0.0.1:8200 answered HTTP 502: {\\"error\\": '
    '{\\"message\\": \\"prefill 127.0.0.1:18100 sent no news for request cmpl-1 for 2 s\\"}}"}}'
)
DECODE_DIED = (
    "SSE error 502: decoder http://127.0.0.1:8200 failed while relaying the response: "
    "ClientPayloadError: Response payload is not completed"
)
DECODE_GONE = (
    'HTTP 502: {"error": {"message": "prefiller http://127.0.0.1:8100 answered HTTP 502: {\\"error\\": '
    '{\\"message\\": \\"prefill failed: request cmpl-2 stopped before layer 3: decode 127.0.0.1:20050 '
    'no longer waits for request cmpl-2\\"}}"}}'
)
UNRELATED_500 = 'HTTP 500: {"error": {"message": "internal proxy error: KeyError", "type": "proxy_error", "code": 500}}'
POOL_FULL = (
    'HTTP 502: {"error": {"message": "prefiller http://127.0.0.1:8100 answered HTTP 502: {\\"error\\": '
    '{\\"message\\": \\"prefill failed: host pool full: 128 block(s) needed, 16 free\\"}}"}}'
)


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("kill_prefill", PREFILL_DIED),
        ("kill_prefill", PREFILL_QUIET),
        ("stall_prefill_long", PREFILL_QUIET),
        ("kill_decode", DECODE_DIED),
        ("kill_decode", DECODE_GONE),
        ("stall_decode_long", DECODE_GONE),
        ("fill_host_pool", POOL_FULL),
        ("kill_proxy", "RemoteDisconnected: Remote end closed connection without response"),
        (
            "overfill_decode",
            'HTTP 429: {"error": {"message": "every decoder is at its queue limit (1 of 1 answered 429); '
            'retry after 1 s", "type": "rate_limit_error", "code": 429}}',
        ),
        (
            "kill_metastore",
            'HTTP 502: {"error": {"message": "prefiller http://127.0.0.1:8100 answered HTTP 502: '
            'prefill failed: MetaStore Exists: UNAVAILABLE: failed to connect to all addresses"}}',
        ),
    ],
)
def test_the_error_a_fault_gives_names_the_service_it_hit(fault, error):
    from kvoffload_testing.fault_catalog import wrong_error

    assert wrong_error(fault, error, _names()) == ""


@pytest.mark.parametrize(
    ("fault", "error", "why"),
    [
        ("kill_prefill", UNRELATED_500, "HTTP 502 or HTTP 503, not HTTP 500"),  # a 50x, but not the prefill's
        ("kill_prefill", DECODE_DIED, "does not name the prefill"),  # a 502 about something else
        ("stall_prefill_long", DECODE_DIED, "does not name the prefill"),
        ("kill_decode", PREFILL_DIED, "does not name the decode"),
        ("kill_metastore", PREFILL_DIED, "does not name the metastore"),
        ("fill_host_pool", PREFILL_DIED, "does not say 'host pool full'"),
        ("kill_proxy", DECODE_DIED, "gives no HTTP answer, not HTTP 502"),
        ("none", PREFILL_DIED, "must fail no request"),
        ("stall_decode_short", DECODE_DIED, "must fail no request"),
        ("kill_decode", "", "gives HTTP 502 or HTTP 503, not no HTTP answer"),  # a failure that says nothing
    ],
)
def test_any_50x_is_not_the_named_error(fault, error, why):
    from kvoffload_testing.fault_catalog import wrong_error

    assert why in wrong_error(fault, error, _names())


def test_every_fault_kind_says_which_error_it_gives():
    from kvoffload_testing.fault_catalog import EXPECTED_ERRORS, FAULTS, MOONCAKE_FAULTS

    assert set(FAULTS) | set(MOONCAKE_FAULTS) == set(EXPECTED_ERRORS)
    for fault, want in EXPECTED_ERRORS.items():
        assert all(s is None or 400 <= s < 600 for s in want.statuses), fault
        assert not want.statuses or want.peer in _names(), fault


class _FakeStack:
    cfg = None

    def __init__(self, pool: str = "kvoffload") -> None:
        from kvoffload_testing.stack import StackConfig

        self.cfg = StackConfig(
            model=Path("m"), log_dir=Path("l"), prefill_ports=(8100,), decode_ports=(8200,), kv_port=20050, pool=pool
        )
        self.url = "http://127.0.0.1:9000"

    def commands(self):
        return [(name, [], "") for name in ("metastore", "decode-0", "prefill-0", "proxy")]


def test_the_runner_counts_a_wrong_50x_as_a_wrong_error(monkeypatch):
    """A 500 with an unrelated message where killing the prefill gives a 502 naming it: before,
    any failure with some error passed; now the run counts it in ``wrong_errors``."""
    from kvoffload_testing import fault_tally, faults

    runner = faults.FaultRunner(_FakeStack(), reference=lambda prompt: [1, 2])
    records = []
    for error in (PREFILL_DIED, UNRELATED_500, DECODE_DIED):
        monkeypatch.setattr(faults, "_request", lambda *a, error=error: (False, [], error))
        rec = fault_tally.RequestRecord(24, False)
        runner._client([1] * 24, False, rec, "kill_prefill")
        records.append(rec)
    assert [bool(r.wrong_error) for r in records] == [False, True, True], records
    out = summarize([fault_tally.RunRecord(0, "kill_prefill", records, dict.fromkeys(LEAK_KEYS, 0.0), True)])
    assert out["failed_with_error"] == 3 and out["wrong_errors"] == 2, out


def test_a_failure_nobody_judged_counts_as_a_wrong_error():
    from kvoffload_testing.fault_tally import RequestRecord

    failed = RequestRecord(24, False, ok=False, ended=True, error=PREFILL_DIED)  # wrong_error left None
    run = RunRecord(0, "kill_prefill", [failed], dict.fromkeys(LEAK_KEYS, 0.0), True)
    assert summarize([run])["wrong_errors"] == 1


def test_errors_carry_their_status_from_http_and_from_sse():
    """``_request`` against a server answering 503 with a body, then 200 with an SSE error event."""
    import http.server
    import json
    import threading

    from kvoffload_testing.fault_catalog import error_status
    from kvoffload_testing.faults import _request

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            stream = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["stream"]
            if not stream:
                body = b'{"error": {"message": "no prefiller reachable", "code": 503}}'
                self.send_response(503)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(
                b'data: {"choices": [{"token_ids": [5]}]}\n\n'
                b'data: {"error": {"message": "decoder x reported an error: y", "code": 502}}\n\n'
                b"data: [DONE]\n\n"
            )

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        ok, _, error = _request(url, [1, 2], False, 10)
        assert not ok and error_status(error) == 503 and "no prefiller reachable" in error, error
        ok, tokens, error = _request(url, [1, 2], True, 10)
        assert not ok and tokens == [5] and error == "SSE error 502: decoder x reported an error: y", error
        assert error_status(error) == 502
    finally:
        server.shutdown()
        server.server_close()
    assert error_status("RemoteDisconnected: Remote end closed connection without response") is None


def test_bench_faults_is_not_met_while_a_request_is_still_open(monkeypatch):
    """``bench`` itself, its stack and runs faked: every figure clean but one request still open
    once idle (``open_requests_after`` 1) — the goal is not met."""
    import contextlib

    from kvoffload_testing import fault_catalog, fault_tally, faults

    class Runner:
        def __init__(self, stack, ref, seed):
            self.faults, self.seed, self.rng = fault_catalog.FAULTS, seed, faults.random.Random(seed)

        def run_one(self, i, fault):
            req = fault_tally.RequestRecord(24, False, ok=True, ended=True, seconds=0.1, tokens_equal=True)
            leaks = {**dict.fromkeys(LEAK_KEYS, 0.0), "open_requests": 1.0}
            return RunRecord(i, fault, [req], leaks, fresh_ok=True, open_at_injection=[0])

    import svcruntime.logs

    monkeypatch.setattr(svcruntime.logs, "quiet_logs", lambda: None)  # structlog's global configuration stays
    monkeypatch.setattr(faults, "ensure_tiny_model", lambda path: path)
    monkeypatch.setattr(faults, "reference_tokens", lambda model: lambda prompt: [1])
    monkeypatch.setattr(faults, "Stack", lambda cfg: contextlib.nullcontext(_FakeStack()))
    monkeypatch.setattr(faults, "FaultRunner", Runner)
    out = faults.bench(runs=2, progress=False)
    assert out["open_requests_after"] == 2 and out["goal_met"] is False, out
    monkeypatch.setattr(
        Runner,
        "run_one",
        lambda self, i, fault: RunRecord(
            i,
            fault,
            [fault_tally.RequestRecord(24, False, ok=True, ended=True, tokens_equal=True)],
            dict.fromkeys(LEAK_KEYS, 0.0),
            fresh_ok=True,
            open_at_injection=[0],  # the fault met the request in flight
        ),
    )
    assert faults.bench(runs=2, progress=False)["goal_met"] is True
