"""Per-layer hot-buffer sizes from measured hit-rate curves, under one device budget.

Layers differ in locality: a layer whose top-k barely moves gains nothing from slots beyond k,
one whose selections come back after a few steps gains a lot. Given each layer's curve — its
hits at a few capacities (at least k each) — ``size_layers`` spends a budget of slots where they
buy the most hits: every layer starts at its smallest measured capacity and, while the budget
allows, the layer whose next measured capacity adds the most hits per added slot moves up to it
(greedy on marginal gain; exact for concave curves, which LRU hit-rate curves are in practice).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def size_layers(curves: Mapping[int, Sequence[tuple[int, int]]], budget: int) -> dict[int, int]:
    """``curves[layer]`` = [(capacity, hits), ...] ascending in capacity -> capacity per layer with
    ``sum <= budget``. Raises ValueError when even the smallest capacities exceed the budget."""
    if not curves:
        return {}
    for layer, pts in curves.items():
        caps = [c for c, _ in pts]
        if not pts or caps != sorted(set(caps)):
            raise ValueError(f"curve of layer {layer} must list distinct capacities in ascending order")
    at = {layer: 0 for layer in curves}  # index into each curve
    used = sum(pts[0][0] for pts in curves.values())
    if used > budget:
        raise ValueError(f"budget = {budget} slots is below the smallest capacities' sum {used}")
    while True:
        best, best_gain = None, 0.0
        for layer, pts in curves.items():
            i = at[layer]
            if i + 1 < len(pts):
                extra = pts[i + 1][0] - pts[i][0]
                gain = (pts[i + 1][1] - pts[i][1]) / extra
                if used + extra <= budget and gain > best_gain:
                    best, best_gain = layer, gain
        if best is None:
            break
        i = at[best]
        used += curves[best][i + 1][0] - curves[best][i][0]
        at[best] = i + 1
    return {layer: curves[layer][i][0] for layer, i in at.items()}


def hits_at(curves: Mapping[int, Sequence[tuple[int, int]]], sizes: Mapping[int, int]) -> int:
    """Total hits of ``sizes`` (each one of its layer's measured capacities)."""
    return sum(dict(curves[layer])[c] for layer, c in sizes.items())
