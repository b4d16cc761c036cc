"""The fault-injection suite (I5, I6): real processes on loopback, seeded and repeatable.

Every fault kind once, then randomized runs: kill -9 the decode mid-pull, the
prefill mid-layer, the metastore, the proxy; stop the decode briefly (delayed READ_DONE: the
request must still succeed) or past the peer timeout (lost READ_DONE); stop the prefill past the
peer timeout or past the metastore's heartbeat timeout (its pool and leases expire); overfill the
decode's sequence slots; fill the prefill's host pool (a prompt larger than it, among others). Every
fault met a request in flight (sent, not yet answered, as its client saw it; ``missed_faults`` 0). After
every run: each client request ended within its deadline, every success is bit-identical to the plain
full-KV oracle (``kvoffload_testing.oracle``), the idle stack holds no slot, pool byte, lease or
open request, and a fresh request succeeds. ``KVOFFLOAD_FAULT_SEED`` replays another seed.

The same checks on a Mooncake deployment: the prefill pool on Mooncake Store (a real
``mooncake_master``) and the P→D pull on Mooncake Transfer Engine (``transfer_backend: "mooncake"``,
every layer read through the engines, ``kvoffload bench faults --pool mooncake --transfer mooncake``):
every one of its fault kinds once, then a few random ones — kill -9 of the master (every key lost),
and of the prefill mid-transfer (a dead segment owner the master still lists, a dead engine session
the decode's reads fail on), of the decode mid-transfer, a decode stalled past the peer timeout.

50 seeded runs in all, each with its own random moment of the fault, prompts and streaming: the 11
kinds and 23 random runs on the metastore's stack, the 10 kinds and 6 random runs on Mooncake's
(``test_seeded_runs_are_fifty_in_all`` counts them). The randomized runs have a time budget inside
their test's timeout: when it ends, the test fails with the tally of the runs done so far.
"""

from __future__ import annotations

import os

import pytest

from kvoffload_testing.fault_catalog import FAULTS, MOONCAKE_FAULTS
from kvoffload_testing.fault_tally import missed, records_json, summarize
from kvoffload_testing.faults import (
    FILLER_TOKENS,
    REQUEST_DEADLINE_S,
    FaultRunner,
    fault_stack_config,
    reference_tokens,
)
from kvoffload_testing.stack import Stack
from kvoffload_testing.stack_client import stack_stats
from kvoffload_testing.stack_config import ensure_tiny_model

pytestmark = pytest.mark.stack

SEED = int(os.environ.get("KVOFFLOAD_FAULT_SEED", "20261129"))
RANDOM_RUNS = 23  # plus one run of every fault kind
MOONCAKE_RANDOM_RUNS = 6  # plus one run of every kind of the Mooncake stack
SEEDED_RUNS = 50  # the runs of both stacks together, at least
RANDOM_TIMEOUT_S = 900  # test_randomized_fault_runs' own timeout (a stack test's default)
RANDOM_BUDGET_S = 700  # its runs' time budget: the rest is for a stack start (run alone) and a last long run
# the request a SIGTERM finds decoding lasts DRAINED_S at the decode's rate measured in the test: long
# beside a request's own round trip, well within the decode's 30 s --shutdown-grace-s at any speed
DRAINED_S = (8.0, 15.0)  # at least, at most (seconds of decoding)
RATE_TOKENS = 64  # decoded to measure the rate


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    model = ensure_tiny_model(tmp / "tiny")
    ref = reference_tokens(model)
    with Stack(fault_stack_config(model, tmp / "logs")) as stack:
        yield FaultRunner(stack, ref, SEED, log=print)


