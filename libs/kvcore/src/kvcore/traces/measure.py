"""What a trace shows about locality: adjacent-step overlap and how far back returning entries were.

- ``overlap``: |S_t ∩ S_{t-1}| / |S_t| averaged over steps t >= 1, per stream (and per layer);
- ``coverage(n)``: the share of S_t that was selected in at least one of the last ``n`` steps
  (``coverage(1)`` is the overlap; SparseServe's figure is ``coverage(12) - coverage(1)``);
- ``returning``: of the entries new to S_t (not in S_{t-1}), the share last selected 2..12 steps
  ago, 13..16 steps ago, longer ago, or never.

Whole-tensor ops over streams and positions, one pass over steps.
"""

from __future__ import annotations

import torch

from kvcore.traces.trace import Trace

COVERAGE_STEPS = (1, 2, 4, 8, 12, 16)
_NEVER = -(1 << 30)


def locality(trace: Trace) -> dict:
    """The trace's locality figures (module docstring), overall and per layer."""
    S, T, k = trace.topk.shape
    if T < 2:
        raise ValueError(f"trace {trace.name!r} has {T} step(s); locality needs at least 2")
    P = int(trace.context0.max()) + T
    last = torch.full((S, P + 1), _NEVER, dtype=torch.int64)  # [S, P + 1] step each position was last selected
    rows = torch.arange(S)[:, None]  # [S, 1]
    inter = torch.zeros(S, dtype=torch.float64)
    sizes = torch.zeros(S, dtype=torch.float64)
    cover = {n: torch.zeros(S, dtype=torch.float64) for n in COVERAGE_STEPS}
    back = {"2-12": 0, "13-16": 0, ">16": 0, "never": 0}
    for t in range(T):
        cur = trace.topk[:, t].long()  # [S, k]
        real = cur >= 0
        idx = torch.where(real, cur, torch.full_like(cur, P))  # padding -> the spare column
        if t:
            seen = last[rows, idx]  # [S, k]
            age = torch.where(real, t - seen, torch.zeros_like(seen))
            n = real.sum(1).to(torch.float64)
            inter += ((age == 1) & real).sum(1)
            sizes += n
            for steps in COVERAGE_STEPS:
                cover[steps] += ((age >= 1) & (age <= steps) & real).sum(1)
            fresh = real & (age != 1)
            back["2-12"] += int((fresh & (age >= 2) & (age <= 12)).sum())
            back["13-16"] += int((fresh & (age >= 13) & (age <= 16)).sum())
            back[">16"] += int((fresh & (age > 16) & (seen != _NEVER)).sum())
            back["never"] += int((fresh & (seen == _NEVER)).sum())
        last[rows, idx] = t
    per_stream = inter / sizes.clamp(min=1)  # [S]
    layers = sorted(set(trace.layers.tolist()))
    fresh_total = max(sum(back.values()), 1)
    cov = {str(n): float(cover[n].sum() / sizes.sum()) for n in COVERAGE_STEPS}
    return {
        "streams": S,
        "steps": T,
        "k": k,
        "overlap": float(inter.sum() / sizes.sum()),
        "overlap_by_layer": [round(float(per_stream[trace.layers == layer].mean()), 4) for layer in layers],
        "coverage": cov,
        "coverage_12_minus_1": cov["12"] - cov["1"],
        "coverage_16_minus_12": cov["16"] - cov["12"],
        "returning": {key: v / fresh_total for key, v in back.items()},
    }
