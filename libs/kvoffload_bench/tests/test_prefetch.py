"""kvoffload_bench.miss_predictors: the miss predictors scored on hand-made traces."""

from __future__ import annotations

import pytest
import torch

from kvcore.traces import Trace
from kvoffload_bench.miss_predictors import evaluate


def _trace(rows, layers=None, context0=10):
    topk = torch.tensor(rows, dtype=torch.int32)  # [S, T, k]
    n = topk.shape[0]
    z = torch.zeros(n, dtype=torch.int32)
    lay = torch.tensor(layers, dtype=torch.int32) if layers else z
    return Trace("t", topk, torch.full((n,), context0, dtype=torch.int64), lay, z, z)


def test_returning_neighbours_and_previous_layer_on_a_hand_trace():
    # layer 0: {1,2} {3,4} {1,2}; capacity = k: step 2 misses 1 and 2, which returning predicts
    # (selected 2 steps ago, not resident); neighbours of the tokens new at step 1 (3, 4) are
    # {2, 5} (3 and 4 are resident) -> 1 of 2 proposals right. Layer 1 selects at step 2 what layer 0
    # does, {1, 2}, after {5, 6} {7, 8}: previous_layer proposes {1, 2} -> both right.
    tr = _trace([[[1, 2], [3, 4], [1, 2]], [[5, 6], [7, 8], [1, 2]]], layers=[0, 1])
    out = evaluate(tr, 2, budget=2.0)
    # returning: layer 0's 1, 2 (right) and layer 1's 5, 6 (wrong: it selects 1, 2, never selected before)
    assert out["returning"] == {"recall": 0.5, "precision": 0.5, "loads_per_miss": 1.0}
    assert out["neighbours"]["recall"] == pytest.approx(1 / 4)  # 2 (layer 0); layer 1: neighbours of 7, 8 = 6, 9
    assert out["previous_layer"] == {"recall": 0.5, "precision": 1.0, "loads_per_miss": 0.5}


def test_nothing_resident_is_ever_proposed_and_budget_caps_returning():
    # capacity 4 > k: after step 1, 1 and 2 stay resident, so returning proposes nothing at step 2
    tr = _trace([[[1, 2], [3, 4], [1, 2]]])
    out = evaluate(tr, 4)
    assert out["returning"]["loads_per_miss"] == 0.0 and out["returning"]["recall"] == 0.0
    # budget: with 0.5 x last step's 2 misses, one of the two returning tokens is proposed
    tr = _trace([[[1, 2], [3, 4], [1, 2]]])
    assert evaluate(tr, 2, budget=0.5)["returning"] == {"recall": 0.5, "precision": 1.0, "loads_per_miss": 0.5}
