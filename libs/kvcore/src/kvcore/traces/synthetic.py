"""Synthetic top-k traces with the locality published for trained sparse-attention models.

One stream per (request, layer); the context grows by one token per step. Each step's top-k set
(``k`` distinct positions) is made of four parts:

- **attention sinks**: the first ``sinks`` positions, always selected (StreamingLLM's sinks);
- **recent window**: the last ``recent`` positions, always selected (the window slides by one; the
  entry leaving it is dropped);
- **heavy hitters**: ``heavy`` positions drawn Zipf-weighted (exponent ``zipf``) over a per-stream
  random ranking of the context, always selected while they last; each is replaced with
  probability ``heavy_replace`` per step by a fresh Zipf draw (H2O-style heavy hitters that drift
  slowly);
- **dynamic remainder** (the rest of ``k``): each entry survives a step with probability ``q``.
  The replaced entries are ``return_frac`` returns — entries dropped 1..``return_window`` steps
  ago, the one dropped ``d`` steps ago weighted ``return_decay ** (d - 1)`` — and the rest new
  contiguous spans of ``span`` positions on a per-stream grid (never an entry dropped within the
  return window: returns are only what ``return_frac`` says), so selections cluster.

``q`` is solved per layer so that the expected adjacent-step overlap equals that layer's target;
the targets are spaced evenly over ``overlap +- layer_spread`` in a seeded order (one per layer,
shared by the requests; their mean is ``overlap``), so layers differ in locality as they do in real models.

Sources for the defaults: adjacent steps share ~60 % of their top-k (ShadowKV, Llama-3.1-8B) up
to a claimed >= 95 % (DeepSeek-style DSA on Ascend) — the presets ``overlap80/90/95`` sit in
that range; dropped entries mostly return within ~12 steps (SparseServe: the last 12 steps cover
~10.7 % more of a step's set than the last one, 16 steps only 0.3 % more) — ``return_window``
12 with a geometric decay; sinks and the recent window are always in (StreamingLLM, DSA's
local window). ``measure`` reports what a generated trace really shows.

Deterministic: the same parameters and seed give the same tensor on any machine (one CPU
``torch.Generator``; every step is whole-tensor ops over streams and positions).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from kvcore.traces.trace import Trace

_NEG = -1e30


@dataclass(frozen=True)
class SyntheticParams:
    """Generator parameters (module docstring); validated by ``generate``."""

    overlap: float = 0.9
    layer_spread: float = 0.03
    k: int = 2048
    context0: int = 32768
    steps: int = 64
    layers: int = 8
    requests: int = 2
    sinks: int = 16
    recent: int = 256
    heavy: int = 256
    zipf: float = 1.1
    heavy_replace: float = 0.005
    return_frac: float = 0.5
    return_window: int = 12
    return_decay: float = 0.75
    span: int = 16
    seed: int = 0


PRESETS: dict[str, SyntheticParams] = {
    "overlap80": SyntheticParams(overlap=0.80),
    "overlap90": SyntheticParams(overlap=0.90),
    "overlap95": SyntheticParams(overlap=0.95),
}


def preset(name: str, **overrides) -> SyntheticParams:
    if name not in PRESETS:
        raise ValueError(f"unknown synthetic trace {name!r}; presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def _check(p: SyntheticParams) -> int:
    """Validates ``p``; returns the dynamic part's size."""
    ints = {
        "k": p.k,
        "context0": p.context0,
        "steps": p.steps,
        "layers": p.layers,
        "requests": p.requests,
        "span": p.span,
        "return_window": p.return_window,
    }
    for name, v in ints.items():
        if v < 1:
            raise ValueError(f"SyntheticParams.{name} = {v} must be >= 1")
    for name in ("sinks", "recent", "heavy"):
        if getattr(p, name) < 0:
            raise ValueError(f"SyntheticParams.{name} = {getattr(p, name)} must be >= 0")
    if p.recent < 1:
        raise ValueError("SyntheticParams.recent must be >= 1 (the newest token is always selected)")
    for name in ("overlap", "heavy_replace", "return_frac", "return_decay"):
        if not 0.0 <= getattr(p, name) <= 1.0:
            raise ValueError(f"SyntheticParams.{name} = {getattr(p, name)} must be in [0, 1]")
    if not 0.0 <= p.layer_spread < 0.5:
        raise ValueError(f"SyntheticParams.layer_spread = {p.layer_spread} must be in [0, 0.5)")
    dynamic = p.k - p.sinks - p.recent - p.heavy
    if dynamic < 1:
        raise ValueError(
            f"SyntheticParams: k = {p.k} leaves no dynamic entries after sinks + recent + heavy "
            f"= {p.sinks + p.recent + p.heavy}"
        )
    if p.context0 < 4 * p.k:
        raise ValueError(f"SyntheticParams.context0 = {p.context0} must be >= 4 * k = {4 * p.k} (room for new spans)")
    return dynamic


