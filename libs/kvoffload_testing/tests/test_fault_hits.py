"""Faults that provably hit (``kvoffload_testing.faults`` / ``fault_tally``): which requests were open
when a fault went in, as their clients saw them (``open_at``: sent, not yet answered); a run whose
fault met none is a missed fault (``missed_faults``, a goal of 0 in ``bench faults``); a run whose
requests all ended before the fault's moment sends the longest prompt and injects once it is sent;
the client's ``on_sent`` fires once a request is written, before its answer, and never for one that
could not be sent; ``run_many``'s time budget. The runner on a fake stack: no processes but a local
HTTP server."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest

from kvoffload_testing.fault_tally import LEAK_KEYS, RequestRecord, RunRecord, goals_met, open_at, summarize


def _req(sent_s: float | None, done_s: float | None) -> RequestRecord:
    return RequestRecord(24, False, ok=True, ended=True, tokens_equal=True, sent_s=sent_s, done_s=done_s)


def test_a_request_is_open_from_its_send_until_its_answer():
    reqs = [
        _req(0.1, 0.4),  # answered before the fault
        _req(0.1, 0.9),  # in flight at 0.5
        _req(0.6, 0.9),  # sent after the fault
        _req(None, 0.2),  # never sent (the connection was refused)
        _req(0.2, None),  # sent, never answered
    ]
    assert open_at(reqs, 0.5) == [1, 4]
    assert open_at(reqs, 0.4) == [1, 4]  # answered at 0.4: not open at 0.4
    assert open_at(reqs, 0.05) == []


def _run(fault: str, open_at_injection: list[int] | None) -> RunRecord:
    return RunRecord(
        0, fault, [_req(0.1, 0.2)], dict.fromkeys(LEAK_KEYS, 0.0), fresh_ok=True, open_at_injection=open_at_injection
    )


def test_a_run_whose_fault_met_no_open_request_is_a_missed_fault():
    assert summarize([_run("kill_decode", [0])])["missed_faults"] == 0
    hit_nothing = summarize([_run("kill_decode", [0]), _run("kill_prefill", []), _run("stall_decode_long", [])])
    assert hit_nothing["missed_faults"] == 2
    goals = goals_met(hit_nothing)
    assert goals["missed_faults"] is False and not all(goals.values())
    assert all(v for k, v in goals.items() if k != "missed_faults"), goals  # nothing else is wrong
    # not recorded is not a hit; a run of fault "none" injects nothing, so it cannot miss
    assert summarize([_run("kill_decode", None)])["missed_faults"] == 1
    assert summarize([_run("none", [])])["missed_faults"] == 0


# ---- the client: when a request counts as sent ----------------------------------------------------


def test_on_sent_fires_once_the_request_is_written_before_its_answer_and_never_unsent():
    from kvoffload_testing.faults import _request

    release, received = threading.Event(), []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            release.wait(10)  # the answer waits until the test has seen on_sent
            body = b'{"choices": [{"token_ids": [7, 8]}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    sent, got = threading.Event(), {}
    client = threading.Thread(target=lambda: got.update(out=_request(url, [1, 2], False, 10, 6, sent.set)))
    try:
        client.start()
        assert sent.wait(10), "on_sent never fired"
        assert "out" not in got  # sent, not answered: open
        release.set()
        client.join(10)
        assert got["out"] == (True, [7, 8], "") and received[0]["prompt"] == [1, 2]
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    calls = []
    ok, _, error = _request(url, [1], False, 5, 6, lambda: calls.append(1))  # the server is gone
    assert not ok and "Connection refused" in error and calls == [], error


# ---- the runner: the fault goes in while a request is open ----------------------------------------


class _FakeStack:
    def __init__(self) -> None:
        from kvoffload_testing.stack import StackConfig

        self.cfg = StackConfig(
            model=Path("m"), log_dir=Path("l"), prefill_ports=(8100,), decode_ports=(8200,), kv_port=20050
        )
        self.url = "http://127.0.0.1:9000"

    def commands(self):
        return [(name, [], "") for name in ("metastore", "decode-0", "prefill-0", "proxy")]


def _runner(monkeypatch, answer_after_injection, refused=lambda prompt, prompts: False):
    """A runner whose requests are sent at once and answered [1, 2] either at once or, when
    ``answer_after_injection(prompt, runner.prompts)``, once the fault went in (``runner.injected``);
    when ``refused(prompt, runner.prompts)``, never sent (its connection refused)."""
    from kvoffload_testing import faults

    runner = faults.FaultRunner(_FakeStack(), reference=lambda prompt: [1, 2], seed=3)
    runner.injected = threading.Event()

    def request(url, prompt, stream, deadline_s, max_tokens=6, on_sent=None):
        if on_sent is None:  # the run's fresh request, after the fault
            return True, [1, 2], ""
        if refused(prompt, runner.prompts):
            return False, [], "URLError: <urlopen error [Errno 111] Connection refused>"
        on_sent()
        if answer_after_injection(prompt, runner.prompts):
            assert runner.injected.wait(10)
        return True, [1, 2], ""

    monkeypatch.setattr(faults, "_request", request)
    monkeypatch.setattr(runner, "_inject", lambda fault: runner.injected.set())
    monkeypatch.setattr(runner, "_recover", lambda: None)
    monkeypatch.setattr(runner, "_wait_idle", lambda: dict.fromkeys(LEAK_KEYS, 0.0))
    monkeypatch.setattr(runner, "_draw", lambda fault: [(runner.prompts[0], False), (runner.prompts[1], True)])
    return runner


def test_a_run_whose_requests_all_ended_sends_the_longest_prompt_and_injects_while_it_is_open(monkeypatch):
    runner = _runner(monkeypatch, lambda prompt, prompts: prompt == prompts[-1])  # only the longest waits
    longest = len(runner.prompts[-1])
    rec = runner.run_one(0, "kill_decode")
    assert [r.prompt_tokens for r in rec.requests] == [*map(len, runner.prompts[:2]), longest]
    assert rec.open_at_injection == [2], rec  # the longest prompt, sent and not answered at the fault
    assert rec.requests[2].sent_s <= rec.injected_s < rec.requests[2].done_s
    assert all(r.done_s <= rec.injected_s for r in rec.requests[:2])  # the drawn ones had ended
    assert summarize([rec])["missed_faults"] == 0 and rec.fresh_ok


def test_a_run_whose_requests_all_ended_before_the_injection_is_a_missed_fault(monkeypatch):
    """The drawn requests answered before the fault's moment and the longest prompt could not be sent:
    the fault went in with no request open, touched nothing, and the tally says so (before, such a
    run passed as a fault survived)."""
    runner = _runner(monkeypatch, lambda prompt, prompts: False, refused=lambda prompt, prompts: prompt == prompts[-1])
    rec = runner.run_one(0, "kill_prefill")
    assert len(rec.requests) == 3 and rec.requests[2].sent_s is None  # the longer prompt was tried
    assert all(r.done_s <= rec.injected_s for r in rec.requests)
    assert rec.open_at_injection == [], rec
    out = summarize([rec])
    assert out["missed_faults"] == 1 and goals_met(out)["missed_faults"] is False


def test_a_request_in_flight_at_the_drawn_moment_is_hit_without_another_prompt(monkeypatch):
    from kvoffload_testing.faults import INJECT_AFTER_S

    runner = _runner(monkeypatch, lambda prompt, prompts: prompt == prompts[1])  # the 700-token one waits
    rec = runner.run_one(0, "stall_decode_long")
    assert [r.prompt_tokens for r in rec.requests] == [*map(len, runner.prompts[:2])], rec  # no other prompt
    assert rec.open_at_injection == [1], rec
    first_sent = min(r.sent_s for r in rec.requests)
    assert rec.injected_s >= first_sent + INJECT_AFTER_S[0]  # at the drawn moment, not at once


def test_a_run_none_of_whose_requests_could_be_sent_is_a_missed_fault(monkeypatch):
    """Every connection refused: nothing was ever sent (the wait for a first send ends when all have
    ended), so the fault met no request."""
    runner = _runner(monkeypatch, lambda prompt, prompts: False, refused=lambda prompt, prompts: True)
    rec = runner.run_one(0, "kill_decode")
    assert rec.open_at_injection == [] and all(r.sent_s is None for r in rec.requests)
    assert summarize([rec])["missed_faults"] == 1


# ---- bench faults and the time budget --------------------------------------------------------------


def test_bench_faults_reports_missed_faults_and_fails_its_goal(monkeypatch):
    import contextlib

    import svcruntime.logs
    from kvoffload_testing import fault_catalog, faults

    class Runner:
        def __init__(self, stack, ref, seed):
            self.faults, self.seed, self.rng = fault_catalog.FAULTS, seed, faults.random.Random(seed)

        def run_one(self, i, fault):  # every fault but one met its request in flight
            return _run(fault, [] if i == 1 else [0])

    monkeypatch.setattr(svcruntime.logs, "quiet_logs", lambda: None)
    monkeypatch.setattr(faults, "ensure_tiny_model", lambda path: path)
    monkeypatch.setattr(faults, "reference_tokens", lambda model: lambda prompt: [1])
    monkeypatch.setattr(faults, "Stack", lambda cfg: contextlib.nullcontext(_FakeStack()))
    monkeypatch.setattr(faults, "FaultRunner", Runner)
    out = faults.bench(runs=3, progress=False)
    assert out["missed_faults"] == 1, out
    assert out["goals_met"]["missed_faults"] is False and out["goal_met"] is False, out
    assert [k for k, v in out["goals_met"].items() if not v] == ["missed_faults"], out


def test_run_many_stops_at_its_time_budget_and_says_how_far_it_got(monkeypatch):
    """No run starts once the time spent plus the longest run so far passes the budget."""
    from kvoffload_testing import faults

    said: list[str] = []
    runner = faults.FaultRunner(_FakeStack(), reference=lambda prompt: [1], log=said.append)
    monkeypatch.setattr(  # run i took 10 * (i + 1) s: the fourth would start with 30 s > 25 s to go
        runner, "run_one", lambda i, fault: RunRecord(i, fault, seconds=10.0 * (i + 1), open_at_injection=[0])
    )
    records = runner.run_many(5, ["none"] * 5, budget_s=25.0)
    assert [r.run for r in records] == [0, 1, 2]
    assert said[-1] == "the time budget of 25 s ends after 3 of 5 runs", said
    assert len(runner.run_many(5, ["none"] * 5)) == 5  # no budget: every run


def test_the_goal_cannot_be_judged_without_missed_faults():
    from kvoffload_testing.fault_tally import MissingFigure, goal_met

    out = summarize([_run("kill_decode", [0])])
    assert goal_met(out)
    del out["missed_faults"]
    with pytest.raises(MissingFigure, match="missed_faults"):
        goal_met(out)


def test_a_client_that_outlives_its_run_keeps_its_runs_clock(monkeypatch):
    """A request still open when the next run starts (its join timed out) records its end from its
    own run's start, not the next one's."""
    import time

    runner = _runner(monkeypatch, lambda prompt, prompts: True)  # answered once "the fault" went in
    runner._t_run = time.monotonic()
    rec = RequestRecord(24, False)
    client = threading.Thread(target=runner._client, args=(runner.prompts[0], False, rec, "kill_decode"))
    client.start()
    with runner._moved:
        assert runner._moved.wait_for(lambda: rec.sent_s is not None, 10)
    runner._t_run += 1000.0  # the next run began
    runner.injected.set()
    client.join(10)
    assert 0.0 <= rec.sent_s <= rec.done_s < 60.0, rec
    assert open_at([rec], rec.sent_s) == [0]