@pytest.fixture(scope="module")
def mooncake_runner(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults-mooncake")
    model = ensure_tiny_model(tmp / "tiny")
    ref = reference_tokens(model)
    with Stack(fault_stack_config(model, tmp / "logs", pool="mooncake", transfer="mooncake")) as stack:
        yield FaultRunner(stack, ref, SEED, log=print)


def _check(records, faults=FAULTS) -> None:
    summary = summarize(records, faults)
    bad = [r for r in records if r.has_problem()]  # each with its services' warnings and errors
    detail = f"seed {SEED}: {summary}\nruns with a problem: {records_json(bad)[:60000]}"
    missed_runs = [
        (r.run, r.fault, r.injected_s, [(q.sent_s, q.done_s) for q in r.requests]) for r in records if missed(r)
    ]
    assert summary["missed_faults"] == 0, (
        f"faults that met no request in flight (run, fault, when): {missed_runs}\n{detail}"
    )
    assert summary["terminated"] == summary["requests"], detail
    assert summary["max_termination_s"] <= REQUEST_DEADLINE_S, detail
    assert summary["wrong_tokens"] == 0, detail
    assert summary["leaked_slots"] == summary["leaked_pool_bytes"] == summary["leaked_leases"] == 0, detail
    assert summary["open_requests_after"] == 0, detail
    assert summary["fresh_request_failures"] == 0, detail
    assert summary["wrong_errors"] == 0, detail  # each failure: its fault's status, naming the peer it hit
    for run in records:  # faults that must not fail anything: none, and READ_DONE only delayed
        if run.fault in ("none", "stall_decode_short"):
            assert all(r.ok for r in run.requests), detail
        for r in run.requests:  # every failure says what failed
            assert r.ok or r.error, detail
            if r.prompt_tokens > FILLER_TOKENS:  # the pool bound holds, and the error says so
                assert not r.ok and "host pool full" in r.error, detail


def test_every_fault_kind(runner):
    _check(runner.run_many(len(FAULTS), list(FAULTS)))


def test_seeded_runs_are_fifty_in_all():
    assert len(FAULTS) + RANDOM_RUNS + len(MOONCAKE_FAULTS) + MOONCAKE_RANDOM_RUNS >= SEEDED_RUNS


@pytest.mark.slow
@pytest.mark.timeout(RANDOM_TIMEOUT_S)
def test_randomized_fault_runs(runner):
    """``RANDOM_RUNS`` runs of faults drawn by weight, within ``RANDOM_BUDGET_S``: once the budget ends
    no run starts, and the test fails with the tally of the runs done (before, a run past the
    test's timeout said nothing of how far it got)."""
    records = runner.run_many(RANDOM_RUNS, budget_s=RANDOM_BUDGET_S)
    tally = summarize(records)
    print(f"randomized fault runs: {len(records)} of {RANDOM_RUNS} within {RANDOM_BUDGET_S} s: {tally}")
    _check(records)
    assert len(records) == RANDOM_RUNS, (
        f"the time budget of {RANDOM_BUDGET_S} s ended after {len(records)} of {RANDOM_RUNS} runs; their tally: {tally}"
    )


@pytest.mark.slow
def test_every_fault_kind_with_the_pool_and_the_pull_on_mooncake(mooncake_runner):
    runs = mooncake_runner.run_many(len(MOONCAKE_FAULTS), list(MOONCAKE_FAULTS))
    runs += mooncake_runner.run_many(MOONCAKE_RANDOM_RUNS)
    _check(runs, MOONCAKE_FAULTS)  # a request the master's loss failed says so (EXPECTED_ERRORS)
    stats = stack_stats(mooncake_runner.stack.cfg)["decode-0"]  # every read went through the engine
    assert stats["reads_engine"] > 0 and stats["reads_shared_memory"] == stats["reads_streamed"] == 0, stats


@pytest.mark.slow
def test_a_metastore_fault_does_not_apply_to_a_mooncake_stack(mooncake_runner):
    with pytest.raises(ValueError, match="kill_metastore"):
        mooncake_runner.run_many(1, ["kill_metastore"])


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(runner):
    """Graceful shutdown: SIGTERM to the decode while a request decodes — that request finishes whole
    with the right tokens, a new one is refused with a clear 'shutting down' error, the decode exits 0,
    and after a restart everything serves again. The request in flight is sized by the decode's rate
    measured here first (``drained_tokens``), so it still decodes when the new one (a prefill first)
    reaches the decode, and ends within the grace, on a fast machine or a slow one."""
    import signal
    import threading
    import time

    from kvoffload_testing.faults import _request
    from kvoffload_testing.stack_client import stack_stats

    stack, prompt = runner.stack, runner.prompts[1]
    tokens, per_token_s, round_trip_s = drained_tokens(stack, prompt)
    got: dict = {}
    th = threading.Thread(
        target=lambda: got.update(
            zip(("ok", "tokens", "error"), _request(stack.url, prompt, True, REQUEST_DEADLINE_S, tokens))
        )
    )
    th.start()
    deadline = time.monotonic() + REQUEST_DEADLINE_S
    while not stack_stats(stack.cfg)["decode-0"]["running"]:
        assert time.monotonic() < deadline and th.is_alive(), f"the request never reached the decode: {got}"
        time.sleep(0.02)
    stack.signal("decode-0", signal.SIGTERM)
    try:
        time.sleep(0.1)
        ok, _, error = _request(stack.url, runner.prompts[0], False, REQUEST_DEADLINE_S)
        still_decoding = th.is_alive()
        th.join(3 * (tokens * per_token_s + round_trip_s) + 10)  # 3x the measured pace: a slower moment
        assert still_decoding, f"the request in flight ended before the new one was answered: {got}"
        assert got.get("ok") and len(got["tokens"]) == tokens, (got, tokens, per_token_s)
        assert got["tokens"][: len(runner.reference(prompt))] == runner.reference(prompt), got
        assert not ok and "shutting down" in error, error
        assert stack.process("decode-0").wait(40) == 0
    finally:  # the module's other tests need the decode back, whatever failed here
        stack.process("decode-0").wait(40)
        stack.restart("decode-0")
    ok, tokens_after, error = _request(stack.url, runner.prompts[0], False, REQUEST_DEADLINE_S)
    assert ok and tokens_after == runner.reference(runner.prompts[0]), error


def drained_tokens(stack: Stack, prompt: list[int]) -> tuple[int, float, float]:
    """(tokens, seconds per decoded token, seconds of a one-token request) for the request a SIGTERM
    finds decoding: the rate measured now on ``stack`` (its prompt's prefix cached, as the drained
    request's will be), the tokens ``DRAINED_S`` of it, within the stack's max_model_len."""
    import math
    import time

    from kvoffload_testing.faults import _request

    def timed(max_tokens: int) -> float:
        t0 = time.monotonic()
        ok, out, error = _request(stack.url, prompt, False, REQUEST_DEADLINE_S, max_tokens)
        assert ok and len(out) == max_tokens, error
        return time.monotonic() - t0

    timed(1)  # the prompt's blocks into the pool
    one = timed(1)
    per_token = max(timed(1 + RATE_TOKENS) - one, 1e-3) / RATE_TOKENS
    want_s = min(max(DRAINED_S[0], 4 * one), DRAINED_S[1])
    room = stack.cfg.max_model_len - len(prompt) - 1
    return min(math.ceil(want_s / per_token), room), per_token, one


@pytest.mark.slow
def test_bench_faults_prints_the_issue_fields(runner):
    """``kvoffload bench faults``'s runs (``bench_runs``; the bench starts a fresh stack for them) on
    this module's stack: a few runs here, the bench's default is 20."""
    from kvoffload_testing.faults import bench_runs

    out = bench_runs(runner, 3)
    for key in (
        "requests",
        "terminated",
        "leaked_slots",
        "leaked_pool_bytes",
        "leaked_leases",
        "max_termination_s",
        "open_requests_after",
        "wrong_errors",
        "missed_faults",
    ):
        assert key in out, out
    assert out["runs"] == 3 and out["seed"] == SEED and out["goal_met"], out
    assert out["goals_met"]["missed_faults"] and out["missed_faults"] == 0, out


def test_oversized_prompts_are_refused_before_any_kv_and_a_disconnect_frees_everything(runner):
    """> max_model_len: 400 naming the limit, with no ledger entry or pool byte taken anywhere; a
    client that hangs up mid-stream cancels its request and everything it held is freed."""
    import http.client
    import json
    import time

    from kvoffload_testing.fault_tally import held
    from kvoffload_testing.faults import _request
    from kvoffload_testing.stack_client import stack_stats

    stack = runner.stack
    before = stack_stats(stack.cfg)
    ok, _, error = _request(stack.url, [5] * (stack.cfg.max_model_len + 1), False, REQUEST_DEADLINE_S)
    assert not ok and error.startswith("HTTP 400") and "max_model_len" in error, error
    after = stack_stats(stack.cfg)
    for svc in ("decode-0", "prefill-0"):
        assert after[svc]["ledger_open"] == 0
        assert sum(v for k, v in after[svc].items() if k.startswith("ledger_finished")) == sum(
            v for k, v in before[svc].items() if k.startswith("ledger_finished")
        ), svc
    assert not any(held(after).values())

    cancelled = before["decode-0"].get("ledger_finished_cancelled", 0)  # a ledger outcome is counted from its first
    conn = http.client.HTTPConnection(stack.cfg.host, stack.cfg.proxy_port, timeout=REQUEST_DEADLINE_S)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": runner.prompts[-1], "max_tokens": 1500, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    while not (line := resp.readline()).startswith(b"data: {"):  # the first event: it is decoding
        assert line, "the stream ended before its first event"
    assert b'"error"' not in line, line  # a token, not a failure
    conn.close()  # the client hangs up
    deadline = time.monotonic() + 30
    while True:
        stats = stack_stats(stack.cfg)
        if not any(held(stats).values()) and stats["decode-0"].get("ledger_finished_cancelled", 0) > cancelled:
            break
        assert time.monotonic() < deadline, (
            held(stats),
            {
                k: v
                for s in stats.values()
                for k, v in s.items()
                if k.startswith("ledger") or k in ("pending", "running")
            },
        )
        time.sleep(0.1)
