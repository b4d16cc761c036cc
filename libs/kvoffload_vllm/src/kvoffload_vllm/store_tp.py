"""The store under tensor parallel: which pool keys a rank's blocks go under.

The scheduler plans one step for every rank (``kvoffload_vllm.plan``: keys of the whole model's
token chain); each rank's worker takes it under its own keys (``RankKeys.mine``):

- **Head slices** (a dense model: each rank holds its slice of the KV heads): rank r's block goes
  under ``rank_key(key, r, tp)``, a digest of the key and the rank, so no two ranks (and no engine
  of another TP) meet. A prefix is a hit only where every rank's blocks are present
  (``RankKeys.exists``: one ``Exists`` per rank, the run every rank holds).
- **Copies** (an MLA latent, or one KV head every rank holds): the key is the model's, rank 0 saves
  and every rank loads it, so an engine of any TP reads the blocks of any other.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload_vllm.plan import Transfer


def rank_key(key: bytes, rank: int, size: int) -> bytes:
    """The key rank ``rank`` of ``size`` keeps its head slice of block ``key`` under (as long as the key)."""
    return hashlib.blake2b(key, digest_size=len(key), person=f"tp{rank}of{size}".encode()).digest()


@dataclass(frozen=True)
class RankKeys:
    """Rank ``rank`` of ``size``; ``copies``: every rank holds the same KV."""

    rank: int = 0
    size: int = 1
    copies: bool = False

    @property
    def split(self) -> bool:
        """Each rank keeps its own slice under keys of its own."""
        return self.size > 1 and not self.copies

    def keys(self, keys: Sequence[bytes], rank: int) -> tuple[bytes, ...]:
        return tuple(rank_key(k, rank, self.size) for k in keys) if self.split else tuple(keys)

    def exists(self, exists: Callable[[list[bytes]], list[bool]]) -> Callable[[list[bytes]], list[bool]]:
        """``exists`` over the model's keys, true where every rank's block is present."""
        if not self.split:
            return exists

        def every_rank(keys: list[bytes]) -> list[bool]:
            present = [True] * len(keys)
            for r in range(self.size):
                got = exists(list(self.keys(keys, r)))
                present = [a and b for a, b in zip(present, got, strict=True)]
            return present

        return every_rank

    def mine(self, loads: list[Transfer], saves: list[Transfer]) -> tuple[list[Transfer], list[Transfer]]:
        """A step's loads and saves as this rank runs them: under its keys; with copies, only rank 0 saves."""
        if not self.split:
            return loads, saves if self.rank == 0 else []
        ranked = [dataclasses.replace(t, keys=self.keys(t.keys, self.rank)) for t in (*loads, *saves)]
        return ranked[: len(loads)], ranked[len(loads) :]
