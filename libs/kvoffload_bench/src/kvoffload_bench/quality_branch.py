"""One long context of a Llama model, computed once, and the dense and sparse continuations after it.

``ContextRows`` runs the context [0, L) through the model once, densely (as the prefill does: a
Llama model's prefill attends densely, only its decode selects), and keeps every layer's cache rows
(K/V, and the indexer keys as the cache stores them) and the last position's logits. Its causal
attention is torch's ``scaled_dot_product_attention`` (``"sdpa"``, eight times the model's own
``attend_causal`` at 7K tokens here) or the model's own (``"model"``, bit-exact with the engine's
prefill). Both branches after it read the same rows, so the choice moves dense and sparse alike.

A ``Branch`` continues one context with tokens, each query at its position attending over every
row before it: ``"dense"`` through the layer's ``attend_causal``, ``"sparse"`` through the
indexer's top-``k`` (``select``, the gathered rows, ``attend``): what the engine's sparse decode
computes step by step, a whole teacher-forced continuation at once. A sparse branch can also
record, per layer and query, the share of the dense attention mass (summed over the layer's heads)
that its selection, the exact top-k (the ceiling) and a recency window (the floor) keep, and keep
the selections themselves (``selections``: the live indexer's top-k trace, ``trace_indexer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dsamodel.attention import gather_rows
from dsamodel.llama import LlamaLayer, LlamaModel, LlamaProjection

SINKS = 4  # the recency window's first tokens (attention sinks), as dsamodel.indexer_recall's
CONTEXT_ATTENTION = ("sdpa", "model")


@dataclass
class ContextRows:
    """Every layer's cache rows of one context [0, L), computed densely once."""

    kv: list[torch.Tensor]  # per layer [L, W]
    keys: list[torch.Tensor]  # per layer [L, KV * r], as the indexer cache holds them
    last_logits: torch.Tensor  # [V] float32 at position L - 1

    @property
    def length(self) -> int:
        return self.kv[0].shape[0]

    @classmethod
    def compute(cls, model: LlamaModel, tokens: torch.Tensor, attention: str = "sdpa") -> ContextRows:
        """tokens [L] -> the context's rows (module doc)."""
        if attention not in CONTEXT_ATTENTION:
            raise ValueError(f"attention must be one of {CONTEXT_ATTENTION}, got {attention!r}")
        codec = model.index_codec
        positions = torch.arange(tokens.shape[0], device=model.device)
        h = model.embed(tokens.to(model.device))
        kv, keys = [], []
        for layer in model.layers:
            proj = layer.project(h, positions)
            assert proj.index_k is not None  # index_codec above refused a model without an indexer
            kv.append(proj.kv)
            keys.append(codec.decode(codec.encode(proj.index_k)))
            if attention == "sdpa":
                attn = _sdpa_causal(layer, proj)
            else:
                attn = layer.attend_causal(proj, proj.kv, positions)
            h = layer.finish(h, attn)
        return cls(kv, keys, model.logits(h[-1:])[0])


def _sdpa_causal(layer: LlamaLayer, proj: LlamaProjection) -> torch.Tensor:
    """Causal attention of a whole sequence over its own rows through torch's SDPA, in float32 as
    ``attend_causal`` computes -> [T, H, hd] in q's dtype."""
    a = layer.self_attn
    t, kv, hd = proj.kv.shape[0], a.num_kv_heads, a.head_dim
    rows = proj.kv.to(torch.float32)
    k = rows[:, : kv * hd].reshape(t, kv, hd).transpose(0, 1)  # [KV, T, hd]
    v = rows[:, kv * hd :].reshape(t, kv, hd).transpose(0, 1)  # [KV, T, hd]
    q = proj.q.to(torch.float32).transpose(0, 1)  # [H, T, hd]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=layer.softmax_scale)
    return out.transpose(0, 1).to(proj.q.dtype)  # [T, H, hd]


@dataclass
class Recall:
    """Per (layer, query) shares of the dense attention mass: the selection's, the exact top-k's and
    the recency window's (each a list of [n] float32 tensors, one per layer and call)."""

    indexer: list[torch.Tensor] = field(default_factory=list)
    oracle: list[torch.Tensor] = field(default_factory=list)
    recency: list[torch.Tensor] = field(default_factory=list)
    by_k: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # the indexer's at other k


