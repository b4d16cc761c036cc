"""The store's keys under tensor parallel (``kvoffload_vllm.store_tp``): each rank of a head-split
model keeps its blocks under keys of its own, a prefix is a hit only where every rank's blocks are
present, and where every rank holds the same KV one rank saves under the model's keys."""

from __future__ import annotations

from kvoffload_vllm.plan import Transfer
from kvoffload_vllm.store_tp import RankKeys, rank_key

KEYS = [bytes([i]) * 32 for i in range(4)]


def test_each_rank_has_keys_of_its_own_and_none_is_the_models_or_another_tps():
    seen = {rank_key(k, r, 2) for k in KEYS for r in range(2)} | {rank_key(k, 0, 4) for k in KEYS}
    assert len(seen) == 3 * len(KEYS) and not seen & set(KEYS)
    assert all(len(k) == 32 for k in seen)
    assert rank_key(KEYS[0], 1, 2) == rank_key(KEYS[0], 1, 2)


def test_a_hit_is_the_run_every_rank_holds():
    held = {rank_key(k, 0, 2) for k in KEYS} | {rank_key(k, 1, 2) for k in KEYS[:2]}
    asked: list[list[bytes]] = []

    def exists(keys: list[bytes]) -> list[bool]:
        asked.append(keys)
        return [k in held for k in keys]

    assert RankKeys(0, 2).exists(exists)(KEYS) == [True, True, False, False]
    assert len(asked) == 2  # one Exists per rank
    assert RankKeys(0, 2, copies=True).exists(exists)(KEYS) == [False] * 4  # the model's keys: none held


def test_each_rank_runs_the_step_under_its_keys_and_copies_are_saved_by_rank_0_only():
    load, save = Transfer("r", tuple(KEYS[:2]), (5, 6)), Transfer("r", tuple(KEYS[2:]), (7, 8), start=2)
    loads, saves = RankKeys(1, 2).mine([load], [save])
    assert loads[0].keys == tuple(rank_key(k, 1, 2) for k in KEYS[:2]) and loads[0].block_ids == (5, 6)
    assert saves[0].keys == tuple(rank_key(k, 1, 2) for k in KEYS[2:]) and saves[0].start == 2
    assert RankKeys(0, 2, copies=True).mine([load], [save]) == ([load], [save])
    assert RankKeys(1, 2, copies=True).mine([load], [save]) == ([load], [])
