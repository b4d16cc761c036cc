"""kvcore.bench: both benches run with tiny parameters and report consistent fields (no timing goals)."""

from __future__ import annotations

import json

from kvcore.bench import BENCHES, gather, hotcache


def test_hotcache_bench_fields():
    out = hotcache.run(rows=2, topk=64, capacity=128, context=1024, overlaps=(0.5, 0.9), steps=4, reference_steps=2, warmup=1)
    json.dumps(out)
    assert out["bench"] == "hotcache" and out["threads"] >= 1
    assert len(out["cases"]) == 2 and set(out["goals_met"]) == {"speedup", "speedup_vs_torch", "entries_per_s"}
    assert set(out["goals"]) == set(out["goals_met"]) and out["torch_threads_tried"][0] == 1
    for case in out["cases"]:
        assert case["native_s_per_step"] > 0 and case["torch_s_per_step"] > 0 and case["reference_s_per_step"] > 0
        assert case["speedup"] > 0 and case["entries_per_s"] > 0
        assert abs(case["speedup_vs_torch"] - case["torch_s_per_step"] / case["native_s_per_step"]) < 1e-9
        assert case["torch_s_per_step"] == min(case["torch_s_per_step_by_threads"].values())
        assert case["torch_s_per_step_by_threads"][str(case["torch_threads"])] == case["torch_s_per_step"]
        assert 0 <= case["hit_rate"] <= 1 and case["outputs_equal"] is True and case["torch_outputs_equal"] is True
    assert out["outputs_equal"] is True
    assert out["speedup"] == min(c["speedup"] for c in out["cases"])
    assert out["speedup_vs_torch"] == min(c["speedup_vs_torch"] for c in out["cases"])
    assert out["entries_per_s"] == min(c["entries_per_s"] for c in out["cases"])
    assert out["goals_met"]["speedup"] == (out["speedup"] >= 10)
    assert out["goals_met"]["speedup_vs_torch"] == (out["speedup_vs_torch"] >= 1)
    assert out["cases"][1]["hit_rate"] > out["cases"][0]["hit_rate"]  # more overlap, more hits


def test_hotcache_trace_overlap():
    import torch

    tr = hotcache.trace(3, 50, 400, 0.8, 3, torch.Generator().manual_seed(0))
    for a, b in zip(tr, tr[1:]):
        assert b.shape == (3, 50)
        for r in range(3):
            assert len(set(b[r].tolist())) == 50
            assert len(set(a[r].tolist()) & set(b[r].tolist())) == 40


def test_gather_bench_fields():
    out = gather.run(rows=2, misses_per_row=64, row_bytes=(3, 576), block_size=16, pool_gib=0.01, context=512, capacity=128, reps=2)
    json.dumps(out)
    assert out["bench"] == "gather" and out["threads"] >= 1 and out["pool_bytes"] == int(0.01 * 2**30)
    assert [c["row_bytes"] for c in out["cases"]] == [3, 576]
    for case in out["cases"]:
        assert case["native_gbps"] > 0 and case["torch_gbps"] > 0 and case["memcpy_gbps"] > 0
        assert case["bytes"] == 2 * 64 * case["row_bytes"] and case["equal"] is True
        assert abs(case["ratio_to_memcpy"] - case["native_gbps"] / case["memcpy_gbps"]) < 1e-9
    assert out["ratio_to_memcpy"] == min(c["ratio_to_memcpy"] for c in out["cases"])
    assert out["speedup_vs_torch"] == min(c["speedup_vs_torch"] for c in out["cases"])
    assert set(out["goals_met"]) == {"ratio_to_memcpy", "speedup_vs_torch"}


def test_registry():
    assert set(BENCHES) == {"hotcache", "gather"} and all(callable(f) for f in BENCHES.values())
    for out in (hotcache.run(rows=1, topk=8, capacity=8, context=64, overlaps=(0.5,), steps=2, reference_steps=1, warmup=1),):
        idle = out["cpu_used_by_others"]
        assert idle is None or 0.0 <= idle <= 1.0
