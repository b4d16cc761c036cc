"""The fault suite's leak tally (``kvoffload_testing.fault_tally.held`` / ``summarize``) on hand-made Stats: no
processes. A counter the tally needs that a service does not report (renamed, dropped) must be an
error naming the service, the key and the keys present, never a silent 0 that makes every leak
check pass. Also the goal of ``bench faults`` (``goal_met``): every figure it reads present,
``open_requests_after`` among them. The error each fault gives: test_fault_errors.py."""

from __future__ import annotations

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
            "in_service": 0.0,
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
    stats["prefill-0"]["in_service"] = 3  # one in the ledger, two more admitted to its queue
    assert held(stats)["open_requests"] == 3 + 1 + 2


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
        "prefill": ("held_slots", "ledger_open", "in_service", "pool_available"),
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


def test_a_run_has_a_problem_when_a_request_or_the_stack_after_it_went_wrong():
    from kvoffload_testing.fault_tally import RequestRecord

    clean = dict.fromkeys(LEAK_KEYS, 0.0)
    ok = RequestRecord(700, False, ok=True, ended=True, tokens_equal=True)
    told = RequestRecord(700, False, ok=False, ended=True, error="HTTP 502: prefill ...", wrong_error="")
    assert not RunRecord(0, "kill_prefill", [ok, told], clean, True).has_problem()
    assert RunRecord(0, "none", [ok], clean, False).has_problem()  # the fresh request failed
    assert RunRecord(0, "none", [ok], {**clean, "leaked_slots": 1.0}, True).has_problem()
    for bad in (
        RequestRecord(700, False, ok=False, ended=False),
        RequestRecord(700, False, ok=True, ended=True, tokens_equal=False),
        RequestRecord(700, False, ok=False, ended=True, wrong_error="gives HTTP 504, not HTTP 502"),
        RequestRecord(700, False, ok=False, ended=True),  # an error nobody judged
    ):
        assert RunRecord(0, "stall_prefill_long", [ok, bad], clean, True).has_problem(), bad


def test_a_run_with_a_problem_reports_the_warnings_its_services_logged_during_it(tmp_path):
    from kvoffload_testing.fault_tally import log_sizes, logged_since
    from kvoffload_testing.faults import LOG_LINES_KEPT

    before = '{"event": "old_failure", "level": "error"}\n'
    (tmp_path / "prefill-0.log").write_text(before)
    (tmp_path / "decode-0.log").write_text("")
    paths = {name: tmp_path / f"{name}.log" for name in ("prefill-0", "decode-0", "proxy")}
    starts = log_sizes(paths)
    assert starts == {"prefill-0": len(before), "decode-0": 0, "proxy": 0}  # the proxy has no log yet
    with (tmp_path / "prefill-0.log").open("a") as f:
        f.write('{"event": "serving", "level": "info"}\n')
        for i in range(LOG_LINES_KEPT + 3):
            f.write(f'{{"event": "prefill_failed", "n": {i}, "level": "error"}}\n')
    (tmp_path / "decode-0.log").write_text('{"event": "request_timed_out", "level": "warning"}\n')
    logs = logged_since(paths, starts, LOG_LINES_KEPT)
    assert set(logs) == {"prefill-0", "decode-0"}
    assert len(logs["prefill-0"]) == LOG_LINES_KEPT and '"n": 3,' in logs["prefill-0"][0]
    assert logs["prefill-0"][-1] == f'{{"event": "prefill_failed", "n": {LOG_LINES_KEPT + 2}, "level": "error"}}'
    assert logs["decode-0"] == ['{"event": "request_timed_out", "level": "warning"}']
