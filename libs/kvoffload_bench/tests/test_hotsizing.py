"""kvoffload_bench.hotsizing: greedy per-layer sizing on hand-made curves."""

from __future__ import annotations

import pytest

from kvoffload_bench.hotsizing import hits_at, size_layers


def test_slots_go_where_they_buy_the_most_hits():
    curves = {0: [(4, 10), (6, 30), (8, 31)], 1: [(4, 10), (6, 12), (8, 40)]}
    # budget 12: start 4 + 4; layer 0 gains 10/slot to 6, layer 1 gains 1/slot -> layer 0 to 6;
    # then layer 0 -> 8 gains 0.5/slot, layer 1 -> 6 gains 1/slot: budget 12 allows 2 more -> layer 1 to 6
    assert size_layers(curves, 12) == {0: 6, 1: 6}
    assert hits_at(curves, {0: 6, 1: 6}) == 42
    assert size_layers(curves, 16) == {0: 8, 1: 8}
    assert size_layers(curves, 8) == {0: 4, 1: 4}


def test_budget_below_the_minimum_and_bad_curves_are_refused():
    with pytest.raises(ValueError, match="below the smallest"):
        size_layers({0: [(4, 1)], 1: [(4, 1)]}, 7)
    with pytest.raises(ValueError, match="ascending"):
        size_layers({0: [(6, 1), (4, 2)]}, 10)
    assert size_layers({}, 10) == {}
