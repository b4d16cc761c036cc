"""kvcore.traces: the Trace container, the synthetic generator (determinism, parameters' effect,
measured overlap ~ preset) and the locality measurement on hand-made traces."""

from __future__ import annotations

import pytest
import torch

from kvcore.traces import PRESETS, Trace, generate, named, preset
from kvcore.traces.measure import locality
from kvcore.traces.synthetic import SyntheticParams, survival

SMALL = dict(k=256, context0=2048, steps=24, layers=4, requests=2, sinks=4, recent=32, heavy=32, span=8)


def _trace(rows: list[list[list[int]]], context0: int = 10, name: str = "t") -> Trace:
    topk = torch.tensor(rows, dtype=torch.int32)  # [S, T, k]
    n = topk.shape[0]
    z = torch.zeros(n, dtype=torch.int32)
    return Trace(name, topk, torch.full((n,), context0, dtype=torch.int64), torch.arange(n, dtype=torch.int32), z, z)


def test_generator_is_deterministic_and_seeded():
    a, b = generate(preset("overlap90", **SMALL)), generate(preset("overlap90", **SMALL))
    assert torch.equal(a.topk, b.topk) and a.meta == b.meta
    c = generate(preset("overlap90", **SMALL, seed=1))
    assert not torch.equal(a.topk, c.topk)


def test_generated_rows_are_valid_selections():
    p = preset("overlap80", **SMALL)
    tr = generate(p)
    assert tr.topk.shape == (p.requests * p.layers, p.steps, p.k)
    s = tr.topk.long()
    assert bool((s[:, :, 1:] > s[:, :, :-1]).all())  # distinct, ascending
    ctx = p.context0 + torch.arange(p.steps).view(1, -1)  # [1, T]
    assert bool((s.max(2).values < ctx).all()) and bool((s >= 0).all())
    sinks = torch.arange(p.sinks)
    newest = ctx - 1  # the newest token is always in the recent window
    for t in range(p.steps):
        assert bool(torch.isin(sinks, s[0, t]).all())
        assert bool((s[:, t] == newest[0, t]).any(1).all())
    assert tr.layers.tolist() == [L for _ in range(p.requests) for L in range(p.layers)]
    assert tr.requests.tolist() == [r for r in range(p.requests) for _ in range(p.layers)]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_measured_overlap_matches_the_preset(name):
    p = preset(name, steps=16, layers=4, requests=1)
    loc = locality(generate(p, name))
    assert abs(loc["overlap"] - p.overlap) < 0.02, loc["overlap"]
    # layers differ: their targets are spread over overlap +- layer_spread
    assert max(loc["overlap_by_layer"]) - min(loc["overlap_by_layer"]) > p.layer_spread
    assert loc["coverage"]["12"] > loc["coverage"]["1"]  # dropped entries come back


def test_parameters_change_what_they_name():
    lo = locality(generate(preset("overlap80", **SMALL, layer_spread=0.0)))
    hi = locality(generate(preset("overlap95", **SMALL, layer_spread=0.0)))
    assert hi["overlap"] > lo["overlap"] + 0.1
    no_returns = locality(generate(preset("overlap80", **SMALL, return_frac=0.0)))
    assert no_returns["returning"]["2-12"] < 0.05 < lo["returning"]["2-12"]
    assert max(no_returns["overlap_by_layer"]) - min(no_returns["overlap_by_layer"]) > 0.02
    flat = locality(generate(preset("overlap80", **SMALL, layer_spread=0.0)))
    assert max(flat["overlap_by_layer"]) - min(flat["overlap_by_layer"]) < 0.03


def test_survival_solves_for_the_target_overlap():
    p = SyntheticParams(k=1000, sinks=10, recent=91, heavy=100, heavy_replace=0.0)
    assert survival(p, (10 + 90 + 100 + 0.5 * 799) / 1000) == pytest.approx(0.5)
    assert survival(p, 0.0) == 0.0 and survival(p, 1.0) == 1.0


def test_invalid_parameters_name_the_field():
    with pytest.raises(ValueError, match="overlap"):
        generate(preset("overlap90", **SMALL, overlap=1.5))
    with pytest.raises(ValueError, match="no dynamic entries"):
        generate(preset("overlap90", **(SMALL | {"heavy": 300})))
    with pytest.raises(ValueError, match="unknown synthetic trace 'overlap50'"):
        preset("overlap50")


def test_locality_on_a_hand_made_trace():
    # step sets: {1,2,3,4} -> {1,2,3,5} -> {1,2,4,6}: overlaps 3/4 and 2/4; 4 returns after 2 steps
    tr = _trace([[[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 4, 6]]])
    loc = locality(tr)
    assert loc["overlap"] == pytest.approx(5 / 8)
    assert loc["coverage"]["2"] == pytest.approx(6 / 8)  # 4 was selected 2 steps back
    assert loc["returning"] == {"2-12": pytest.approx(1 / 3), "13-16": 0.0, ">16": 0.0, "never": pytest.approx(2 / 3)}


def test_trace_round_trips_and_rejects_bad_positions(tmp_path):
    tr = generate(preset("overlap90", **SMALL))
    back = Trace.load(tr.save(tmp_path / "t.pt"))
    assert torch.equal(back.topk, tr.topk) and back.meta == tr.meta and back.name == tr.name
    with pytest.raises(ValueError, match="outside"):
        _trace([[[1, 10]]], context0=10)  # position 10 is not < context0 + 0
    assert _trace([[[1, 9], [10, -1]]], context0=10).steps == 2


def test_named_gives_presets_and_explains_missing_recordings(tmp_path, monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_HOME", str(tmp_path))
    assert named("overlap95", **SMALL).k == SMALL["k"]
    with pytest.raises(FileNotFoundError, match="kvoffload trace record nosuch"):
        named("nosuch")
    generate(preset("overlap90", **SMALL), "mine").save(tmp_path / "traces" / "mine.pt")
    assert named("mine").name == "mine"
