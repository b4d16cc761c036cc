"""kvcore.pool.eviction: the policies alone (the pools' use of LRU is in the backend contract suite,
tests/integration/test_backend_contract.py)."""

from kvcore.pool.eviction import LRUEviction, NoEviction


def test_lru_offers_the_least_recently_used_evictable_keys():
    lru = LRUEviction()
    for k in (b"a", b"b", b"c", b"d"):
        lru.on_complete(k)
    lru.on_access(b"a")  # a is now the most recent
    assert lru.victims(2, lambda k: True) == [b"b", b"c"]
    assert lru.victims(2, lambda k: k != b"b") == [b"c", b"d"]  # skips what cannot go
    lru.on_remove(b"c")
    assert lru.victims(3, lambda k: True) == [b"b", b"d", b"a"]


def test_lru_offers_what_it_has_and_the_pool_decides():
    lru = LRUEviction()
    lru.on_complete(b"a")
    lru.on_complete(b"b")
    assert lru.victims(3, lambda k: True) == [b"a", b"b"]  # fewer than needed: the pool refuses the alloc
    assert lru.victims(0, lambda k: True) == []


def test_no_eviction_never_offers_a_victim():
    policy = NoEviction()
    policy.on_complete(b"a")
    assert policy.victims(1, lambda k: True) == []