def survival(p: SyntheticParams, overlap: float) -> float:
    """The dynamic part's survival probability ``q`` that gives expected adjacent overlap ``overlap``."""
    dynamic = p.k - p.sinks - p.recent - p.heavy
    fixed = p.sinks + (p.recent - 1) + p.heavy * (1.0 - p.heavy_replace)
    return min(max((overlap * p.k - fixed) / dynamic, 0.0), 1.0)


def generate(p: SyntheticParams, name: str = "synthetic") -> Trace:
    """The trace of ``p`` (module docstring): streams ordered request-major, then layer."""
    dynamic = _check(p)
    gen = torch.Generator().manual_seed(p.seed)
    S, P, k = p.requests * p.layers, p.context0 + p.steps, p.k
    layer_of = torch.arange(S) % p.layers  # [S]
    targets = _layer_targets(p, gen)  # [layers]
    q = torch.tensor([survival(p, float(t)) for t in targets], dtype=torch.float64)[layer_of]  # [S]
    pos = torch.arange(P)  # [P]
    rank = torch.rand(S, P, generator=gen).argsort(dim=1).argsort(dim=1)  # [S, P] Zipf rank of each position
    log_w = -p.zipf * torch.log1p(rank.to(torch.float64))  # [S, P] log Zipf weight
    phase = torch.randint(0, p.span, (S, 1), generator=gen)  # [S, 1] span grid offset
    dropped_at = torch.full((S, P), -(1 << 30), dtype=torch.int64)  # [S, P] step of the last drop
    heavy = torch.zeros(S, P, dtype=torch.bool)
    sel = torch.zeros(S, P, dtype=torch.bool)
    out = torch.empty(S, p.steps, k, dtype=torch.int32)
    for t in range(p.steps):
        ctx = p.context0 + t
        valid = pos < ctx  # [P]
        fixed = ((pos < p.sinks) | ((pos >= ctx - p.recent) & valid)).expand(S, P)  # [S, P]
        # heavy hitters: some replaced, then refilled by Zipf draws among the free positions
        was_heavy = heavy.clone()  # a replaced heavy hitter is dropped (it may come back as a return)
        if t:
            heavy &= torch.rand(S, P, generator=gen) >= p.heavy_replace
        heavy &= ~fixed
        need_heavy = p.heavy - heavy.sum(1)  # [S]
        free = valid & ~fixed & ~heavy
        heavy |= _draw(log_w, free, need_heavy, gen)
        # dynamic: survivors of the last step, then returns, then new spans
        # (the entry leaving the recent window is dropped: it may come back as a return)
        keep = (
            sel
            & ~fixed
            & ~was_heavy
            & ~heavy
            & (pos < ctx - p.recent - 1)
            & (torch.rand(S, P, generator=gen, dtype=torch.float64) < q[:, None])
        )
        new = fixed | heavy | keep
        need = k - new.sum(1)  # [S]
        age = t - dropped_at  # [S, P] steps since the drop
        recent_drop = (age >= 1) & (age <= p.return_window) & ~new & valid
        if t:
            n_ret = torch.minimum(torch.round(need * p.return_frac).long(), recent_drop.sum(1))
            age_w = (age - 1).clamp(min=0).to(torch.float64) * math.log(max(p.return_decay, 1e-12))
            back = _draw(age_w, recent_drop, n_ret, gen)
            new |= back
            need = need - n_ret
        score = _span_scores(p, pos, phase, gen)  # [S, P]
        # new spans: never an entry dropped now or within the return window (those are returns)
        # (in a context too small for that, recently dropped entries fill the rest)
        for allowed in (valid & ~sel & ~recent_drop, valid & ~sel):
            got = top_per_row(score, allowed & ~new & (pos >= p.sinks), need)
            new |= got
            need = need - got.sum(1)
        dropped_at[sel & ~new] = t
        sel = new
        out[:, t] = sel.nonzero()[:, 1].view(S, k).to(torch.int32)  # ascending positions, exactly k per stream
    return _trace(p, name, out, layer_of, targets, dynamic)


