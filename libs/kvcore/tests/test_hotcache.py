"""kvcore.hotcache.cache: exact LRU and SLRU semantics, native == reference for every policy (CLOCK's own
hand-computed cases: test_hotcache_clock.py), invariants, validation, threads."""

from __future__ import annotations

import threading

import hotcache_support
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvcore.hotcache.cache import HotCache
from kvcore.hotcache.resolution import MAX_TOKEN, Resolution

BOTH = pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
POLICIES = pytest.mark.parametrize("policy", ["lru", "slru", "clock"])


def _t(rows: list[list[int]], dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)  # [rows, k]


def _same(a: Resolution, b: Resolution) -> None:
    for f in ("slots", "miss_rows", "miss_tokens", "miss_slots"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x, y), (f, x, y)
    assert (a.num_hits, a.num_misses) == (b.num_hits, b.num_misses)


# --- exact semantics on hand-computed cases ----------------------------------------------------


@BOTH
def test_first_step_fills_slots_in_order_and_duplicates_load_once(native):
    c = HotCache(4, 1, native=native, policy="lru")
    r = c.resolve(0, ["a"], _t([[5, 3, 5, -1]]), [10])
    assert r.slots.tolist() == [[0, 1, 0, -1]]
    assert r.miss_rows.tolist() == [0, 0] and r.miss_tokens.tolist() == [5, 3] and r.miss_slots.tolist() == [0, 1]
    assert (r.num_hits, r.num_misses) == (0, 2)
    assert r.slots.dtype == torch.int32 and r.miss_tokens.dtype == torch.int64
    assert c.residency("a", 0) == {5: 0, 3: 1}


@BOTH
def test_hits_keep_slots_and_misses_evict_least_recent(native):
    c = HotCache(3, 1, native=native, policy="lru")
    c.resolve(0, ["a"], _t([[10, 11, 12]]), [100])  # slots 0, 1, 2; LRU: 0 1 2
    r = c.resolve(0, ["a"], _t([[11, 13]]), [100])  # hit 11 -> LRU 0 2 1; 13 evicts slot 0
    assert r.slots.tolist() == [[1, 0]] and r.miss_tokens.tolist() == [13] and r.num_hits == 1
    r = c.resolve(0, ["a"], _t([[14, 15]]), [100])  # LRU 2 1 0: 14 -> 2, 15 -> 1
    assert r.slots.tolist() == [[2, 1]]
    assert c.residency("a", 0) == {13: 0, 14: 2, 15: 1}


@BOTH
def test_speculative_tokens_are_returned_but_not_kept(native):
    c = HotCache(4, 1, native=native, policy="lru")
    r = c.resolve(0, ["b"], _t([[1, 2, 3, 4]]), [3])  # 3, 4 >= S: loaded, then dropped
    assert r.slots.tolist() == [[0, 1, 2, 3]] and r.num_misses == 4
    assert c.residency("b", 0) == {1: 0, 2: 1}
    # dropped slots went to the least-recent end in ascending order: LRU 3 2 0 1
    r = c.resolve(0, ["b"], _t([[1, 7, 8]]), [10])
    assert r.slots.tolist() == [[0, 3, 2]] and r.num_hits == 1


@BOTH
def test_shrinking_stable_length_drops_tokens_at_or_past_it(native):
    c = HotCache(4, 1, native=native, policy="lru")
    c.resolve(0, ["a"], _t([[0, 1, 2, 3]]), [10])
    r = c.resolve(0, ["a"], _t([[0, 2]]), [2])  # 2 and 3 dropped first: 2 is a miss again
    assert r.num_hits == 1 and r.miss_tokens.tolist() == [2]
    assert 2 not in c.residency("a", 0) and 3 not in c.residency("a", 0)


@BOTH
def test_residency_is_per_request_not_per_row(native):
    c = HotCache(8, 2, native=native, policy="lru")
    c.resolve(0, ["a", "b"], _t([[1, 2], [3, 4]]), [9, 9])
    r = c.resolve(0, ["c", "b", "a"], _t([[1, 2], [3, 4], [1, 2]]), [9, 9, 9])  # reorder + join
    assert r.num_hits == 4 and r.miss_rows.tolist() == [0, 0] and r.miss_tokens.tolist() == [1, 2]
    assert c.residency("a", 1) == {}  # layers are independent
    assert c.finish("c") is True and c.finish("c") is False
    assert "c" not in c and c.residency("c", 0) == {} and c.stats()["requests"] == 2


