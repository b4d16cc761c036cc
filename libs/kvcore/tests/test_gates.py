"""Slot reuse gates, one slot at a time: what holds a slot (compute, save, every reader's ack), how
failures are reported and to whom, timeouts that name what is missing, stale and duplicate acks."""

from __future__ import annotations

import dataclasses
import inspect
import re
import time

import pytest

from kvcore import gates
from kvcore.gates import GateSet, GateTimeout, OccupantFailed, SlotGate, SlotGateError
from kvcore.slottickets import SlotTicket

R1, R2 = ("req-9", "decode-0:20050"), ("req-9", "decode-1:20051")


def test_hook_map_mentions_every_public_method():
    doc = gates.__doc__
    for cls in (SlotGate, SlotTicket, GateSet):
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        public = [
            n
            for n, v in vars(cls).items()
            if not n.startswith("_")
            and n not in fields
            and (inspect.isfunction(v) or isinstance(v, (property, classmethod, staticmethod)))
        ]
        assert public, cls
        for name in public:
            assert re.search(rf"\b{cls.__name__}\.{name}\b", doc), f"hook map misses {cls.__name__}.{name}"


def test_zero_readers_never_blocks():
    gs = GateSet({layer: 0 for layer in range(8)})
    for layer in range(8):
        t = gs.acquire(layer, (), timeout_s=0)
        assert t.readers == frozenset() and t.generation == layer + 1
        t.computed()
        t.saved()
        assert t.is_settled and t.pending() == ""
        assert gs.gate(0).is_free()
    with pytest.raises(ValueError, match="not registered"):
        t.read_done(R1)
    with pytest.raises(ValueError, match="not registered"):
        t.read_failed(R1, "x")


def test_reader_without_blocks_must_still_ack():
    g = SlotGate(0)
    t = g.acquire(3, [R1], timeout_s=0)
    t.computed()
    t.saved()
    assert not g.is_free() and not t.is_settled
    with pytest.raises(GateTimeout, match=re.escape(f"READ_DONE pending from 1 of 1 readers: {R1!r}")):
        g.acquire(5, timeout_s=0.02)
    t.read_done(R1)
    assert g.is_free()
    assert g.acquire(5, timeout_s=0).layer == 5


def test_pending_compute_alone_blocks():
    g = SlotGate(0)
    t = g.acquire(0, [R1], timeout_s=0)
    t.saved()
    t.read_done(R1)
    assert not g.is_free() and t.pending() == "compute pending"
    with pytest.raises(GateTimeout, match=r"\(previous occupant layer 0\): compute pending$"):
        g.acquire(2, timeout_s=0.01)
    t.computed()
    assert g.is_free() and g.acquire(2, timeout_s=0).layer == 2


def test_save_failure_raises_with_cause_then_slot_is_free():
    gs = GateSet({4: 1, 7: 1})
    t = gs.acquire(4, [R1], timeout_s=0)
    t.computed()
    t.read_done(R1)
    boom = OSError("disk full")
    t.save_failed(boom)
    assert not gs.gate(1).is_free()
    assert not gs.gate(1).is_free()  # the check consumes nothing
    with pytest.raises(OccupantFailed) as ei:
        gs.acquire(7, timeout_s=1)
    msg = str(ei.value)
    assert "layer 7" in msg and "slot 1" in msg and "previous occupant layer 4" in msg and "disk full" in msg
    assert ei.value.__cause__ is boom and isinstance(ei.value, SlotGateError)
    assert (ei.value.slot, ei.value.layer, ei.value.previous_layer) == (1, 7, 4)
    assert gs.gate(1).is_free()
    assert gs.acquire(7, timeout_s=0).generation == 2
    assert gs.stats()["failures"] == 1


def test_read_failed_names_reader_and_reason():
    g = SlotGate(2)
    t = g.acquire(4, [R1, R2], timeout_s=0)
    t.computed()
    t.saved()
    t.read_done(R2)
    t.read_failed(R1, "checksum mismatch")
    with pytest.raises(OccupantFailed) as ei:
        g.acquire(6, timeout_s=1)
    assert f"READ_FAILED from {R1!r}: checksum mismatch" in str(ei.value)
    assert ei.value.__cause__ is None
    assert g.acquire(6, timeout_s=0).layer == 6


def test_failure_raises_at_once_but_slot_stays_held_until_settled():
    g = SlotGate(0)
    t = g.acquire(4, [R1], timeout_s=0)
    t.computed()
    t.save_failed(RuntimeError("pool gone"))
    start = time.monotonic()
    with pytest.raises(OccupantFailed, match="slot stays held until settled: READ_DONE pending"):
        g.acquire(6, timeout_s=5)
    assert time.monotonic() - start < 2.0
    assert not g.is_free()  # the read is still in flight (I4)
    with pytest.raises(GateTimeout):
        g.acquire(6, timeout_s=0.01)  # failure already reported: a retry waits, it does not raise again
    t.read_done(R1)
    assert g.acquire(6, timeout_s=0).layer == 6


def test_compute_failure_is_a_cause_too():
    g = SlotGate(0)
    t = g.acquire(2, timeout_s=0)
    err = ValueError("nan in layer 2")
    t.compute_failed(err)
    t.save_failed(RuntimeError("never queued"))
    with pytest.raises(OccupantFailed) as ei:
        g.acquire(3, timeout_s=0)
    assert "compute failed" in str(ei.value) and ei.value.__cause__ is not err  # save cause wins
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert g.is_free()


