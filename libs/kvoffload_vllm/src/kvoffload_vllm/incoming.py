"""One request a vLLM decode receives (``kvoffload_vllm.consumer``): its blocks and what landed in
them per KV cache group (``kvoffload_vllm.d2h_plan.Coverage``), its state (loading, then done,
failed or cancelled, once) and the pulls writing into it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from kvoffload_vllm.d2h_plan import Coverage
from kvoffload_vllm.d2h_step import Recv
from kvoffload_vllm.kv_groups import KVGroup


class RequestEnded(RuntimeError):
    """The request stopped loading (failed or cancelled) while its rows were being pulled."""


@dataclass
class Incoming:
    recv: Recv
    coverages: list[Coverage]  # per KV cache group
    block_ids: list[torch.Tensor]  # per KV cache group
    started: float = field(default_factory=time.monotonic)
    last_news: float = 0.0  # monotonic time of the prefill's last word; 0 before it started
    peer: str = ""
    state: str = "loading"  # loading | done | failed | cancelled
    reason: str = ""
    busy: int = 0  # pulls in flight
    bytes: int = 0
    layer_blocks: list[int] = field(default_factory=list)  # blocks written per layer (wire order)
    write_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, recv: Recv, groups: tuple[KVGroup, ...], num_layers: int) -> Incoming:
        """``recv`` about to load into its blocks of every group of ``groups`` (``num_layers`` in all)."""
        return cls(
            recv,
            [
                Coverage(
                    len(g.layer_names),
                    recv.num_tokens,
                    g.block_size,
                    recv.local_tokens // g.block_size,
                    recv.block_ids[g.index],
                )
                for g in groups
            ],
            [torch.tensor(recv.block_ids[g.index], dtype=torch.long) for g in groups],
            layer_blocks=[0] * num_layers,
        )

    def layers_done(self) -> int:
        return sum(c.layers_done() for c in self.coverages)

    @property
    def complete(self) -> bool:
        return all(c.complete for c in self.coverages)
