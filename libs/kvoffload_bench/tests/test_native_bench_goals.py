"""The native benches cannot pass by accident: outputs that differ from the reference fail a goal
(``hotcache``: every policy, native, one core, torch; ``gather``: every case, the miss cases
included), the hot-cache speedup divides times of the same steps, and each policy's cost times
that policy's calls."""

from __future__ import annotations

import dataclasses
import time

import pytest

import kvcore.hotcache.gather
from kvcore.hotcache.cache import HotCache
from kvcore.traces import generate, preset
from kvoffload_bench import gather, hotcache
from kvoffload_bench.hotcache_torch import TorchHotCache

SMALL = {"k": 64, "context0": 512, "steps": 12, "layers": 3, "requests": 2, "sinks": 2, "recent": 8, "heavy": 8}


def _perturbed(res):
    """``res`` with one slot changed: what a wrong resolution looks like."""
    slots = res.slots.clone()
    slots.view(-1)[0] += 1
    return dataclasses.replace(res, slots=slots)


def test_hotcache_torch_outputs_that_differ_fail_outputs_equal(monkeypatch):
    real = TorchHotCache.resolve
    monkeypatch.setattr(TorchHotCache, "resolve", lambda self, *a, **kw: _perturbed(real(self, *a, **kw)))
    out = hotcache.run(traces=("overlap80",), rows=2, steps=3, reference_steps=2, warmup=1, synthetic=SMALL)
    assert out["policy_outputs_equal"] is True  # the policies' native paths still equal their references
    assert out["timing"][0]["torch_outputs_equal"] is False and out["outputs_equal"] is False
    assert out["goals"]["outputs_equal"] is True and out["goals_met"]["outputs_equal"] is False
    assert out["gaps"]["outputs_equal"]["worst_on"] == "overlap80 (timing)"


def test_hotcache_native_policy_outputs_that_differ_fail_outputs_equal(tmp_path, monkeypatch):
    """On a recorded trace (no timing part) only the policies' native-vs-reference check judges."""
    monkeypatch.setenv("KVOFFLOAD_HOME", str(tmp_path))
    generate(preset("overlap90", **SMALL), "mine").save(tmp_path / "traces" / "mine.pt")
    real = HotCache.resolve

    def wrong_when_native(self, *a, **kw):
        res = real(self, *a, **kw)
        return _perturbed(res) if self.native else res

    monkeypatch.setattr(HotCache, "resolve", wrong_when_native)
    out = hotcache.run(trace="mine", reference_steps=2)
    assert "timing" not in out and out["policy_outputs_equal"] is False and out["outputs_equal"] is False
    assert out["goals_met"]["outputs_equal"] is False
    assert out["gaps"]["outputs_equal"]["worst_on"] == "mine (policies vs reference)"


def test_hotcache_timing_checks_every_policy_against_its_reference(monkeypatch):
    """One policy (not the default) whose native outputs are wrong: the timing's per-policy one-core
    calls are compared with that policy's reference, so the timing case fails outputs_equal too."""
    real = HotCache.resolve

    def wrong_native_clock(self, *a, **kw):
        res = real(self, *a, **kw)
        return _perturbed(res) if self.native and self.policy == "clock" else res

    monkeypatch.setattr(HotCache, "resolve", wrong_native_clock)
    case = hotcache._timing("overlap80", 2, 3, 2, 1, SMALL)
    assert case["outputs_equal"] is False and case["torch_outputs_equal"] is True


def test_hotcache_cost_by_policy_times_each_policys_one_core_calls(monkeypatch):
    """Only the native "slru" cache slowed down on one core: only its cost per (request, layer, step)
    shows it (the default's ``cost_us`` does not)."""
    rows, slow_s = 2, 0.02
    real = HotCache.resolve

    def slow_slru(self, *a, **kw):
        if self.native and self.policy == "slru":
            time.sleep(slow_s)
        return real(self, *a, **kw)

    monkeypatch.setattr(HotCache, "resolve", slow_slru)
    case = hotcache._timing("overlap80", rows, 3, 1, 1, SMALL)
    assert case["cost_us_by_policy"]["slru"] >= slow_s / rows * 1e6
    assert max(case["cost_us_by_policy"]["lru"], case["cost_us_by_policy"]["clock"]) < slow_s / rows * 1e6
    assert case["cost_us"] == case["cost_us_by_policy"]["clock"] and case["outputs_equal"] is True


def test_hotcache_speedup_times_native_and_reference_over_the_same_steps(monkeypatch):
    """The native path slowed down on the steps after the reference's: the speedup divides the
    reference's median by the native median over the reference's own steps."""
    warmup, reference_steps, steps, slow_s = 1, 2, 6, 0.05
    calls: dict[int, int] = {}
    real = HotCache.resolve

    def slow_later(self, *a, **kw):
        calls[id(self)] = calls.get(id(self), 0) + 1
        if self.native and calls[id(self)] > warmup + reference_steps:
            time.sleep(slow_s)
        return real(self, *a, **kw)

    monkeypatch.setattr(HotCache, "resolve", slow_later)
    case = hotcache._timing("overlap80", 2, steps, reference_steps, warmup, SMALL)
    assert case["native_s_per_step"] >= slow_s  # the median over every step: mostly slow ones
    assert case["native_s_per_step_reference_steps"] < slow_s  # the median over the reference's steps
    assert case["speedup"] == case["reference_s_per_step"] / case["native_s_per_step_reference_steps"]
    assert case["speedup"] > case["reference_s_per_step"] / case["native_s_per_step"]


GATHER_SMALL = {
    "rows": 2,
    "misses_per_row": 64,
    "row_bytes": (64,),
    "block_size": 16,
    "pool_gib": 0.01,
    "context": 4096,
    "capacity": 2048,
    "reps": 1,
    "topk": 1024,
    "warmup_steps": 2,
    "miss_steps": 2,
    "miss_reps": 1,
}


@pytest.mark.parametrize("only_miss_cases", [False, True])
def test_gather_outputs_that_differ_fail_outputs_equal(monkeypatch, only_miss_cases):
    """A native gather that writes one wrong byte (in every case, or in the miss cases only)."""
    real_gather, real_miss_case = kvcore.hotcache.gather.gather_rows, gather._miss_case
    wrong = {"on": not only_miss_cases}

    def one_wrong_byte(*args, native=True):
        real_gather(*args, native=native)
        if native and wrong["on"]:
            args[4].view(-1)[0] += 1  # dst

    def miss_case(*args, **kw):
        wrong["on"] = True
        return real_miss_case(*args, **kw)

    monkeypatch.setattr(kvcore.hotcache.gather, "gather_rows", one_wrong_byte)
    monkeypatch.setattr(gather, "_miss_case", miss_case)
    out = gather.run(**GATHER_SMALL)
    assert [c["equal"] for c in out["cases"]] == [only_miss_cases] and not out["miss_cases"][0]["equal"]
    assert out["goals"]["outputs_equal"] is True and out["outputs_equal"] is False
    assert out["goals_met"]["outputs_equal"] is False
    assert out["unequal_cases"] == ([] if only_miss_cases else ["cases[0] (64 B rows)"]) + ["miss_cases[0] (64 B rows)"]


def test_gather_equal_outputs_meet_outputs_equal():
    out = gather.run(**GATHER_SMALL)
    assert out["outputs_equal"] is True and out["goals_met"]["outputs_equal"] is True and out["unequal_cases"] == []