@BOTH
def test_resident_reads_without_changing_state(native):
    c = HotCache(3, 2, native=native, policy="lru")
    c.resolve(0, ["a"], _t([[5, 3]]), [10])
    got = c.resident(0, ["a", "zz"], _t([[5, 4, -1, 3], [5, 4, -1, 3]]))
    assert got.dtype == torch.bool and got.tolist() == [[True, False, False, True], [False] * 4]
    assert c.resident(1, ["a"], _t([[5, 3]])).tolist() == [[False, False]]  # layers are independent
    assert "zz" not in c and c.residency("a", 0) == {5: 0, 3: 1} and c.stats()["steps"] == 1
    with pytest.raises(ValueError, match="int64"):
        c.resident(0, ["a"], _t([[5]], dtype=torch.int32))
    with pytest.raises(ValueError, match="2 entries but tokens has 1 rows"):
        c.resident(0, ["a", "b"], _t([[5]]))
    with pytest.raises(ValueError, match="layer = 2"):
        c.resident(2, ["a"], _t([[5]]))


@BOTH
def test_int32_topk_and_tensor_stable_lens(native):
    a, b = HotCache(6, 1, native=native, policy="lru"), HotCache(6, 1, native=native, policy="lru")
    rows = [[4, -1, 4, 0], [2, 5, 1, 3]]
    _same(
        a.resolve(0, ["x", "y"], _t(rows, torch.int32), torch.tensor([5, 3])),
        b.resolve(0, ["x", "y"], _t(rows), [5, 3]),
    )


@BOTH
def test_empty_batches(native):
    c = HotCache(4, 1, native=native, policy="lru")
    r = c.resolve(0, [], torch.empty(0, 3, dtype=torch.int64), [])
    assert r.slots.shape == (0, 3) and r.num_misses == 0
    r = c.resolve(0, ["a"], torch.empty(1, 0, dtype=torch.int64), [5])
    assert r.slots.shape == (1, 0) and r.miss_tokens.numel() == 0
    r = c.resolve(0, ["a"], _t([[-1, -1]]), [5])
    assert r.slots.tolist() == [[-1, -1]] and r.num_misses == 0


def test_stats_count_hits_misses_and_entries():
    c = HotCache(4, 1, policy="lru")
    c.resolve(0, ["a"], _t([[1, 2]]), [9])
    c.resolve(0, ["a"], _t([[1, 3]]), [9])
    s = c.stats()
    assert (s["steps"], s["entries"], s["hits"], s["misses"], s["requests"]) == (2, 4, 1, 3, 1)
    assert s["hit_rate"] == pytest.approx(0.25)


# --- validation: same message on both paths, no state change ------------------------------------

BAD_CALLS = [
    (dict(layer=2), "layer = 2 is out of range [0, 2)"),
    (dict(topk=_t([[1, -2]])), "topk[0, 1] = -2 is not a token index (>= 0) or -1 padding"),
    (dict(topk=_t([[1, 2], [3, -5]]), ids=["a", "new"], stable=[4, 4]), "topk[1, 1] = -5"),
    (dict(topk=_t([[MAX_TOKEN + 1, 0]])), f"exceeds the largest supported token index {MAX_TOKEN}"),
    (dict(topk=_t([[1, 2, 3, 4, 5]])), "topk has 5 columns but capacity is 4"),
    (dict(stable=[-1]), "stable_lens[0] = -1 must be >= 0"),
    (dict(stable=[1, 2]), "stable_lens has 2 entries but topk has 1 rows"),
    (dict(ids=["a", "a"], topk=_t([[1], [2]]), stable=[3, 3]), "request_ids[1] = 'a' appears twice"),
    (dict(ids=["a", "b"]), "request_ids has 2 entries but topk has 1 rows"),
    (dict(ids=["new", "new"], topk=_t([[1], [2]]), stable=[3, 3]), "request_ids[1] = 'new' appears twice"),
    (dict(topk=[[1, 2]], ids=["new"]), "topk must be an int32 or int64 tensor, got list"),
    (dict(layer=-1), "layer = -1 is out of range [0, 2)"),
    (dict(topk=torch.tensor([[1.0, 2.0]])), "topk must be an int32 or int64 tensor"),
    (dict(topk=_t([[1, 2], [3, 4]]).t()[:1]), "contiguous"),
    (dict(topk=_t([1, 2])), "[rows, k]"),
    (dict(stable=torch.tensor([1.5])), "stable_lens must be an integer tensor"),
]


