"""What a decode TP follower rank knows about its requests: the rows it pulled of each.

A follower (TP rank 1..N-1 of a decode, ``kvoffload_decode.tp_ranks``) serves its own control port
and pulls its contributor prefill ranks' shares into its DP rank's pool (rank 0's, attached) and
its own indexer cache, through the same pull path rank 0 uses (``kvoffload_decode.pull``).
``FollowerPulls`` stands in for the ``DecodeLoop`` there: a request is known here from the moment
rank 0's ``reserve`` reached this rank (``on_op``, called by ``follow_decode``: rank 0 reserves,
then waits at a barrier until every rank has) until its ``finish``; the rows are installed and
counted per layer as rank 0 does it (the ``RowInstaller`` of ``kvoffload_decode.rows``); ``status``
answers rank 0's poll with the requests whose prompt this rank holds whole (rank 0 runs a request
only once every rank does). The first token is rank 0's business: a PrefillDone here is refused.

Everything that changes the decoder holds ``lock``, which ``follow_decode`` holds while it applies
an op (a step included), so a pull waits for a step and a step for a pull's install.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvoffload_decode.rows import RowInstaller
from kvoffload_engine.decode import SparseDecoder


@dataclass
class PulledRequest:
    """One request as a follower sees it: its prompt length and the rows installed per layer."""

    request_id: str
    num_prompt_tokens: int
    rows: list[int]
    ahead: list[list[tuple[int, int]]]
    first_token: int | None = None  # never set here (rank 0 takes the first token)
    copies: int = 0  # pulled rows being installed right now (``RowInstaller``)
    free_after_copies: str | None = None  # never set here: rank 0's ops free a request, between installs

    @property
    def whole(self) -> bool:
        return all(r >= self.num_prompt_tokens for r in self.rows)


class FollowerPulls:
    """What a follower's pulls install into (its ``DecodeRows``; module doc)."""

    def __init__(self, decoder: SparseDecoder, tp_rank: int) -> None:
        self.decoder, self.tp_rank = decoder, tp_rank
        self.lock = threading.Condition(threading.RLock())
        self.pending: dict[str, PulledRequest] = {}
        self.num_layers = len(decoder.model.cache_layers)
        self.installer = RowInstaller(decoder, self.lock, self.pending, copy_lock=self.lock)

    def on_op(self, op: tuple) -> None:
        """Called by ``follow_decode`` after each of rank 0's ops (under ``lock``)."""
        if op[0] == "reserve":  # rank 0 reserves the prompt and the first sampled token
            rid, num_tokens = op[1], op[2]
            self.pending[rid] = PulledRequest(
                rid, num_tokens - 1, [0] * self.num_layers, [[] for _ in range(self.num_layers)]
            )
        elif op[0] in ("finish", "done"):  # freed, or running: nothing more to pull either way
            self.pending.pop(op[1], None)

    def status(self) -> list[str]:
        """The requests whose prompt every layer of this rank holds whole (rank 0's poll)."""
        with self.lock:
            return [rid for rid, req in self.pending.items() if req.whole]

    def pending_request(self, request_id: str) -> PulledRequest | None:
        with self.lock:
            return self.pending.get(request_id)

    def heard_from_prefill(self, request_id: str, peer: str) -> bool:
        """Rank 0 keeps each request's watchdog; here only: is it still expected?"""
        with self.lock:
            return request_id in self.pending

    def write_rows(self, request_id: str, layer: int, start: int, kv: torch.Tensor, index_k: torch.Tensor) -> float:
        """Install rows [start, start + n) of a layer, under ``lock`` (a step waits for it, and it for
        a step); returns the seconds the copy took."""
        return self.installer.write_rows(request_id, layer, start, kv, index_k)

    def prefill_done(
        self,
        request_id: str,
        num_prompt_tokens: int,
        first_token: int,
        first_logprob=None,
        draft_token: int | None = None,
    ) -> str:
        if request_id not in self.pending:
            raise KeyError(request_id)
        return (
            f"PrefillDone goes to decode TP rank 0; this is rank {self.tp_rank}, which only pulls its "
            "contributors' rows"
        )
