"""kvcore.pool.leases: the lease table over plain records (grant, expiry by deadline, renew, release) and
the in-process ``LocalLease`` handle. Lease behaviour through every pool backend is in the backend
contract suite (tests/integration/test_backend_contract.py)."""

import threading

import pytest

from kvcore.pool.errors import LeaseExpired
from kvcore.pool.leases import Lease, LeaseRecord, LeaseTable, LocalLease, check_ttl_ms


def test_grant_counts_live_leases_per_key():
    table = LeaseTable()
    a = table.grant((b"x", b"y"), deadline=10.0)
    b = table.grant((b"x",), deadline=20.0)
    assert isinstance(a, LeaseRecord) and a.live and (a.keys, a.deadline) == ((b"x", b"y"), 10.0)
    assert b"x" in table and table.count(b"x") == 2 and table.count(b"y") == 1 and table.num_live == 2
    assert b.live and b"z" not in table and table.count(b"z") == 0


def test_expire_drops_exactly_the_records_due():
    table = LeaseTable()
    a, b = table.grant((b"x",), 10.0), table.grant((b"x", b"y"), 20.0)
    table.expire(9.99)
    assert a.live and b.live
    table.expire(10.0)  # at the deadline: expired
    assert a.state == "expired" and b.live and table.count(b"x") == 1
    table.expire(100.0)
    assert b.state == "expired" and b"x" not in table and b"y" not in table
    assert (table.num_live, table.num_expired) == (0, 2)


def test_renew_moves_the_deadline_and_the_old_heap_entry_is_ignored():
    table = LeaseTable()
    rec = table.grant((b"x",), 10.0)
    assert table.renew(rec, 30.0) == 30.0 and rec.deadline == 30.0
    table.expire(15.0)  # the entry for 10.0 no longer matches
    assert rec.live and table.num_expired == 0
    table.expire(30.0)
    assert rec.state == "expired"
    with pytest.raises(LeaseExpired, match="expired") as e:
        table.renew(rec, 99.0)
    assert e.value.key == b"x"


def test_release_is_idempotent_and_says_whether_it_released():
    table = LeaseTable()
    rec = table.grant((b"x",), 10.0)
    assert table.release(rec) is True and rec.state == "released" and b"x" not in table
    assert table.release(rec) is False and table.num_live == 0
    with pytest.raises(LeaseExpired, match="released"):
        table.renew(rec, 20.0)
    table.expire(100.0)  # a released record never counts as expired
    assert table.num_expired == 0


def test_local_lease_works_the_table_under_the_owners_lock_on_the_owners_clock():
    now = [0.0]
    table, lock = LeaseTable(), threading.Lock()
    lease = LocalLease(table.grant((b"x",), 5.0), table, lock, clock=lambda: now[0])
    assert isinstance(lease, Lease) and lease.keys == (b"x",) and lease.live and lease.deadline == 5.0
    assert lease.renew(1000) == 1.0  # now + 1 s
    now[0] = 1.0
    assert not lease.live and table.num_expired == 1
    with pytest.raises(LeaseExpired):
        lease.renew(1000)
    lease.release()  # idempotent after expiry
    with pytest.raises(ValueError, match="ttl_ms"):
        lease.renew(0)
    with LocalLease(table.grant((b"y",), 50.0), table, lock, clock=lambda: now[0]) as held:
        assert b"y" in table
    assert not held.live and b"y" not in table
    assert not lock.locked()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10", None])
def test_ttl_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="ttl_ms must be an int > 0"):
        check_ttl_ms(bad)
    assert check_ttl_ms(7) == 7