@pytest.mark.parametrize("call,message", BAD_CALLS)
def test_invalid_calls_raise_the_same_valueerror_and_change_nothing(call, message):
    errors = []
    for native in (True, False):
        c = HotCache(4, 2, native=native, policy="lru")
        c.resolve(0, ["a"], _t([[7, 8]]), [10])
        before = c.residency("a", 0)
        with pytest.raises(ValueError) as e:
            c.resolve(
                call.get("layer", 0), call.get("ids", ["a"]), call.get("topk", _t([[1, 2]])), call.get("stable", [4])
            )
        errors.append(str(e.value))
        assert message in str(e.value)
        assert c.residency("a", 0) == before and "new" not in c and c.stats()["steps"] == 1
    assert errors[0] == errors[1]


def test_constructor_validation():
    with pytest.raises(ValueError, match="capacity"):
        HotCache(0, 1)
    with pytest.raises(ValueError, match="num_layers"):
        HotCache(4, 0, native=False)
    with pytest.raises(ValueError, match="policy = 'lfu' must be one of lru, slru, clock"):
        HotCache(4, 1, policy="lfu")


@BOTH
def test_slru_evicts_tokens_selected_once_before_tokens_hit_again(native):
    lru, slru = HotCache(4, 1, native=native, policy="lru"), HotCache(4, 1, native=native, policy="slru")
    for c in (lru, slru):
        c.resolve(0, ["a"], _t([[10, 11]]), [100])  # 10 -> slot 0, 11 -> slot 1 (probation)
        c.resolve(0, ["a"], _t([[10, 12]]), [100])  # hit 10 (slru: protected); 12 -> slot 2
        c.resolve(0, ["a"], _t([[13, 14]]), [100])  # 13 -> slot 3; 14 evicts the least recent
    # lru order before 14: 11 (slot 1), 10 (slot 0), 12, 13 -> evicts 11; slru probation: 11, 12, 13 -> 11 too
    assert lru.residency("a", 0) == slru.residency("a", 0) == {10: 0, 12: 2, 13: 3, 14: 1}
    r_lru = lru.resolve(0, ["a"], _t([[15, 16]]), [100])  # lru order: 10, 12, 13, 14 -> evicts 10, 12
    r_slru = slru.resolve(0, ["a"], _t([[15, 16]]), [100])  # probation 12, 13, 14 -> evicts 12, 13
    assert r_lru.miss_slots.tolist() == [0, 2] and r_slru.miss_slots.tolist() == [2, 3]
    assert 10 not in lru.residency("a", 0) and slru.residency("a", 0)[10] == 0
    # every probation slot selected now: the next miss takes the least-recent protected slot (10)
    r = slru.resolve(0, ["a"], _t([[15, 16, 14, 17]]), [100])
    assert r.num_hits == 3 and r.miss_tokens.tolist() == [17] and r.miss_slots.tolist() == [0]
    assert slru.stats()["policy"] == "slru" and lru.stats()["policy"] == "lru"


# --- property test: random step sequences, native == reference, invariants ----------------------

REQUESTS = ("r0", "r1", "r2", "r3", "r4")


def scenarios():
    return hotcache_support.scenarios(REQUESTS, max_batch=4)


def _check_invariants(res: Resolution, ids, topk, stable, before, after, capacity):
    seen_misses = set()
    for i, r in enumerate(res.miss_rows.tolist()):
        key = (r, int(res.miss_tokens[i]))
        assert key not in seen_misses  # each unique miss exactly once
        seen_misses.add(key)
        assert 0 <= int(res.miss_slots[i]) < capacity
    for r, rid in enumerate(ids):
        slot_of: dict[int, int] = {}
        hits = {t for t in topk[r] if t >= 0 and t in before[rid] and t < stable[r]}
        for j, t in enumerate(topk[r]):
            s = int(res.slots[r, j])
            if t < 0:
                assert s == -1
                continue
            assert 0 <= s < capacity
            assert slot_of.setdefault(t, s) == s  # duplicates share one slot
            if t < stable[r]:
                assert after[rid].get(t) == s  # the slot holds the token
            else:
                assert t not in after[rid]  # speculative tokens are not kept
            if t in hits:
                assert s == before[rid][t] and (r, t) not in seen_misses  # a hit is never reloaded
            else:
                assert (r, t) in seen_misses
        assert len(set(slot_of.values())) == len(slot_of)  # no slot holds two tokens
        assert len(set(after[rid].values())) == len(after[rid])
        assert all(t < stable[r] for t in after[rid])


