"""Belady's optimal hot-cache hit rate, computed offline on a top-k trace: the ceiling for policies.

The hot buffer of one (request, layer) holds ``capacity`` tokens. At every step all of the step's
top-k set ``S_t`` must be resident (a miss is loaded, never bypassed), so after step ``t`` the
buffer holds ``S_t`` plus at most ``capacity - |S_t|`` other tokens. Every token costs the same
to load, so keeping the tokens whose next use is soonest (MIN, Belady 1966) minimises the misses:
each step, of the tokens resident before it and not selected now, the ``capacity - |S_t|`` with
the nearest next use stay (ties: any; the hit count does not depend on them).

Hits are counted as the hot cache counts them: unique selected tokens already resident.
"""

from __future__ import annotations

import numpy as np

from kvcore.traces.trace import Trace

_NEVER = np.iinfo(np.int64).max


def next_use(steps: np.ndarray) -> np.ndarray:
    """``steps`` [T, k] positions (-1 padding) -> [T, k] the next step at which each entry's token is
    selected again (``_NEVER`` when it is not, or for padding)."""
    T, k = steps.shape
    tok = steps.reshape(-1)
    when = np.repeat(np.arange(T, dtype=np.int64), k)
    order = np.lexsort((when, tok))  # by token, then step
    nxt = np.full(T * k, _NEVER, dtype=np.int64)
    same = tok[order][1:] == tok[order][:-1]
    nxt[order[:-1][same]] = when[order][1:][same]
    nxt[tok < 0] = _NEVER
    return nxt.reshape(T, k)


def stream_hits(steps: np.ndarray, capacity: int) -> tuple[int, int]:
    """(hits, misses) of Belady's policy on one stream ``steps`` [T, k] with ``capacity`` slots."""
    if steps.shape[1] > capacity:
        raise ValueError(f"capacity = {capacity} is below k = {steps.shape[1]}")
    nxt = next_use(steps)
    res_tok = np.empty(0, dtype=np.int64)  # resident tokens not selected in the last step ...
    res_next = np.empty(0, dtype=np.int64)  # ... and their next use
    prev_tok = np.empty(0, dtype=np.int64)  # the last step's selection (resident)
    prev_next = np.empty(0, dtype=np.int64)
    hits = misses = 0
    for t in range(steps.shape[0]):
        row, nrow = steps[t], nxt[t]
        real = row >= 0
        cur, first = np.unique(row[real], return_index=True)
        cur_next = nrow[real][first]
        resident = np.concatenate((prev_tok, res_tok))
        h = int(np.isin(cur, resident, assume_unique=True).sum())
        hits, misses = hits + h, misses + cur.size - h
        others = ~np.isin(resident, cur, assume_unique=True)
        o_tok = resident[others]
        o_next = np.concatenate((prev_next, res_next))[others]
        room = capacity - cur.size
        if o_tok.size > room:
            keep = np.argpartition(o_next, room)[:room] if room else np.empty(0, dtype=np.int64)
            o_tok, o_next = o_tok[keep], o_next[keep]
        res_tok, res_next, prev_tok, prev_next = o_tok, o_next, cur, cur_next
    return hits, misses


def hit_rate(trace: Trace, capacity: int) -> dict:
    """Belady's hits, misses and hit rate over every stream of ``trace``, plus per layer."""
    topk = trace.topk.numpy()
    per = [stream_hits(topk[s], capacity) for s in range(trace.streams)]
    hits = np.array([h for h, _ in per])
    misses = np.array([m for _, m in per])
    layers = trace.layers.numpy()
    by_layer = {}
    for layer in sorted(set(layers.tolist())):
        h, m = hits[layers == layer].sum(), misses[layers == layer].sum()
        by_layer[layer] = float(h / max(h + m, 1))
    return {
        "hits": int(hits.sum()),
        "misses": int(misses.sum()),
        "hit_rate": float(hits.sum() / max(hits.sum() + misses.sum(), 1)),
        "by_layer": by_layer,
    }
