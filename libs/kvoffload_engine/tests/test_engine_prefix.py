"""Prefix cache through the host pool: cached blocks are loaded, only the suffix is computed."""

from __future__ import annotations

import pytest
import torch
from engine_support import prefill_engine, prefill_pool, seeded_prompt, tiny

from dsamodel.dense_reference import forward_dense
from kvoffload_engine.build import prefill_geometry
from kvoffload_engine.prefill import PrefillRequest

BS = 16
CHUNK = 256


def _prefill(eng, rid, prompt):
    res = eng.run(PrefillRequest(rid, prompt))
    eng.release(res)
    return res


def test_second_request_computes_only_its_suffix_and_matches_an_uncached_run():
    model = tiny(torch.float32, True)
    shared = seeded_prompt(512, 11)
    first = torch.cat((shared, seeded_prompt(88, 12)))
    second = torch.cat((shared, seeded_prompt(100, 13)))
    pool = prefill_pool(model, BS)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=CHUNK)
    fresh_pool = prefill_pool(model, BS)
    fresh = prefill_engine(model, fresh_pool, buffers=2, independent=[0], chunk_size=CHUNK)
    try:
        r1 = _prefill(eng, "r1", first)
        assert (r1.num_cached_tokens, r1.num_computed_tokens) == (0, 600)
        r2 = _prefill(eng, "r2", second)
        assert (r2.num_cached_tokens, r2.num_computed_tokens) == (512, 100)
        uncached = _prefill(fresh, "r2", second)  # chunks 0, 256, 512: the same boundaries as r1's
        assert uncached.num_computed_tokens == 612
        assert torch.equal(r2.logits, uncached.logits)
        torch.testing.assert_close(r2.logits, forward_dense(model, second)[-1], rtol=1e-4, atol=1e-4)
        again = _prefill(eng, "r3", second)  # the whole prompt is cached but for its last token
        assert again.num_computed_tokens == 612 - (611 // BS) * BS
        torch.testing.assert_close(again.logits, r2.logits, rtol=1e-4, atol=1e-4)
        assert pool.stats().live_leases == 0
    finally:
        for e, p in ((eng, pool), (fresh, fresh_pool)):
            e.close()
            p.close()


def test_leases_keep_the_prefix_from_being_evicted_while_it_is_loaded():
    from kvcore.pool.block_keys import block_keys
    from kvcore.pool.host_pool import PoolFullError

    model = tiny(torch.float32, True)
    shared = seeded_prompt(256, 21)
    block_bytes = prefill_geometry(model, BS, 1 << 20).block_bytes
    pool = prefill_pool(model, BS, 18 * block_bytes)  # 16 prefix blocks + 2 free
    eng = prefill_engine(model, pool, buffers=1, independent=[0], chunk_size=64)
    try:
        _prefill(eng, "r1", torch.cat((shared, seeded_prompt(10, 22))))
        prefix_keys = block_keys("tiny-test", shared, BS)
        assert pool.stats().used_blocks == 16 and all(pool.exists(prefix_keys))
        # r2 reuses the 16 prefix blocks and needs 4 more: only 2 are free, the rest are leased
        with pytest.raises(PoolFullError):
            _prefill(eng, "r2", torch.cat((shared, seeded_prompt(60, 23))))
        assert all(pool.exists(prefix_keys))  # nothing it was loading was evicted
        assert pool.stats().live_leases == 0 and pool.stats().used_blocks == 16  # r2 left nothing behind
        assert eng.gates.stats()["held_slots"] == 0
        # an unrelated prompt may evict the (now unleased) prefix, least recently used first
        other = seeded_prompt(60, 24)
        r3 = _prefill(eng, "r3", other)
        assert r3.num_computed_tokens == 60 and pool.stats().evictions == 2
        assert pool.exists(prefix_keys) == [False, False] + [True] * 14
        torch.testing.assert_close(r3.logits, forward_dense(model, other)[-1], rtol=1e-4, atol=1e-4)
    finally:
        eng.close()
        pool.close()


def test_a_hash_block_another_writer_is_filling_is_computed_into_a_copy_of_our_own():
    """Blocks 2 and 5 of the prompt are allocated (not written) by another writer: the prefill writes
    request-scoped copies of those two, hash objects of the rest, and its logits are the uncached
    ones; release drops the copies and leaves the other writer's objects alone."""
    from kvcore.pool.block_keys import block_keys, is_request_key

    model = tiny(torch.float32, True)
    prompt = seeded_prompt(200, 31)
    pool = prefill_pool(model, BS)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=64)
    try:
        hashes = block_keys("tiny-test", prompt, BS)
        pool.alloc([hashes[2], hashes[5]])
        res = eng.run(PrefillRequest("r1", prompt))
        copies = [b for b, k in enumerate(res.keys) if is_request_key(k)]
        assert copies == [2, 5, 12]  # 12: the partial tail block (200 = 12 * 16 + 8)
        assert [k for b, k in enumerate(res.keys) if b not in copies] == [
            h for b, h in enumerate(hashes) if b not in copies
        ]
        torch.testing.assert_close(res.logits, forward_dense(model, prompt)[-1], rtol=1e-4, atol=1e-4)
        eng.release(res)
        assert pool.exists(hashes) == [b not in (2, 5) for b in range(len(hashes))]
        assert not any(pool.exists([res.keys[b] for b in copies]))
        assert pool.stats().live_leases == 0
    finally:
        eng.close()
        pool.close()


