import json
import threading
import time

import pytest

from svcruntime.ledger import Ledger


def test_stages_outcomes_and_counters():
    led = Ledger()
    led.open("a", "admitted")
    led.open("b", "admitted")
    led.advance("a", "pulling", peer="prefill 1.2.3.4:5")
    assert led.stage_of("a") == "pulling"
    assert led.counters() == {"ledger_open": 2, "ledger_open_admitted": 1, "ledger_open_pulling": 1}
    assert led.finish("a", "ok")
    assert not led.finish("a", "error")  # the first outcome stays
    led.finish("b", "error", "boom")
    c = led.counters()
    assert c == {"ledger_open": 0, "ledger_finished_ok": 1, "ledger_finished_error": 1}
    snap = json.loads(led.snapshot())
    assert snap["open"] == []
    assert [(e["request_id"], e["outcome"], e["error"]) for e in snap["finished"]] == [
        ("a", "ok", ""),
        ("b", "error", "boom"),
    ]
    assert [s for s, _ in snap["finished"][0]["history"]] == ["admitted", "pulling", "ok"]


def test_duplicate_open_is_refused():
    led = Ledger()
    led.open("a", "x")
    with pytest.raises(ValueError, match="already in the ledger"):
        led.open("a", "x")


def test_silence_past_the_limit_times_out_with_a_reason_naming_peer_and_stage():
    led = Ledger()
    led.open("a", "pulling", peer="prefill p:1", silence_limit_s=2.0)
    led.open("b", "admitted")  # no limit at this stage: never times out
    t0 = time.monotonic()
    assert led.overdue(t0 + 1.0) == []
    led.touch("a")
    assert led.overdue(time.monotonic() + 1.9) == []
    [(entry, reason)] = led.overdue(time.monotonic() + 2.5)
    assert entry.request_id == "a" and entry.outcome == "timeout"
    assert "prefill p:1" in reason and "'pulling'" in reason and "limit 2 s" in reason
    assert led.open_ids() == ["b"] and led.overdue(t0 + 1e6) == []
    assert led.counters()["ledger_finished_timeout"] == 1


def test_watchdog_thread_calls_back_once():
    fired = []
    done = threading.Event()

    def on_timeout(entry, reason):
        fired.append(entry.request_id)
        done.set()

    led = Ledger(on_timeout, interval_s=0.02).start()
    try:
        led.open("a", "pulling", silence_limit_s=0.05)
        assert done.wait(2)
        time.sleep(0.1)
        assert fired == ["a"]
        assert not led.touch("a")
    finally:
        led.close()


def test_a_finished_request_cannot_time_out():
    led = Ledger()
    led.open("a", "pulling", silence_limit_s=0.0)
    led.finish("a", "ok")
    assert led.overdue(time.monotonic() + 10) == []


def test_a_paused_watchdog_forgives_instead_of_blaming_the_peer(monkeypatch):
    """When this process was stopped (SIGSTOP, starvation), the peer's news is still queued: the
    watchdog restarts every silence clock instead of failing the requests."""
    import svcruntime.ledger as ledger_mod

    fired = []
    led = Ledger(lambda e, r: fired.append(e.request_id), interval_s=0.01)
    led.open("a", "pulling", silence_limit_s=0.5)
    clock = [time.monotonic()]
    monkeypatch.setattr(ledger_mod.time, "monotonic", lambda: clock[0])
    led.start()
    try:
        time.sleep(0.05)
        clock[0] += 5.0  # the whole process, watchdog included, was frozen for 5 s
        time.sleep(0.1)
        assert fired == [] and led.open_ids() == ["a"]
        clock[0] += 0.6  # then really 0.6 s of silence
        deadline = time.time() + 2
        while not fired and time.time() < deadline:
            time.sleep(0.01)
        assert fired == ["a"]
    finally:
        led.close()
