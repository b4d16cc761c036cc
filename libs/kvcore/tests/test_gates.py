"""Slot reuse gates: I4 (no slot overwritten while its previous occupant is in flight), bounded waits."""

from __future__ import annotations

import dataclasses
import inspect
import queue
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcore import gates
from kvcore.gates import GateAborted, GateSet, GateTimeout, OccupantFailed, SlotGate, SlotGateError, SlotTicket

R1, R2 = ("req-9", "decode-0:20050"), ("req-9", "decode-1:20051")


def _eventually(pred, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def _settle(t: SlotTicket) -> None:
    t.computed()
    t.saved()
    for r in t.readers:
        t.read_done(r)


def _in_thread(fn):
    """Run fn in a thread; returns (thread, box) where box gets 'result' or 'error' and 'elapsed_s'."""
    box: dict = {}

    def run():
        start = time.monotonic()
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
        box["elapsed_s"] = time.monotonic() - start

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def test_hook_map_mentions_every_public_method():
    doc = gates.__doc__
    for cls in (SlotGate, SlotTicket, GateSet):
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        public = [n for n, v in vars(cls).items()
                  if not n.startswith("_") and n not in fields
                  and (inspect.isfunction(v) or isinstance(v, (property, classmethod, staticmethod)))]
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


def test_waiter_wakes_when_last_item_settles():
    g = SlotGate(1)
    t = g.acquire(4, [R1, R2], timeout_s=0)
    th, box = _in_thread(lambda: g.acquire(7, timeout_s=5))
    _eventually(lambda: g.snapshot().waiters == 1)
    t.computed()
    t.read_done(R1)
    t.saved()
    assert th.is_alive()  # R2 still pending
    t.read_done(R2)
    th.join(5)
    assert box["result"].layer == 7 and box["result"].generation == 2


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
        str(ei.value)), str(ei.value)
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
        (t.computed, ()), (t.compute_failed, (RuntimeError("x"),)), (t.saved, ()),
        (t.save_failed, (RuntimeError("x"),)), (t.read_done, (R1,)), (t.read_failed, (R1, "late")),
        (t.read_done, (("req-9", "evil:1"),)), (t.read_failed, (("req-8", "decode-0:20050"), "x")),
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


def test_waiters_are_served_in_arrival_order():
    g = SlotGate(0)
    t = g.acquire(0, timeout_s=0)
    th_a, box_a = _in_thread(lambda: g.acquire(10, timeout_s=5))
    _eventually(lambda: g.snapshot().waiters == 1)
    th_b, box_b = _in_thread(lambda: g.acquire(20, timeout_s=5))
    _eventually(lambda: g.snapshot().waiters == 2)
    assert not g.is_free()
    _settle(t)
    th_a.join(5)
    assert box_a["result"].layer == 10 and th_b.is_alive()
    _settle(box_a["result"])
    th_b.join(5)
    assert box_b["result"].layer == 20


def test_abort_all_wakes_waiters_promptly():
    gs = GateSet({0: 0, 1: 1, 2: 0, 3: 1})
    t0, t1 = gs.acquire(0, [R1], timeout_s=0), gs.acquire(1, timeout_s=0)
    waiters = [_in_thread(lambda layer=layer: gs.acquire(layer, timeout_s=30)) for layer in (2, 3)]
    _eventually(lambda: gs.gate(0).snapshot().waiters == 1 and gs.gate(1).snapshot().waiters == 1)
    gs.abort_all("shutdown")
    for th, box in waiters:
        th.join(2)
        assert not th.is_alive()
        assert isinstance(box["error"], GateAborted) and "aborted: shutdown" in str(box["error"])
        assert box["elapsed_s"] < 2
    with pytest.raises(GateAborted):
        gs.acquire(2, timeout_s=0)
    _settle(t0)  # in-flight work can still settle after abort
    t1.computed()
    assert gs.stats()["aborts"] == 3