def test_timeout_message_names_what_is_missing_and_frees_nothing():
    gs = GateSet({4: 1, 7: 1})
    t = gs.acquire(4, [R1, R2], timeout_s=0)
    t.read_done(R2)
    before = gs.gate(1).snapshot()
    with pytest.raises(GateTimeout) as ei:
        gs.acquire(7, timeout_s=0.05)
    assert re.fullmatch(
        r"layer 7 waited \d+\.\d\d s for slot 1 \(previous occupant layer 4\): save pending; "
        r"READ_DONE pending from 1 of 2 readers: \('req-9', 'decode-0:20050'\); compute pending",
        str(ei.value),
    ), str(ei.value)
    assert (ei.value.slot, ei.value.layer, ei.value.previous_layer) == (1, 7, 4)
    assert gs.gate(1).snapshot() == before and not gs.gate(1).is_free()
    assert gs.ticket(4) is t
    stats = gs.stats()
    assert stats["timeouts"] == 1 and stats["waits"] == 1 and stats["held_slots"] == 1 and stats["total_wait_s"] > 0
    t.saved()
    t.computed()
    t.read_done(R1)
    assert gs.acquire(7, timeout_s=0).layer == 7


def test_duplicate_unknown_and_stale_acks_change_nothing():
    g = SlotGate(0)
    t = g.acquire(1, [R1, R2], timeout_s=0)
    t.computed()
    t.saved()
    t.read_done(R1)
    bad_calls = [
        (t.computed, ()),
        (t.compute_failed, (RuntimeError("x"),)),
        (t.saved, ()),
        (t.save_failed, (RuntimeError("x"),)),
        (t.read_done, (R1,)),
        (t.read_failed, (R1, "late")),
        (t.read_done, (("req-9", "evil:1"),)),
        (t.read_failed, (("req-8", "decode-0:20050"), "x")),
    ]
    for fn, args in bad_calls:
        before = g.snapshot()
        with pytest.raises(ValueError):
            fn(*args)
        assert g.snapshot() == before, fn
    t.read_done(R2)
    t2 = g.acquire(1, [R1, R2], timeout_s=0)
    before = g.snapshot()
    for fn, args in [(t.read_done, (R1,)), (t.computed, ()), (t.save_failed, (OSError("x"),))]:
        with pytest.raises(ValueError, match="stale ticket"):
            fn(*args)
        assert g.snapshot() == before
    with pytest.raises(ValueError):
        t2.save_failed("not an exception")  # type: ignore[arg-type]
    assert g.snapshot() == before and t2.pending().startswith("save pending")


def test_gateset_routing_and_validation():
    gs = GateSet({0: 0, 1: 1, 2: 2, 3: 1, 4: 2})
    with pytest.raises(ValueError, match="layer 9 has no slot"):
        gs.acquire(9)
    with pytest.raises(ValueError, match="slot 5"):
        gs.gate(5)
    with pytest.raises(ValueError, match="not the current occupant"):
        gs.ticket(1)
    t1 = gs.acquire(1, [R1], timeout_s=0)
    assert gs.ticket(1) is t1 and gs.gate(1).occupant is t1
    with pytest.raises(ValueError, match="not the current occupant"):
        gs.ticket(3)
    with pytest.raises(ValueError):
        GateSet({0: -1})
    with pytest.raises(ValueError, match="timeout_s"):
        gs.acquire(0, timeout_s=float("inf"))
    with pytest.raises(ValueError, match="single string"):
        gs.acquire(0, "decode-0:20050")
    assert gs.stats()["slots"] == 3


def test_failure_fails_only_waiters_of_the_same_owner():
    gate = SlotGate(0)
    t = gate.acquire(1, owner="req-a", timeout_s=1)
    t.computed()
    t.save_failed(OSError("disk"))
    nxt = gate.acquire(2, owner="req-b", timeout_s=1)  # another request: not failed by req-a's save
    assert nxt.layer == 2
    nxt.computed()
    nxt.save_failed(OSError("disk again"))
    with pytest.raises(OccupantFailed, match="disk again"):
        gate.acquire(3, owner="req-b", timeout_s=1)
    assert gate.acquire(3, owner="req-b", timeout_s=1).layer == 3  # the report consumed the failure


def test_other_owner_still_waits_for_in_flight_items():
    gate = SlotGate(0)
    t = gate.acquire(1, readers=["d0"], owner="req-a", timeout_s=1)
    t.compute_failed(RuntimeError("boom"))
    t.save_failed(RuntimeError("boom"))
    with pytest.raises(GateTimeout, match="READ_DONE pending"):
        gate.acquire(2, owner="req-b", timeout_s=0.05)  # the read is still in flight (I4)
    t.read_done("d0")
    assert gate.acquire(2, owner="req-b", timeout_s=1).layer == 2


def test_fail_pending_reads_settles_only_the_readers_that_did_not_answer():
    gate = SlotGate(0)
    t = gate.acquire(1, readers=["a", "b", "c"])
    t.computed()
    t.saved()
    t.read_done("a")
    assert t.fail_pending_reads("the announce could not be sent") == 2
    assert t.fail_pending_reads("again") == 0  # idempotent
    assert t.is_settled
    with pytest.raises(OccupantFailed, match="the announce could not be sent"):
        gate.acquire(2, timeout_s=1)
