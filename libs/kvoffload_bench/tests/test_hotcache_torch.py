"""kvoffload_bench.hotcache_torch: the vectorized torch HotCache has exactly the reference's semantics
(the hot-cache bench's torch baseline is only meaningful if it computes the same thing)."""

from __future__ import annotations

import hotcache_support
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvcore.hotcache.cache import HotCache
from kvcore.hotcache.resolution import MAX_TOKEN, Resolution
from kvoffload_bench.hotcache_torch import TorchHotCache


def _t(rows: list[list[int]], dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)  # [rows, k]


def _same(a: Resolution, b: Resolution) -> None:
    for f in ("slots", "miss_rows", "miss_tokens", "miss_slots"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (f, x, y)
    assert (a.num_hits, a.num_misses) == (b.num_hits, b.num_misses)


def _stats(c: HotCache) -> dict:
    return {k: v for k, v in c.stats().items() if k not in ("native", "impl")}


# --- the hand-computed cases of test_hotcache.py, on the torch path -----------------------------


def test_first_step_hits_evictions_and_duplicates():
    c = TorchHotCache(4, 1)
    r = c.resolve(0, ["a"], _t([[5, 3, 5, -1]]), [10])
    assert r.slots.tolist() == [[0, 1, 0, -1]] and r.miss_tokens.tolist() == [5, 3] and r.miss_slots.tolist() == [0, 1]
    assert (r.num_hits, r.num_misses) == (0, 2) and c.residency("a", 0) == {5: 0, 3: 1}
    c = TorchHotCache(3, 1)
    c.resolve(0, ["a"], _t([[10, 11, 12]]), [100])
    r = c.resolve(0, ["a"], _t([[11, 13]]), [100])
    assert r.slots.tolist() == [[1, 0]] and r.miss_tokens.tolist() == [13] and r.num_hits == 1
    r = c.resolve(0, ["a"], _t([[14, 15]]), [100])
    assert r.slots.tolist() == [[2, 1]] and c.residency("a", 0) == {13: 0, 14: 2, 15: 1}


def test_speculative_and_shrinking_stable_length():
    c = TorchHotCache(4, 1)
    r = c.resolve(0, ["b"], _t([[1, 2, 3, 4]]), [3])
    assert r.slots.tolist() == [[0, 1, 2, 3]] and r.num_misses == 4 and c.residency("b", 0) == {1: 0, 2: 1}
    r = c.resolve(0, ["b"], _t([[1, 7, 8]]), [10])  # LRU 3 2 0 1
    assert r.slots.tolist() == [[0, 3, 2]] and r.num_hits == 1
    c = TorchHotCache(4, 1)
    c.resolve(0, ["a"], _t([[0, 1, 2, 3]]), [10])
    r = c.resolve(0, ["a"], _t([[0, 2]]), [2])
    assert r.num_hits == 1 and r.miss_tokens.tolist() == [2] and c.residency("a", 0) == {0: 0, 1: 1}


def test_resident_reads_without_changing_state():
    c = TorchHotCache(3, 2)
    c.resolve(0, ["a"], _t([[5, 3]]), [10])
    got = c.resident(0, ["a", "zz"], _t([[5, 4, -1, 3], [5, 4, -1, 3]]))
    assert got.dtype == torch.bool and got.tolist() == [[True, False, False, True], [False] * 4]
    assert c.resident(1, ["a"], _t([[5, 3]])).tolist() == [[False, False]]  # layers are independent
    assert c.resident(0, ["a"], _t([[-2, 100, MAX_TOKEN]])).tolist() == [[False] * 3]
    assert "zz" not in c and c.residency("a", 0) == {5: 0, 3: 1} and c.stats()["steps"] == 1


def test_requests_join_leave_reorder_and_handles_are_reused():
    c, ref = TorchHotCache(8, 2), HotCache(8, 2, native=False, policy="lru")
    calls = [
        (0, ["a", "b"], [[1, 2], [3, 4]]),
        (0, ["c", "b", "a"], [[1, 2], [3, 4], [1, 2]]),
        (1, ["b"], [[9, 9]]),
        (0, ["d", "e", "f", "a"], [[5, 6], [7, 8], [1, 3], [2, 1]]),  # grows the handle table
        (0, ["c", "g"], [[1, 2], [1, 2]]),  # g reuses a finished request's handle: starts empty
    ]
    for i, (layer, ids, rows) in enumerate(calls):
        _same(c.resolve(layer, ids, _t(rows), [9] * len(ids)), ref.resolve(layer, ids, _t(rows), [9] * len(ids)))
        if i == 3:
            assert c.finish("b") and ref.finish("b") and not c.finish("b")
        for rid in ids:
            assert c.residency(rid, layer) == ref.residency(rid, layer)
    assert "b" not in c and c.residency("b", 0) == {} and _stats(c) == _stats(ref)


def test_large_tokens_grow_the_map_and_empty_batches():
    c, ref = TorchHotCache(4, 1), HotCache(4, 1, native=False, policy="lru")
    for rows in ([[1, 2]], [[100_000, 1]], [[7, 100_000]], [[3_000_000, -1]]):
        _same(c.resolve(0, ["a"], _t(rows), [10**7]), ref.resolve(0, ["a"], _t(rows), [10**7]))
    r = c.resolve(0, [], torch.empty(0, 3, dtype=torch.int64), [])
    assert r.slots.shape == (0, 3) and r.num_misses == 0
    _same(
        c.resolve(0, ["x"], torch.empty(1, 0, dtype=torch.int64), [5]),
        ref.resolve(0, ["x"], torch.empty(1, 0, dtype=torch.int64), [5]),
    )
    _same(c.resolve(0, ["x"], _t([[-1, -1]]), [5]), ref.resolve(0, ["x"], _t([[-1, -1]]), [5]))


BAD_CALLS = [
    (dict(topk=_t([[1, -2]])), "topk[0, 1] = -2 is not a token index (>= 0) or -1 padding"),
    (dict(topk=_t([[1, 2], [3, -5]]), ids=["a", "new"], stable=[4, 4]), "topk[1, 1] = -5"),
    (dict(topk=_t([[1, 2], [MAX_TOKEN + 1, 0]]), ids=["a", "new"], stable=[-1, 4]), "stable_lens[0] = -1"),
    (dict(topk=_t([[1, 2], [MAX_TOKEN + 1, 0]]), ids=["a", "new"], stable=[4, -1]), "stable_lens[1] = -1"),
    (dict(topk=_t([[MAX_TOKEN + 1, -3]])), f"exceeds the largest supported token index {MAX_TOKEN}"),
    (dict(topk=_t([[1, 2, 3, 4, 5]])), "topk has 5 columns but capacity is 4"),
    (dict(layer=2), "layer = 2 is out of range [0, 2)"),
    (dict(ids=["a", "a"], topk=_t([[1], [2]]), stable=[3, 3]), "request_ids[1] = 'a' appears twice"),
]


@pytest.mark.parametrize("call,message", BAD_CALLS)
def test_invalid_calls_raise_the_references_valueerror_and_change_nothing(call, message):
    errors = []
    for c in (TorchHotCache(4, 2), HotCache(4, 2, native=False, policy="lru")):
        c.resolve(0, ["a"], _t([[7, 8]]), [10])
        with pytest.raises(ValueError) as e:
            c.resolve(
                call.get("layer", 0), call.get("ids", ["a"]), call.get("topk", _t([[1, 2]])), call.get("stable", [4])
            )
        errors.append(str(e.value))
        assert message in str(e.value)
        assert c.residency("a", 0) == {7: 0, 8: 1} and "new" not in c and c.stats()["steps"] == 1
    assert errors[0] == errors[1]


# --- property test: random step sequences, torch == reference ------------------------------------

REQUESTS = ("r0", "r1", "r2", "r3", "r4", "r5")
PROBE = torch.tensor([[*range(-2, 64), MAX_TOKEN]] * len(REQUESTS))  # [requests, n]: padding, tokens, past all


def scenarios():
    return hotcache_support.scenarios(REQUESTS, max_batch=5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_torch_equals_reference(scenario):
    capacity, num_layers, steps = scenario
    vec, ref = TorchHotCache(capacity, num_layers), HotCache(capacity, num_layers, native=False, policy="lru")
    for layer, ids, k, topk, stable, finish, int32 in steps:
        t = torch.tensor(topk, dtype=torch.int32 if int32 else torch.int64).reshape(len(ids), k)  # [rows, k]
        _same(vec.resolve(layer, ids, t, stable), ref.resolve(layer, ids, t, stable))
        for rid in REQUESTS:
            assert (rid in vec) == (rid in ref)
            for L in range(num_layers):
                assert vec.residency(rid, L) == ref.residency(rid, L)
        for L in range(num_layers):
            assert torch.equal(vec.resident(L, list(REQUESTS), PROBE), ref.resident(L, list(REQUESTS), PROBE))
        for rid in finish:
            assert vec.finish(rid) == ref.finish(rid)
        assert _stats(vec) == _stats(ref)


def test_threads_apply_during_a_call_only():
    before = torch.get_num_threads()
    c = TorchHotCache(4, 1, threads=1)
    _same(c.resolve(0, ["a"], _t([[1, 2]]), [9]), TorchHotCache(4, 1).resolve(0, ["a"], _t([[1, 2]]), [9]))
    assert torch.get_num_threads() == before and c.stats()["impl"] == "torch"
    with pytest.raises(ValueError, match="stable_lens"):
        c.resolve(0, ["a"], _t([[1, 2]]), [-1])
    assert torch.get_num_threads() == before


def test_torch_equals_native_on_a_bench_like_trace():
    from kvcore.traces import generate, preset

    tr = generate(
        preset(
            "overlap80",
            k=128,
            context0=2000,
            steps=12,
            layers=1,
            requests=4,
            sinks=4,
            recent=16,
            heavy=16,
            span=8,
            seed=3,
        )
    )
    ids = [f"q{i}" for i in range(4)]
    vec, native = TorchHotCache(256, 1), HotCache(256, 1, policy="lru")
    for i in range(tr.steps):
        topk = tr.topk[:, i].contiguous()
        stable = [2000 - 50 * (i % 3)] * 4  # shrinks now and then; some tokens are speculative
        _same(vec.resolve(0, ids, topk, stable), native.resolve(0, ids, topk, stable))