def test_pipeline_with_remote_acks_does_not_deadlock():
    num_layers, num_slots = 48, 2
    gs = GateSet({layer: layer % num_slots for layer in range(num_layers)}, default_timeout_s=5)
    announces: queue.Queue = queue.Queue()
    saves: queue.Queue = queue.Queue()

    def reader():  # the transfer servicer: routes READ_DONE by layer
        while (layer := announces.get(timeout=5)) is not None:
            for r in (R1, R2):
                gs.ticket(layer).read_done(r)

    def saver():
        while (t := saves.get(timeout=5)) is not None:
            t.saved()

    def engine():
        for layer in range(num_layers):
            t = gs.acquire(layer, [R1, R2])
            t.computed()
            saves.put(t)
            announces.put(layer)
        announces.put(None)
        saves.put(None)

    threads = [_in_thread(f) for f in (reader, saver, engine)]
    for th, box in threads:
        th.join(10)
        assert not th.is_alive(), "pipeline hung"
        assert "error" not in box, box.get("error")
    stats = gs.stats()
    assert stats["acquires"] == num_layers and stats["held_slots"] == 0 and stats["timeouts"] == 0


def _run_randomized(seed: int, num_slots: int, num_layers: int = 24, fail_p: float = 0.1):
    """Engine + save/read workers with seeded delays and failures; returns (log, violations, stats)."""
    rng = random.Random(seed)
    gs = GateSet({layer: layer % num_slots for layer in range(num_layers)}, default_timeout_s=5)
    log: list[tuple] = []
    lock = threading.Lock()
    owner: dict[int, int] = {}  # slot -> layer whose data the buffer holds
    violations: list[str] = []

    def settle(t: SlotTicket, item: str, call, delay_s: float) -> None:
        time.sleep(delay_s)
        with lock:  # log and settle atomically, so "settled" is logged before any acquire can follow it
            if owner.get(t.slot) != t.layer:
                violations.append(f"slot {t.slot} overwritten by layer {owner.get(t.slot)} while {item} "
                                  f"of layer {t.layer} was in flight")
            log.append(("settled", t.slot, t.generation, item))
            call()

    with ThreadPoolExecutor(max_workers=6) as pool:
        for layer in range(num_layers):
            readers = [(f"req-{seed}", f"decode-{i}") for i in range(rng.randint(0, 2))]
            compute_s = rng.uniform(0, 0.002)
            jobs = [("save", rng.uniform(0, 0.004), rng.random() < fail_p)]
            jobs += [(r, rng.uniform(0, 0.004), rng.random() < fail_p) for r in readers]
            while True:
                try:
                    t = gs.acquire(layer, readers, timeout_s=5)
                    break
                except OccupantFailed:
                    with lock:
                        log.append(("failed", layer % num_slots, layer))
            with lock:
                log.append(("acquired", t.slot, t.generation, 2 + len(readers)))
                owner[t.slot] = layer
            for item, delay_s, fail in jobs:
                if item == "save":
                    call = (lambda t=t: t.save_failed(OSError("injected"))) if fail else t.saved
                else:
                    call = (lambda t=t, r=item: t.read_failed(r, "injected")) if fail else \
                        (lambda t=t, r=item: t.read_done(r))
                pool.submit(settle, t, repr(item), call, delay_s)
            pool.submit(settle, t, "compute", t.computed, compute_s)  # completion callback of the device stream
    return log, violations, gs.stats()


@pytest.mark.parametrize("num_slots", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_i4_no_slot_reused_before_previous_occupant_settled(seed, num_slots):
    log, violations, stats = _run_randomized(seed, num_slots)
    assert violations == []
    num_items: dict[tuple[int, int], int] = {}
    settled_count: dict[tuple[int, int], int] = {}
    for entry in log:
        if entry[0] == "settled":
            key = entry[1:3]
            settled_count[key] = settled_count.get(key, 0) + 1
        elif entry[0] == "acquired":
            _, slot, gen, items = entry
            prev = (slot, gen - 1)
            if gen > 1:
                assert settled_count.get(prev, 0) == num_items[prev], f"slot {slot} handed over before gen {gen - 1} settled"
            num_items[(slot, gen)] = items
    assert all(settled_count.get(k, 0) == n for k, n in num_items.items())  # everything settled in the end
    assert stats["acquires"] == 24 and stats["held_slots"] == 0 and stats["timeouts"] == 0
    assert stats["failures"] == sum(1 for e in log if e[0] == "failed")


def test_failure_fails_only_waiters_of_the_same_owner():
    from kvcore.gates import OccupantFailed, SlotGate

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
    from kvcore.gates import GateTimeout, SlotGate

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
