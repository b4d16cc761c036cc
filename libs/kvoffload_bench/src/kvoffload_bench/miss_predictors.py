"""Miss prediction for sparse decode: which rows a layer will miss at the next step, from what the
layers selected so far — the candidates a prefetch would load before the layer runs.

Predictors, each for one (request, layer) stream at step ``t``, never proposing a token that is
resident now (those cannot miss):

- ``returning``: tokens selected within the last ``window`` steps but not at ``t - 1`` (they
  dropped out and, on real attention, often come back), most recently selected first, at most
  ``budget`` x the stream's misses at ``t - 1``;
- ``neighbours``: the positions next to (+-1) the tokens that were new at ``t - 1`` (selections
  come in contiguous spans that grow);
- ``previous_layer``: what the layer below selected at step ``t`` itself (known before this layer
  runs; adjacent layers' selections overlap).

``evaluate`` replays a trace through a hot cache and scores each predictor: of the misses of a
step, the share it had proposed (``recall``: rows that a prefetch would have made resident before
they were needed, moving their H2D off the critical path), the share of its proposals that were
misses (``precision``) and the rows it proposes per miss (``loads_per_miss``, extra H2D traffic).
A prediction only decides what is loaded early; the hot cache's residency and the results never
depend on it.
"""

from __future__ import annotations

import torch

from kvcore.hotcache.cache import HotCache
from kvcore.traces.synthetic import top_per_row
from kvcore.traces.trace import Trace

PREDICTORS = ("returning", "neighbours", "previous_layer")


def evaluate(
    trace: Trace, capacity: int, *, policy: str = "lru", window: int = 12, budget: float = 2.0, warmup: int = 2
) -> dict:
    """Each predictor's recall, precision and loads per miss on ``trace`` (module docstring), with
    the default hot cache of ``capacity`` slots; steps before ``warmup`` are not scored."""
    S, T, k = trace.topk.shape
    P = int(trace.context0.max()) + T + 2
    never = -(1 << 30)
    last = torch.full((S, P), never, dtype=torch.int64)  # [S, P] step each token was last selected
    new_prev = torch.zeros(S, P, dtype=torch.bool)  # [S, P] tokens new at t - 1
    below = _stream_below(trace)  # [S] the stream of the layer below (same request, group), -1 at layer 0
    cache = HotCache(capacity, 1, policy=policy)
    ids = [str(s) for s in range(S)]
    rows = torch.arange(S)[:, None]
    prev_misses = torch.zeros(S, dtype=torch.int64)
    score = {p: [0, 0, 0] for p in PREDICTORS}  # predicted misses, proposals, misses
    for t in range(T):
        topk = trace.topk[:, t].contiguous()
        real = topk >= 0
        idx = torch.where(real, topk.long(), torch.full_like(topk, P - 1, dtype=torch.int64))  # padding -> spare
        resident = _resident_mask(cache, ids, S, P)  # [S, P] before this step
        selected = torch.zeros(S, P, dtype=torch.bool)
        selected[rows, idx] = True
        selected[:, P - 1] = False
        res = cache.resolve(0, ids, topk, trace.context(t))
        missed = torch.zeros(S, P, dtype=torch.bool)
        missed[res.miss_rows.long(), res.miss_tokens] = True
        if t >= warmup:
            age = t - last  # [S, P]
            ret = (age >= 2) & (age <= window) & ~resident
            ret = top_per_row(last.to(torch.float64), ret, (budget * prev_misses.clamp(min=1)).ceil().long())
            nb = torch.zeros_like(new_prev)
            nb[:, 1:] |= new_prev[:, :-1]
            nb[:, :-1] |= new_prev[:, 1:]
            nb &= ~resident
            pl = torch.zeros_like(selected)
            has = below >= 0
            pl[has] = selected[below[has]] & ~resident[has]
            for name, pred in (("returning", ret), ("neighbours", nb), ("previous_layer", pl)):
                score[name][0] += int((pred & missed).sum())
                score[name][1] += int(pred.sum())
                score[name][2] += int(missed.sum())
        new_prev = selected & (last != t - 1)
        last[selected] = t
        prev_misses = torch.bincount(res.miss_rows.long(), minlength=S)
    return {
        name: {"recall": h / max(m, 1), "precision": h / max(n, 1), "loads_per_miss": n / max(m, 1)}
        for name, (h, n, m) in score.items()
    }


def _stream_below(trace: Trace) -> torch.Tensor:
    of = {
        (int(r), int(g), int(layer)): s
        for s, (r, g, layer) in enumerate(zip(trace.requests, trace.groups, trace.layers))
    }
    return torch.tensor(
        [
            of.get((int(r), int(g), int(layer) - 1), -1)
            for r, g, layer in zip(trace.requests, trace.groups, trace.layers)
        ],
        dtype=torch.int64,
    )


def _resident_mask(cache: HotCache, ids: list[str], S: int, P: int) -> torch.Tensor:
    out = torch.zeros(S, P, dtype=torch.bool)
    for s, rid in enumerate(ids):  # analysis only (not a hot path): the cache's residency per stream
        toks = list(cache.residency(rid, 0))
        if toks:
            out[s, torch.tensor(toks)] = True
    return out