@POLICIES
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_native_equals_reference_and_invariants_hold(policy, scenario):
    capacity, num_layers, steps = scenario
    native = HotCache(capacity, num_layers, native=True, policy=policy)
    ref = HotCache(capacity, num_layers, native=False, policy=policy)
    for layer, ids, k, topk, stable, finish, int32 in steps:
        t = torch.tensor(topk, dtype=torch.int32 if int32 else torch.int64).reshape(len(ids), k)  # [rows, k]
        before = {rid: native.residency(rid, layer) for rid in ids}
        a = native.resolve(layer, ids, t, stable)
        b = ref.resolve(layer, ids, t, stable)
        _same(a, b)
        after = {rid: native.residency(rid, layer) for rid in ids}
        assert after == {rid: ref.residency(rid, layer) for rid in ids}
        _check_invariants(a, ids, topk, stable, before, after, capacity)
        probe_ids = [*ids, "never-seen"]  # resident(): the residency maps, read-only, on both paths
        probe = torch.tensor([[-1, 0, 1, 2, 3, 5, 8, 13, 2**31 - 2]] * len(probe_ids), dtype=torch.int64)
        probe[: len(ids), : min(k, 3)] = t[:, :3].to(torch.int64)
        want = [[int(x) in after.get(rid, {}) for x in row] for rid, row in zip(probe_ids, probe.tolist(), strict=True)]
        steps_before = native.stats()["steps"]
        assert native.resident(layer, probe_ids, probe).tolist() == want
        assert ref.resident(layer, probe_ids, probe).tolist() == want
        assert native.stats()["steps"] == steps_before
        assert {rid: native.residency(rid, layer) for rid in ids} == after
        for rid in finish:
            assert native.finish(rid) == ref.finish(rid)
            assert rid not in native and all(native.residency(rid, L) == {} for L in range(num_layers))
        assert native.stats() | {"native": None} == ref.stats() | {"native": None}


# --- threads: the native path releases the GIL; disjoint layers may run concurrently -----------


