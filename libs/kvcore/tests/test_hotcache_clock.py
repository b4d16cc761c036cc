"""kvcore.hotcache.cache's ``"clock"`` policy on hand-computed cases, both paths: the hand's sweep (set bits
cleared, slots selected in the step passed over unchanged, a second turn when one is not enough), a
new token's clear bit, emptied slots left where the hand finds them, the native epochs' wrap, and
the config accepting the policy. Random step sequences (native == reference, invariants) run in
test_hotcache.py for every policy."""

from __future__ import annotations

import pytest
import torch

from kvcore.config.names import HOT_CACHE_POLICIES, SPARSE_KEY
from kvcore.config.parse import parse_additional_config
from kvcore.hotcache.cache import POLICIES, HotCache

BOTH = pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])


def _t(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)  # [rows, k]


def _step(c: HotCache, row: list[int], stable: int = 100) -> list[int]:
    """One step of request "a" on layer 0: the slots of ``row``."""
    return c.resolve(0, ["a"], _t([row]), [stable]).slots[0].tolist()


@BOTH
def test_hits_set_bits_and_the_hand_clears_them_on_its_way(native):
    c = HotCache(4, 1, native=native, policy="clock")
    assert _step(c, [10, 11, 12]) == [0, 1, 2]  # the hand takes empty slots 0, 1, 2 in turn; stops at 3
    assert _step(c, [11, 13]) == [1, 3]  # hit 11 sets slot 1's bit; 13 takes empty slot 3; hand at 0
    # 14: slot 0 (10: loaded, never hit, bit clear) -> taken; 15: slot 1 (11, set) cleared, slot 2 taken
    # (were a new token's bit set, the hand would clear 10, 11, 12, 13 and take slot 0, then slot 1)
    assert _step(c, [14, 15]) == [0, 2]
    assert c.residency("a", 0) == {14: 0, 11: 1, 15: 2, 13: 3}
    assert _step(c, [11, 16, 17]) == [1, 3, 0]  # hit 11 (set again); hand 3: 13 out, then 14 out; hand at 1
    _step(c, [16, 17])
    _step(c, [15])  # every slot's bit now set (17, 11, 15, 16); the hand at slot 1
    # hit 11 selects slot 1. 20: slot 1 selected (passed over, its bit kept), 2, 3, 0 cleared, slot 1
    # passed again, slot 2 (15, cleared in the first turn) taken: two turns of the hand
    r = c.resolve(0, ["a"], _t([[11, 20]]), [100])
    assert r.slots.tolist() == [[1, 2]] and r.num_hits == 1 and r.miss_tokens.tolist() == [20]
    assert _step(c, [21]) == [3]  # 16's bit was cleared by the two turns
    # 11 kept its bit while selected: 22 takes slot 0 (17, cleared), 23 clears 11 and takes slot 2 (20)
    assert _step(c, [22, 23]) == [0, 2]
    assert c.residency("a", 0) == {22: 0, 11: 1, 23: 2, 21: 3}


@BOTH
def test_duplicates_and_padding_take_one_slot(native):
    c = HotCache(3, 1, native=native, policy="clock")
    r = c.resolve(0, ["a"], _t([[7, -1, 7]]), [100])
    assert r.slots.tolist() == [[0, -1, 0]] and r.miss_tokens.tolist() == [7] and r.num_misses == 1
    r = c.resolve(0, ["a"], _t([[8, 7, 8]]), [100])  # hit 7 counted once; 8 loaded once
    assert r.slots.tolist() == [[1, 0, 1]] and (r.num_hits, r.num_misses) == (1, 1)


@BOTH
def test_speculative_and_dropped_slots_are_emptied_where_they_are(native):
    c = HotCache(4, 1, native=native, policy="clock")
    r = c.resolve(0, ["b"], _t([[1, 2, 3, 4]]), [3])  # 3, 4 >= S: loaded into 2, 3, then dropped
    assert r.slots.tolist() == [[0, 1, 2, 3]] and r.num_misses == 4
    assert c.residency("b", 0) == {1: 0, 2: 1}
    # the hand (back at 0) does not jump to the emptied slots: 1 is selected (passed over), 7 takes
    # slot 1 (2, bit clear), 8 the empty slot 2
    r = c.resolve(0, ["b"], _t([[1, 7, 8]]), [10])
    assert r.slots.tolist() == [[0, 1, 2]] and r.num_hits == 1 and r.miss_slots.tolist() == [1, 2]
    # the stable length shrinks to 7: 7 and 8 are dropped first; 7 is then a speculative miss again
    r = c.resolve(0, ["b"], _t([[1, 7]]), [7])
    assert r.slots.tolist() == [[0, 3]] and r.num_hits == 1 and r.miss_tokens.tolist() == [7]
    assert c.residency("b", 0) == {1: 0}
    assert c.stats()["policy"] == "clock"


@BOTH
def test_a_slot_selected_a_full_epoch_round_ago_is_not_selected_now(native):
    """The native path marks a slot selected in a step with the step's 15-bit epoch and resets every
    mark when the epochs wrap (step 32768 of a (request, layer) reuses epoch 1): the slot of a token
    last selected in step 1 must not look selected in step 32768 (a hit there counts, the hand's
    clearing and sweep treat it as any other slot)."""
    c = HotCache(2, 1, native=native, policy="clock")
    assert _step(c, [5]) == [0]  # step 1: 5 -> slot 0, then not selected until step 32768
    assert _step(c, [6]) == [1]  # step 2: 6 -> slot 1; the hand at slot 0
    one = _t([[6]])
    for _ in range(3, 32768):  # steps 3 .. 32767: 6 hit every step, no miss moves the hand
        c.resolve(0, ["a"], one, [100])
    r = c.resolve(0, ["a"], _t([[5, 7]]), [100])  # step 32768: hit 5 (slot 0); 7: both bits set, two turns
    assert r.slots.tolist() == [[0, 1]] and (r.num_hits, r.num_misses) == (1, 1)
    assert c.residency("a", 0) == {5: 0, 7: 1}
    # step 32769: 5 kept its bit through step 32768's turns (selected); 8 clears it and takes slot 1 (7)
    assert _step(c, [8]) == [1]
    assert _step(c, [9]) == [0]


def test_the_policy_is_listed_and_configurable():
    assert POLICIES == HOT_CACHE_POLICIES and "clock" in POLICIES
    sparse = parse_additional_config({SPARSE_KEY: {"hot_cache_policy": "clock"}}).sparse
    assert sparse.hot_cache_policy == "clock"
