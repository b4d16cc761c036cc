"""One request a vLLM decode receives (``kvoffload_vllm.d2h_consumer``): its blocks and what landed in
them per KV cache group (``kvoffload_vllm.d2h_plan.Coverage``), its state (loading, then done,
failed or cancelled, once) and the pulls writing into it. Its first read says into how many head
slices its prefill's ranks split each block (``slice_into``)."""

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
    bytes_by_rank: dict[int, int] = field(default_factory=dict)  # of ``bytes``, per prefill TP rank
    layer_blocks: list[int] = field(default_factory=list)  # blocks written per layer (wire order)
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    slices: int = 1  # head slices per block (prefill ranks per decode rank, when they split the heads)

    @classmethod
    def of(cls, recv: Recv, groups: tuple[KVGroup, ...], num_layers: int) -> Incoming:
        """``recv`` about to load into its blocks of every group of ``groups`` (``num_layers`` in all)."""
        return cls(
            recv,
            coverages(recv, groups, 1),
            [torch.tensor(recv.block_ids[g.index], dtype=torch.long) for g in groups],
            layer_blocks=[0] * num_layers,
        )

    def slice_into(self, slices: int, groups: tuple[KVGroup, ...]) -> str:
        """Track ``slices`` head slices per block from now on (under ``write_lock``): "" once they
        are, else why not (blocks landed already under another split)."""
        if slices == self.slices:
            return ""
        if any(self.layer_blocks):
            return f"the request's blocks landed in {self.slices} slice(s) each, a read now brings {slices}"
        self.coverages, self.slices = coverages(self.recv, groups, slices), slices
        return ""

    def layers_done(self) -> int:
        return sum(c.layers_done() for c in self.coverages)

    @property
    def complete(self) -> bool:
        return all(c.complete for c in self.coverages)


def coverages(recv: Recv, groups: tuple[KVGroup, ...], slices: int) -> list[Coverage]:
    """A fresh ``Coverage`` of ``recv`` per group of ``groups``, ``slices`` head slices per block."""
    return [
        Coverage(
            len(g.layer_names),
            recv.num_tokens,
            g.block_size,
            recv.local_tokens // g.block_size,
            recv.block_ids[g.index],
            slices,
        )
        for g in groups
    ]
