"""One request as the decode loop keeps it, from its admission to its last token (``DecodeRequest``),
and how the loop talks back to its HTTP handler (``Emit``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dsamodel.sampling import RequestSampler
from openai_api.logprobs import TokenLogprob

Emit = Callable[[str, object], None]  # ("token", id) | ("done", finish_reason) | ("error", message)


@dataclass
class DecodeRequest:
    """One request from arrival to its last token."""

    request_id: str
    prompt_ids: list[int]
    sampler: RequestSampler
    emit: Emit
    num_layers: int
    rows: list[int] = field(default_factory=list)  # per layer: rows [0, rows[layer]) are installed
    # per layer: installed ranges past rows[layer] (a contributor's share that arrived before the
    # share in front of it), disjoint and sorted; they join rows[layer] once the gap is filled
    ahead: list[list[tuple[int, int]]] = field(default_factory=list)
    first_token: int | None = None
    first_logprob: TokenLogprob | None = None  # the first token's log-probabilities, when asked for
    draft: int | None = None  # the prefill's MTP draft for the token after first_token, if it sent one
    arrived_s: float = field(default_factory=time.monotonic)
    # its wait in the decode's queues (``kvoffload_decode.queue_wait``): for host blocks, then for a
    # sequence slot once its prompt is complete; the time its prefill and pull run is not a wait
    blocks_wait_s: float = 0.0  # waited for host blocks, once it got them
    waiting_since: float | None = None  # monotonic start of the wait it is in now (None: not waiting)
    copies: int = 0  # pulled rows being installed right now (outside the loop's lock)
    free_after_copies: str | None = None  # cancelled while copies ran: the last copy frees it
    reserved: bool = False  # holds its prompt's host-pool blocks (else it waits for them, FIFO)
    ranks_whole: bool = False  # TP: every follower rank said it holds the prompt whole
    on_reserved: Callable[[], None] | None = None  # called (under the lock) when a waiting one got blocks

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def waited_s(self, now: float) -> float:
        """Seconds spent waiting in the decode's queues so far."""
        return self.blocks_wait_s + (now - self.waiting_since if self.waiting_since is not None else 0.0)

    @property
    def prompt_complete(self) -> bool:
        return self.first_token is not None and all(r >= self.num_prompt_tokens for r in self.rows)