def test_concurrent_layers_match_sequential():
    g = torch.Generator().manual_seed(0)
    layers, steps = 4, 6
    topks = [[torch.randint(-1, 300, (3, 64), generator=g) for _ in range(steps)] for _ in range(layers)]
    ids, stable = ["a", "b", "c"], [250, 300, 200]
    seq = HotCache(128, layers)
    expected = [[seq.resolve(L, ids, topks[L][s], stable) for s in range(steps)] for L in range(layers)]
    par = HotCache(128, layers)
    got: list[list[Resolution]] = [[] for _ in range(layers)]
    barrier = threading.Barrier(layers)

    def worker(L):
        barrier.wait()
        for s in range(steps):
            got[L].append(par.resolve(L, ids, topks[L][s], stable))

    threads = [threading.Thread(target=worker, args=(L,)) for L in range(layers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for L in range(layers):
        for s in range(steps):
            _same(got[L][s], expected[L][s])
    assert par.stats() | {"native": None} == seq.stats() | {"native": None}


@POLICIES
def test_large_batch_uses_parallel_rows_and_matches_reference(policy):
    g = torch.Generator().manual_seed(1)
    ids = [f"q{i}" for i in range(8)]
    native, ref = HotCache(512, 1, policy=policy), HotCache(512, 1, native=False, policy=policy)
    for _ in range(4):
        topk = torch.randint(-1, 2000, (8, 256), generator=g)
        stable = torch.randint(1500, 2001, (8,), generator=g)
        _same(native.resolve(0, ids, topk, stable), ref.resolve(0, ids, topk, stable))


@POLICIES
@pytest.mark.parametrize("capacity,keep", [(8, 0.9), (40, 0.95), (40, 0.5)])
def test_long_runs_match_reference(policy, capacity, keep):
    """Hundreds of steps with locality (the native lists' rings wrap around, their blocks change
    size with k); stable lengths mostly grow, sometimes shrink; requests finish and rejoin."""
    g = torch.Generator().manual_seed(capacity + int(keep * 100))
    ids = ["a", "b", "c"]
    native, ref = HotCache(capacity, 2, policy=policy), HotCache(capacity, 2, native=False, policy=policy)
    context = 4 * capacity
    prev = {rid: torch.randint(0, context, (capacity,), generator=g) for rid in ids}
    for step in range(300):
        layer = step % 2 if step % 50 >= 40 else 0
        k = int(torch.randint(max(1, capacity // 2), capacity + 1, (1,), generator=g))
        rows = []
        for rid in ids:  # mostly last step's tokens, a few new ones, duplicates and padding
            old = prev[rid][torch.randperm(prev[rid].numel(), generator=g)][:k]
            new = torch.randint(0, context + 3, (k,), generator=g)
            row = torch.where(torch.rand(k, generator=g) < keep, old[torch.arange(k) % old.numel()], new)
            row[torch.rand(k, generator=g) < 0.05] = -1
            prev[rid] = row[row >= 0] if (row >= 0).any() else new
            rows.append(row)
        context += 1
        stable = [context - int(torch.randint(0, 3, (1,), generator=g)) for _ in ids]
        if step % 37 == 36:
            stable[1] = context // 2  # shrinks: drops resident tokens
        topk = torch.stack(rows)  # [3, k]
        _same(native.resolve(layer, ids, topk, stable), ref.resolve(layer, ids, topk, stable))
        if step % 60 == 59:
            assert native.finish("c") and ref.finish("c")
        if step % 25 == 0:
            assert native.residency("a", layer) == ref.residency("a", layer)
    assert native.stats() | {"native": None} == ref.stats() | {"native": None}


@pytest.mark.parametrize("policy", ["lru", "clock"])  # (slru shares lru's code paths)
@pytest.mark.parametrize("capacity", [32766, 32767])  # the last 16-bit-map capacity, the first 32-bit one
def test_both_token_map_widths_match_reference(capacity, policy):
    """Every slot in use (slot numbers up to capacity - 1), evictions, padding, a shrink and
    ``resident`` past the mapped tokens, on either side of the native map's width switch."""
    g = torch.Generator().manual_seed(capacity)
    native, ref = HotCache(capacity, 1, policy=policy), HotCache(capacity, 1, native=False, policy=policy)
    context = 3 * capacity
    first = torch.randperm(context, generator=g)[:capacity]
    rows = [
        first,
        torch.cat((first[: capacity // 2], torch.randperm(context, generator=g)[: capacity - capacity // 2])),
    ]
    for step, row in enumerate(rows + [torch.where(torch.rand(capacity, generator=g) < 0.1, -1, rows[1])]):
        stable = [context if step < 2 else context // 2]
        topk = row[None].contiguous()
        _same(native.resolve(0, ["a"], topk, stable), ref.resolve(0, ["a"], topk, stable))
        assert native.residency("a", 0) == ref.residency("a", 0)
    probe = torch.cat((rows[1][:64], torch.tensor([-1, context + 5, 2**31 - 2])))[None].contiguous()
    assert torch.equal(native.resident(0, ["a"], probe), ref.resident(0, ["a"], probe))


@POLICIES
def test_alternating_working_sets_match_reference(policy):
    """Two working sets that fit together and take turns: every step is all hits on slots that
    were not selected in the step before, for hundreds of steps (the native rings then fill with
    superseded entries and must compact), with a few speculative tokens and new tokens mixed in."""
    g = torch.Generator().manual_seed(7)
    native, ref = HotCache(16, 1, policy=policy), HotCache(16, 1, native=False, policy=policy)
    sets = [list(range(0, 7)), list(range(100, 107))]
    for step in range(400):
        row = list(sets[step % 2])
        if step % 9 == 0:
            row[int(torch.randint(0, 7, (1,), generator=g))] = 200 + step  # a new token (miss)
        if step % 13 == 0:
            row.append(10**6)  # speculative: loaded, then dropped to the least-recent end
        order = torch.randperm(len(row), generator=g).tolist()
        topk = torch.tensor([[row[i] for i in order]])
        _same(native.resolve(0, ["a"], topk, [10**6]), ref.resolve(0, ["a"], topk, [10**6]))
    assert native.residency("a", 0) == ref.residency("a", 0)