class Branch:
    """A continuation of one context (module doc): ``extend`` appends tokens, returns their logits."""

    def __init__(
        self,
        model: LlamaModel,
        context: ContextRows,
        mode: str,
        *,
        topk: int | None = None,
        capacity: int = 512,
        recall: Recall | None = None,
        recall_ks: tuple[int, ...] = (),
        selections: list[list[torch.Tensor]] | None = None,
    ) -> None:
        if mode not in ("dense", "sparse"):
            raise ValueError(f"mode must be 'dense' or 'sparse', got {mode!r}")
        if mode == "sparse" and (topk is None or topk < 1):
            raise ValueError(f"a sparse branch needs topk >= 1, got {topk!r}")
        self.model, self.mode, self.topk = model, mode, topk
        self.recall, self.recall_ks = recall, recall_ks
        self.selections = selections  # a sparse branch appends each layer's top-k [n, k] to selections[layer]
        self.length = context.length
        self._kv = [_grown(rows, capacity) for rows in context.kv]  # per layer [L + capacity, W]
        self._keys = [_grown(rows, capacity) for rows in context.keys]

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [n] at the next n positions -> float32 logits [n, V]."""
        model, s, n = self.model, self.length, tokens.shape[0]
        if s + n > self._kv[0].shape[0]:
            raise ValueError(f"the branch holds {self._kv[0].shape[0] - s} more tokens, not {n}")
        positions = torch.arange(s, s + n, device=model.device)
        codec = model.index_codec
        h = model.embed(tokens.to(model.device))
        for i, layer in enumerate(model.layers):
            proj = layer.project(h, positions)
            assert proj.index_k is not None
            self._kv[i][s : s + n] = proj.kv
            self._keys[i][s : s + n] = codec.decode(codec.encode(proj.index_k))
            rows, keys = self._kv[i][: s + n], self._keys[i][: s + n]
            if self.mode == "dense":
                attn = layer.attend_causal(proj, rows, positions)
            else:
                assert self.topk is not None
                indices = layer.select(proj, keys, positions, self.topk)  # [n, k]
                if self.selections is not None:
                    self.selections[i].append(indices)
                gathered, valid = gather_rows(rows, indices)
                attn = layer.attend(proj, gathered, valid)
                if self.recall is not None:
                    self._record(layer, proj, rows, keys, positions, indices)
            h = layer.finish(h, attn)
        self.length = s + n
        return model.logits(h)

    def _record(self, layer, proj, rows, keys, positions, indices) -> None:
        """The recall figures of this layer's queries (module doc)."""
        assert self.recall is not None and self.topk is not None
        mass = dense_mass(layer, proj, rows, positions)  # [n, C]
        k = self.topk
        self.recall.indexer.append(_kept(mass, indices))
        self.recall.oracle.append(mass.topk(min(k, mass.shape[1]), dim=-1).values.sum(-1))
        cols = torch.arange(mass.shape[1], device=mass.device)[None, :]
        window = (cols < SINKS) | (cols > positions[:, None] - max(k - SINKS, 0))  # [n, C]
        self.recall.recency.append(torch.where(window, mass, 0.0).sum(-1))
        for other in self.recall_ks:
            sel = indices if other == k else layer.select(proj, keys, positions, other)
            self.recall.by_k.setdefault(other, []).append(_kept(mass, sel))


def dense_mass(layer: LlamaLayer, proj: LlamaProjection, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The dense attention mass of the queries of ``proj`` at ``positions`` [n] over rows [C, W]:
    [n, C] float32, softmax per head over the visible rows, summed over heads / heads (rows sum to 1)."""
    a = layer.self_attn
    c, kv, hd = rows.shape[0], a.num_kv_heads, a.head_dim
    q = proj.q.to(torch.float32)  # [n, H, hd]
    n, heads = q.shape[0], q.shape[1]
    keys = rows[:, : kv * hd].to(torch.float32).reshape(c, kv, hd).permute(1, 2, 0)  # [KV, hd, C]
    qg = q.reshape(n, kv, heads // kv, hd).transpose(0, 1).reshape(kv, -1, hd)  # [KV, n*G, hd]
    scores = (torch.matmul(qg, keys) * layer.softmax_scale).view(kv, n, heads // kv, c)
    visible = torch.arange(c, device=rows.device)[None, :] <= positions[:, None]  # [n, C]
    scores.masked_fill_(~visible[None, :, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1).sum(dim=(0, 2)) / heads  # [n, C]


def _kept(mass: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The mass [n, C] of the selected indices [n, k] (-1 = none) -> [n]."""
    return torch.where(indices >= 0, mass.gather(1, indices.clamp(min=0)), 0.0).sum(-1)


def _grown(rows: torch.Tensor, extra: int) -> torch.Tensor:
    """rows [L, W] copied into a new [L + extra, W] tensor (the rest zero)."""
    out = torch.zeros((rows.shape[0] + extra, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    out[: rows.shape[0]] = rows
    return out