def _span_scores(p: SyntheticParams, pos: torch.Tensor, phase: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One random score per span of ``p.span`` positions (the grid shifted by each stream's ``phase``
    [S, 1]), decreasing slightly along a span so a span is taken contiguously -> [S, P] float64."""
    S, P = phase.shape[0], pos.shape[0]
    span_score = torch.rand(S, P // p.span + 2, generator=gen, dtype=torch.float64)  # [S, spans]
    span_id = (pos[None, :] + phase) // p.span  # [S, P]
    return span_score.gather(1, span_id) - pos[None, :].to(torch.float64) * 1e-12


def _layer_targets(p: SyntheticParams, gen: torch.Generator) -> torch.Tensor:
    """Each layer's target adjacent overlap: ``overlap`` spread by ``layer_spread`` over the layers, in
    a random order -> [layers] float64."""
    spread = (
        torch.linspace(-1.0, 1.0, p.layers, dtype=torch.float64)
        if p.layers > 1
        else torch.zeros(1, dtype=torch.float64)
    )
    return (p.overlap + p.layer_spread * spread[torch.randperm(p.layers, generator=gen)]).clamp(0.0, 0.995)


def _trace(
    p: SyntheticParams, name: str, out: torch.Tensor, layer_of: torch.Tensor, targets: torch.Tensor, dynamic: int
) -> Trace:
    """The ``Trace`` of the drawn selections ``out`` [S, steps, k]; its meta holds ``p`` and what it implied."""
    S = out.shape[0]
    meta = {
        "kind": "synthetic",
        **asdict(p),
        "layer_overlap_targets": [round(float(x), 6) for x in targets],
        "layer_survival": [round(survival(p, float(x)), 6) for x in targets],
        "dynamic": dynamic,
    }
    return Trace(
        name,
        out,
        torch.full((S,), p.context0, dtype=torch.int64),
        layer_of.to(torch.int32),
        (torch.arange(S) // p.layers).to(torch.int32),
        torch.zeros(S, dtype=torch.int32),
        meta,
    )


def _draw(log_w: torch.Tensor, allowed: torch.Tensor, n: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Per row, ``n[row]`` allowed positions drawn without replacement with weights ``exp(log_w)``
    (Gumbel top-k) -> bool [S, P]."""
    gumbel = -torch.log(-torch.log(torch.rand(log_w.shape, generator=gen, dtype=torch.float64).clamp(1e-300, 1.0)))
    return top_per_row(log_w + gumbel, allowed, n)


def top_per_row(score: torch.Tensor, allowed: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Per row, the ``n[row]`` allowed positions of highest score -> bool [S, P]."""
    s = torch.where(allowed, score, torch.full_like(score, _NEG))
    order = s.argsort(dim=1, descending=True, stable=True)  # [S, P]
    take = torch.arange(s.shape[1])[None, :] < torch.minimum(n, allowed.sum(1))[:, None]  # [S, P] by rank
    out = torch.zeros_like(allowed)
    out.scatter_(1, order, take)
    return out
