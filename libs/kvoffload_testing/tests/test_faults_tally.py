"""The fault suite's leak tally (``kvoffload_testing.fault_tally.held`` / ``summarize``) on hand-made Stats: no
processes. A counter the tally needs that a service does not report (renamed, dropped) must be an
error naming the service, the key and the keys present, never a silent 0 that makes every leak
check pass.

Also the error each fault gives (``wrong_error``): not "any 50x", but the fault's status and a
message naming the service it hit, as the proxy and the services phrase it; and the goal of
``bench faults`` (``goal_met``): every figure it reads present, ``open_requests_after`` among them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload_testing.fault_tally import LEAK_KEYS, REQUIRED_STATS, MissingStatsKey, RunRecord, held, summarize


def _idle() -> dict[str, dict[str, float]]:
    """Stats of an idle one-prefill, one-decode stack, with the keys the services' GetStats report
    (prefill: kvcore.gates + ledger + pool; decode: loop + ledger + transfer + pool; metastore:
    stats_counters) — the tally reads some of them, the others are there as in real replies."""
    return {
        "metastore": {
            "pools": 1.0,
            "world_size": 1.0,
            "objects": 3.0,
            "complete_objects": 3.0,
            "live_leases": 0.0,
            "lease_expiries_total": 0.0,
            "used_bytes": 4096.0,
        },
        "prefill-0": {
            "slots": 3.0,
            "held_slots": 0.0,
            "acquires": 12.0,
            "ledger_open": 0.0,
            "ledger_finished_ok": 2.0,
            "device_kv_bytes": 0.0,
            "pool_available": 1.0,
            "pool_used_bytes": 4096.0,
            "pool_used_blocks": 1.0,
            "pool_live_leases": 0.0,
            "pool_complete_objects": 3.0,
        },
        "decode-0": {
            "pending": 0.0,
            "running": 0.0,
            "sequences": 0.0,
            "ledger_open": 0.0,
            "ledger_finished_ok": 2.0,
            "read_done": 4.0,
            "pool_used_bytes": 0.0,
            "pool_used_blocks": 0.0,
            "pool_live_leases": 0.0,
        },
    }


def test_an_idle_stack_holds_nothing():
    assert held(_idle()) == dict.fromkeys(LEAK_KEYS, 0.0)


def test_every_held_counter_is_counted():
    stats = _idle()
    stats["prefill-0"].update(held_slots=2, pool_live_leases=3, ledger_open=1)
    stats["decode-0"].update(pool_used_bytes=512, pool_live_leases=1, sequences=1, ledger_open=2)
    stats["metastore"]["live_leases"] = 4
    assert held(stats) == {
        "leaked_slots": 2,
        "leaked_pool_bytes": 512,
        "leaked_leases": 3 + 1 + 4,
        "open_requests": 1 + 1 + 2,
    }


def test_every_prefill_and_decode_is_counted():
    stats = _idle()
    stats["prefill-1"] = {**stats["prefill-0"], "held_slots": 1.0}
    stats["decode-1"] = {**stats["decode-0"], "pool_used_bytes": 64.0}
    assert held(stats)["leaked_slots"] == 1 and held(stats)["leaked_pool_bytes"] == 64


@pytest.mark.parametrize(
    ("service", "key"),
    [
        (s, k)
        for kind, keys in REQUIRED_STATS.items()
        for s in [kind if kind == "metastore" else f"{kind}-0"]
        for k in keys
    ],
)
def test_a_missing_counter_is_an_error_not_a_zero(service, key):
    stats = _idle()
    del stats[service][key]
    with pytest.raises(MissingStatsKey) as err:
        held(stats)
    msg = str(err.value)
    assert service in msg and repr(key) in msg, msg
    for present in stats[service]:  # the keys that were there, so a rename is easy to spot
        assert present in msg, msg


def test_the_required_keys_are_the_ones_the_tally_reads():
    """Pinned, so that a key dropped from REQUIRED_STATS (read with a default again) shows here."""
    assert REQUIRED_STATS == {
        "prefill": ("held_slots", "ledger_open", "pool_available"),
        "decode": ("pool_used_bytes", "pool_live_leases", "sequences", "ledger_open"),
        "metastore": ("live_leases",),
    }


def test_a_renamed_held_slots_is_an_error():
    stats = _idle()
    stats["prefill-0"]["slots_held"] = stats["prefill-0"].pop("held_slots")
    with pytest.raises(MissingStatsKey, match=r"prefill-0.*'held_slots'.*slots_held"):
        held(stats)


def test_the_prefill_pool_counters_are_required_while_its_pool_answers():
    stats = _idle()
    del stats["prefill-0"]["pool_live_leases"]
    with pytest.raises(MissingStatsKey, match=r"prefill-0.*'pool_live_leases'"):
        held(stats)


def test_an_unavailable_prefill_pool_counts_as_open_without_its_counters():
    """The prefill's Stats carry no pool counters while its pool does not answer: that is open,
    not idle (and not an error)."""
    stats = _idle()
    stats["prefill-0"] = {k: v for k, v in stats["prefill-0"].items() if not k.startswith("pool_")}
    stats["prefill-0"]["pool_available"] = 0.0
    assert held(stats)["open_requests"] == 1


def test_stats_without_the_metastore_or_of_an_unknown_service_are_errors():
    stats = _idle()
    del stats["metastore"]
    with pytest.raises(MissingStatsKey, match="metastore"):
        held(stats)
    with pytest.raises(MissingStatsKey, match="no Stats of the metastore"):
        held({})
    stats = _idle()
    stats["proxy"] = {"requests": 1.0}
    with pytest.raises(MissingStatsKey, match="'proxy'"):
        held(stats)


def test_the_required_counters_exist_in_what_the_metastore_and_the_gates_report():
    """The metastore's Stats counters and the prefill's slot-gate counters, built by their own code."""
    from kvcore.gates import GateSet
    from kvoffload_metastore.metrics import stats_counters
    from kvoffload_metastore.records import MetaStats

    meta = stats_counters(
        MetaStats(
            pools=[],
            world_size=1,
            lease_ttl_ms=1,
            heartbeat_timeout_ms=1,
            dram_bytes_per_local_service=0,
            live_leases=0,
            lease_expiries=0,
            leases_dropped=0,
            evictions=0,
            pools_expired=0,
        ),
        {},
    )
    assert set(REQUIRED_STATS["metastore"]) <= set(meta), sorted(meta)
    assert "held_slots" in GateSet({0: 0}).stats()


def _run(leaks: dict[str, float]) -> RunRecord:
    return RunRecord(run=0, fault="none", leaks=leaks, fresh_ok=True)


def test_summarize_sums_every_run_and_needs_every_leak_key():
    a, b = held(_idle()), {**held(_idle()), "leaked_slots": 1.0, "leaked_leases": 2.0}
    out = summarize([_run(a), _run(b)])
    assert (
        out["leaked_slots"],
        out["leaked_pool_bytes"],
        out["leaked_leases"],
        out["open_requests_after"],
        out["stats_unreadable"],
    ) == (1, 0, 2, 0, 0)
    broken = dict(a)
    del broken["leaked_slots"]
    with pytest.raises(MissingStatsKey, match="leaked_slots"):
        summarize([_run(a), _run(broken)])


def test_summarize_counts_unreadable_stats_as_not_idle():
    out = summarize([_run(held(_idle())), _run({"stats_error": 1.0})])
    assert out["stats_unreadable"] == 1 and out["open_requests_after"] == 1


def test_a_stack_on_mooncake_store_has_no_metastore_but_needs_its_prefill_and_decode():
    stats = _idle()
    del stats["metastore"]
    assert held(stats, pool="mooncake") == dict.fromkeys(LEAK_KEYS, 0.0)
    for gone in ("prefill-0", "decode-0"):
        with pytest.raises(MissingStatsKey, match="a prefill and a decode"):
            held({k: v for k, v in stats.items() if k != gone}, pool="mooncake")
    stats["decode-0"]["pool_used_bytes"] = 64.0
    assert held(stats, pool="mooncake")["leaked_pool_bytes"] == 64


def test_summarize_counts_the_runs_of_each_fault_of_the_stack():
    from kvoffload_testing.fault_catalog import MOONCAKE_FAULTS

    runs = [RunRecord(0, "kill_mooncake_master", leaks=dict.fromkeys(LEAK_KEYS, 0.0), fresh_ok=True)]
    assert summarize(runs, MOONCAKE_FAULTS)["faults"] == {f: int(f == "kill_mooncake_master") for f in MOONCAKE_FAULTS}
    with pytest.raises(ValueError, match="kill_mooncake_master"):
        summarize(runs)  # not a fault of the default stack


# ---- the error each fault gives -------------------------------------------------------------------


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


# ---- the goal of bench faults ---------------------------------------------------------------------


def _summary(**figures) -> dict:
    out = summarize([_run(held(_idle()))])
    out.update({"requests": 1, "terminated": 1, **figures})
    return out


def test_the_goal_needs_every_figure_at_zero_open_requests_after_too():
    from kvoffload_testing.fault_tally import GOAL_ZERO, goal_met

    assert goal_met(_summary())
    assert "open_requests_after" in GOAL_ZERO and "wrong_errors" in GOAL_ZERO
    for key in GOAL_ZERO:
        assert not goal_met(_summary(**{key: 1})), key
    assert not goal_met(_summary(terminated=0))
    assert not goal_met(_summary(runs=0, requests=0, terminated=0))  # nothing measured: no goal met


def test_a_figure_the_goal_reads_that_is_missing_is_an_error_not_a_pass():
    from kvoffload_testing.fault_tally import GOAL_ZERO, MissingFigure, goal_met

    for key in ("runs", "requests", "terminated", *GOAL_ZERO):
        summary = _summary()
        del summary[key]
        with pytest.raises(MissingFigure, match=key):
            goal_met(summary)


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
            return RunRecord(i, fault, [req], leaks, fresh_ok=True)

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
        ),
    )
    assert faults.bench(runs=2, progress=False)["goal_met"] is True
