"""Tensor parallelism for the reference model: one rank's shard of the weights, and the reduction it needs.

The split is Megatron's, as vLLM shards DeepSeek MLA. Per layer, the attention heads are divided
among the ranks: ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` keep their own heads' output rows and
``o_proj`` its heads' input columns. The MLP's intermediate is divided the same way (``gate_proj`` /
``up_proj`` rows, ``down_proj`` columns). Everything else is replicated: embeddings, norms, the LM
head, the lightning indexer (so every rank selects the same top-k) and ``kv_a_proj_with_mqa``, the
MLA latent projection. So the cache row (latent KV ``c ++ k_pe`` and the indexer key) is the same
on every rank. The P→D contributor plan relies on that: any rank of a contributor group can send
any row.

Two partial sums per layer (``o_proj``, ``down_proj``) are reduced by ``TPGroup.reduce``. Each rank
computes its partial in float32, gathers every rank's partial and sums them in rank order. Every
rank therefore ends with the same bits (a ring all-reduce does not promise that), and one TP size
always gives the same result. The result is cast to the model's dtype once, after the sum. A
different TP size sums in a different order: the logits agree with ``tp=1`` to float32 rounding,
not bit for bit (``tests/test_tp.py`` measures it).

Groups: ``SOLO`` (one rank, no communication: the model as it always was), ``ThreadGroup`` (N ranks
as threads of one process, for tests and for checking a sharding without processes) and
``DistGroup`` (``torch.distributed``, gloo on CPU: what rank processes use).

Llama models (``dsamodel.llama``) are not sharded: ``check_tp_size`` and ``shard_model`` refuse a
size above 1 for them, naming the reason.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
from torch import nn

__all__ = ["SOLO", "DistGroup", "TPGroup", "ThreadGroup", "check_tp_size", "shard_model"]


class TPGroup(Protocol):
    """The ranks one model is sharded over."""

    rank: int
    size: int

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's float32 ``partial`` in rank order; every rank gets the same tensor."""
        ...


class _Solo:
    rank, size = 0, 1

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def __repr__(self) -> str:
        return "SOLO"


SOLO: TPGroup = _Solo()


def _ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


class ThreadGroup:
    """``size`` ranks run by ``size`` threads of this process; ``member(rank)`` is one rank's handle.

    Every rank must call ``reduce`` the same number of times with the same shapes (as with any
    collective); a rank that stops early leaves the others waiting up to ``timeout_s``, then raises.
    """

    def __init__(self, size: int, timeout_s: float = 60.0) -> None:
        if size < 1:
            raise ValueError(f"size={size}: must be >= 1")
        self.size = size
        self._slots: list[torch.Tensor | None] = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout_s)

    def member(self, rank: int) -> TPGroup:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside 0..{self.size - 1}")
        return _ThreadRank(self, rank)


class _ThreadRank:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._group, self.rank, self.size = group, rank, group.size

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        g = self._group
        g._slots[self.rank] = partial
        g._barrier.wait()  # every partial is in
        out = _ordered_sum(g._slots)  # type: ignore[arg-type]
        g._barrier.wait()  # every rank has read them: the slots may be reused
        return out


class DistGroup:
    """The default ``torch.distributed`` process group (initialized by the caller, e.g. gloo)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("DistGroup: torch.distributed is not initialized (init_process_group first)")
        self._dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(partial) for _ in range(self.size)]
        self._dist.all_gather(parts, partial.contiguous())
        return _ordered_sum(parts)

    def __repr__(self) -> str:
        return f"DistGroup(rank={self.rank}, size={self.size})"


def check_tp_size(config, size: int) -> None:
    """``size`` ranks can shard this model: heads and the MLP intermediate divide evenly; a Llama
    model (``LlamaConfig``) is not sharded at all (TP > 1 is refused, naming the reason)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor parallel size {size!r}: must be an int >= 1")
    if size > 1 and getattr(config, "model_type", None) == "llama":
        raise ValueError(
            f"tensor parallel size {size}: Llama models run on one rank (the split above is DeepSeek MLA's; "
            "GQA heads and the PCA indexer are not sharded), use 1"
        )
    bad = [
        f"{name}={value}"
        for name, value in (
            ("num_attention_heads", config.num_attention_heads),
            ("intermediate_size", config.intermediate_size),
        )
        if value % size
    ]
    if bad:
        raise ValueError(f"tensor parallel size {size} does not divide the model's {' and '.join(bad)}")


def _keep_rows(lin: nn.Linear, rows: slice) -> None:
    lin.weight = nn.Parameter(lin.weight.data[rows].clone(), requires_grad=False)
    lin.out_features = lin.weight.shape[0]


def _keep_cols(lin: nn.Linear, cols: slice) -> None:
    lin.weight = nn.Parameter(lin.weight.data[:, cols].contiguous(), requires_grad=False)
    lin.in_features = lin.weight.shape[1]


def shard_model(model, group: TPGroup):
    """Keep rank ``group.rank``'s shard of every layer (module doc), in place; returns ``model``.

    The model must be whole (loaded with ``tp=1``); afterwards its layers reduce through ``group``.
    A Llama model is refused for ``group.size > 1`` (``check_tp_size``).
    """
    check_tp_size(model.config, group.size)
    if getattr(model, "tp", SOLO).size != 1:
        raise ValueError(f"the model is already sharded ({model.tp!r})")
    model.tp = group
    n, r = group.size, group.rank
    for layer in model.cache_layers:
        layer.tp = group
        if n == 1:
            continue  # one rank: the whole layer
        attn = layer.self_attn
        h = attn.num_heads // n
        heads = slice(r * h, (r + 1) * h)
        q = attn.nope_dim + attn.rope_dim
        q_proj = attn.q_proj if hasattr(attn, "q_proj") else attn.q_b_proj
        _keep_rows(q_proj, slice(heads.start * q, heads.stop * q))
        kvb = attn.nope_dim + attn.v_dim
        _keep_rows(attn.kv_b_proj, slice(heads.start * kvb, heads.stop * kvb))
        _keep_cols(attn.o_proj, slice(heads.start * attn.v_dim, heads.stop * attn.v_dim))
        attn.num_heads = h
        mlp = layer.mlp
        i = mlp.gate_proj.out_features // n
        part = slice(r * i, (r + 1) * i)
        _keep_rows(mlp.gate_proj, part)
        _keep_rows(mlp.up_proj, part)
        _keep_cols(mlp.down_proj, part)
    return model