class _CountingPool:
    """A pool that counts the calls made through it (everything else goes to the real one)."""

    def __init__(self, pool) -> None:
        self._pool, self.calls = pool, []

    def __getattr__(self, name):
        attr = getattr(self._pool, name)
        if name in ("exists", "alloc", "lease"):

            def counted(*args, **kwargs):
                self.calls.append(name)
                return attr(*args, **kwargs)

            return counted
        return attr


def test_pool_calls_per_chunk_do_not_grow_with_its_blocks():
    """A remote pool costs a round trip per call: a chunk of 64 blocks makes as many index calls
    as a chunk of 4."""
    model = tiny(torch.float32, True)
    counts = {}
    for chunk in (64, 1024):
        pool = _CountingPool(prefill_pool(model, BS))
        eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=chunk)
        try:
            _prefill(eng, "r", seeded_prompt(1024, 41))
            counts[chunk] = len(pool.calls)
        finally:
            eng.close()
            pool.close()
    # per chunk: exists, alloc, lease of what it writes; per request: a prefix exists and the hand-off
    # lease. The first chunk of 64 asks no exists (the prefix match just found its 4 blocks absent);
    # the one chunk of 1024 does (its last block ends with the prompt: the match never asks for it)
    assert counts == {64: 3 * 16 + 2 - 1, 1024: 3 + 2}, counts


class _DeadOwnerPool:
    """A real pool seen as a distributed store sees a dead owner's objects: keys in ``unreachable``
    are listed (``exists``) until a read meets them, which raises ``ObjectUnreachable`` and drops
    them from the listing (as Mooncake's backend force-removes them); an ``alloc`` of a dropped
    key replaces the stale object. ``planes`` limits the failing reads to those planes."""

    def __init__(self, pool, planes=None) -> None:
        self._pool, self.planes, self.failed_reads = pool, planes, 0
        self.unreachable: set[bytes] = set()
        self.gone: set[bytes] = set()

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def exists(self, keys):
        return [ok and k not in self.gone for k, ok in zip(keys, self._pool.exists(keys), strict=True)]

    def alloc(self, keys):
        stale = [k for k in keys if k in self.gone]
        self._pool.remove(stale)
        self.gone -= set(stale)
        return self._pool.alloc(keys)

    def get_into(self, keys, plane, dst):
        from kvcore.pool.host_pool import ObjectUnreachable

        dead = [k for k in keys if k in self.unreachable]
        if dead and (self.planes is None or plane in self.planes):
            self.unreachable -= set(dead)
            self.gone |= set(dead)
            self.failed_reads += 1
            raise ObjectUnreachable(f"{len(dead)} object(s) of a dead owner", key=dead[0])
        return self._pool.get_into(keys, plane, dst)


def test_an_unreachable_prefix_is_computed_again_in_the_same_request():
    """The cached prefix's owner is gone (its objects listed, their bytes not): the request does not
    fail, it runs again without that prefix, logs why, and its logits are the uncached ones."""
    from structlog.testing import capture_logs

    from kvcore.pool.block_keys import block_keys

    model = tiny(torch.float32, True)
    shared = seeded_prompt(300, 51)
    second = torch.cat((shared, seeded_prompt(40, 52)))
    pool = _DeadOwnerPool(prefill_pool(model, BS))
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=64)
    try:
        assert _prefill(eng, "r1", torch.cat((shared, seeded_prompt(30, 53)))).num_computed_tokens == 330
        pool.unreachable = set(block_keys("tiny-test", shared, BS)[: 300 // BS])
        with capture_logs() as logs:
            r2 = _prefill(eng, "r2", second)
        assert pool.failed_reads == 1
        assert (r2.num_cached_tokens, r2.num_computed_tokens) == (0, 340)
        torch.testing.assert_close(r2.logits, forward_dense(model, second)[-1], rtol=1e-4, atol=1e-4)
        [event] = [e for e in logs if e["event"] == "prefill_prefix_unreachable"]
        assert event["request_id"] == "r2" and "dead owner" in event["error"], event
        assert eng.gates.stats()["held_slots"] == 0 and pool.stats().live_leases == 0
        assert _prefill(eng, "r3", second).num_cached_tokens == 336  # written again: it hits
    finally:
        eng.close()
        pool.close()


def test_an_unreachable_prefix_after_a_layer_was_announced_fails_the_request():
    """Once a reader was told of a layer it may hold this try's rows: no second try, the error
    stands (I5), and nothing is left held."""
    from kvcore.pool.block_keys import block_keys
    from kvcore.pool.host_pool import ObjectUnreachable

    model = tiny(torch.float32, False)
    shared = seeded_prompt(200, 61)
    real = prefill_pool(model, BS)
    pool = _DeadOwnerPool(real, planes={real.geometry.plane_index(1, "main")})  # layer 1's reads fail
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=64)
    announced = []

    def announce(ticket, req, start, end):
        announced.append(ticket.layer)
        ticket.read_done(next(iter(ticket.readers)))

    try:
        _prefill(eng, "r1", torch.cat((shared, seeded_prompt(20, 62))))
        eng.announce = announce
        pool.unreachable = set(block_keys("tiny-test", shared, BS)[: 200 // BS])
        with pytest.raises(ObjectUnreachable, match="dead owner"):
            eng.run(PrefillRequest("r2", torch.cat((shared, seeded_prompt(20, 63))), readers=frozenset({"decode"})))
        assert announced == [0] and pool.failed_reads == 1
        assert eng.gates.stats()["held_slots"] == 0 and pool.stats().live_leases == 0
    finally:
        eng.close()
        pool.close()
