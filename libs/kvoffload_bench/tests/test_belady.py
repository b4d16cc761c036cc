"""kvoffload_bench.belady: the offline optimum on hand-checked traces, and never below any policy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.hotcache.cache import HotCache
from kvoffload_bench import belady


def test_next_use():
    steps = np.array([[1, 2], [2, 3], [1, -1]])
    never = belady._NEVER
    assert belady.next_use(steps).tolist() == [[2, 1], [never, never], [never, never]]


def test_hand_checked_capacity_three():
    # k = 2, capacity 3: one spare slot. Steps {1,2} {3,4} {1,5} {2,6}.
    # Step 1: keep S={3,4} + one of {1,2}: 1 is next used at step 2, 2 at step 3 -> keep 1.
    # Step 2: hit 1; resident {3,4,1} -> keep {1,5} + nearest next use of {3,4}: never -> either.
    # Step 3: 2 and 6 miss. Hits: 1 in total.
    steps = np.array([[1, 2], [3, 4], [1, 5], [2, 6]])
    assert belady.stream_hits(steps, 3) == (1, 7)
    assert belady.stream_hits(steps, 2) == (0, 8)  # no spare slot: nothing survives a step unused
    assert belady.stream_hits(steps, 6) == (2, 6)  # everything fits: 1 and 2 both come back


def test_duplicates_and_padding_count_once():
    steps = np.array([[1, 1, -1], [1, 2, -1]])
    assert belady.stream_hits(steps, 3) == (1, 2)


def test_capacity_below_k_is_refused():
    with pytest.raises(ValueError, match="below k"):
        belady.stream_hits(np.array([[1, 2, 3]]), 2)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 6),
    st.integers(0, 4),
    st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=6), min_size=1, max_size=12),
)
def test_belady_is_never_beaten_and_equals_the_policies_without_a_choice(k, spare, rows):
    steps = np.full((len(rows), k), -1, dtype=np.int64)
    for t, row in enumerate(rows):
        uniq = list(dict.fromkeys(row))[:k]
        steps[t, : len(uniq)] = uniq
    cap = k + spare
    b_hits, b_misses = belady.stream_hits(steps, cap)
    for policy in ("lru", "slru"):
        c = HotCache(cap, 1, policy=policy)
        for t in range(len(rows)):
            c.resolve(0, ["s"], torch.tensor(steps[t : t + 1]), [100])
        s = c.stats()
        assert s["hits"] + s["misses"] == b_hits + b_misses
        assert s["hits"] <= b_hits
        if spare == 0 and bool((steps >= 0).all()):  # full rows, no spare slot: nothing to choose
            assert s["hits"] == b_hits
