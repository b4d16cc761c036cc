"""The store connector's scheduler-side bookkeeping: which blocks each step loads and saves.

Per request it keeps the prompt's chained block keys (``kvcore.pool.block_keys``, the reference engine's
keys under a vLLM model id), the request's vLLM block ids, how many tokens the connector promised
to load, and how far its full prompt blocks are saved. ``step`` turns one scheduler step into
``Transfer`` lists the worker executes:

- a load: the blocks ``[local hit, local hit + external hit)`` of a new request, once;
- a save: every prompt block that this step completes (computed tokens after the step cover it),
  never a block that was a local or pool hit.

No vLLM import: the connector adapts vLLM's scheduler output to these plain arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvcore.pool.block_keys import block_keys
from kvoffload_vllm.kv_groups import skip_null


@dataclass(frozen=True)
class Scheduled:
    """One request of a scheduler step: ``first`` (scheduled for the first time: ``block_ids`` are all
    its blocks) or not (``block_ids``: the blocks added, all of them again when ``resumed``, None for
    none); block ids are per KV cache group (``block_ids[g]``); ``computed`` tokens before the step,
    ``scheduled`` in it; ``prompt`` only when first."""

    req_id: str
    first: bool
    resumed: bool
    prompt: Sequence[int] | None
    block_ids: tuple[list[int], ...] | None
    computed: int
    scheduled: int


def scheduled_requests(scheduler_output) -> Iterator[Scheduled]:
    """The requests of vLLM's ``SchedulerOutput`` (new, then running), with every KV cache group's block ids."""
    counts = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        yield Scheduled(
            new.req_id,
            True,
            False,
            new.prompt_token_ids,
            tuple(new.block_ids),
            new.num_computed_tokens,
            counts.get(new.req_id, 0),
        )
    cached = scheduler_output.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        yield Scheduled(
            rid,
            False,
            rid in cached.resumed_req_ids,
            None,
            tuple(new_ids) if new_ids else None,
            cached.num_computed_tokens[i],
            counts.get(rid, 0),
        )


@dataclass(frozen=True)
class Transfer:
    """Blocks of one request to load or save: ``keys[i]`` <-> vLLM block ``block_ids[i]`` of KV cache
    group ``group``, the request's block ``start + i``."""

    request_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    start: int = 0
    group: int = 0


@dataclass
class _Request:
    prompt_len: int
    keys: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    external: int = 0  # tokens the connector promised to load (set at allocation, consumed by a load)
    saved: int = 0  # full prompt blocks already saved or already present


class StorePlanner:
    """One KV cache group's bookkeeping (``group``: its index, ``block_size``: its block size)."""

    def __init__(self, model_id: str, block_size: int, group: int = 0) -> None:
        self.model_id, self.block_size, self.group = model_id, block_size, group
        self._reqs: dict[str, _Request] = {}

    def _request(self, request_id: str, prompt: Sequence[int]) -> _Request:
        req = self._reqs.get(request_id)
        if req is None:
            req = self._reqs[request_id] = _Request(
                len(prompt), block_keys(self.model_id, list(prompt), self.block_size)
            )
        return req

    def lookup(
        self, request_id: str, prompt: Sequence[int], num_computed: int, exists: Callable[[list[bytes]], list[bool]]
    ) -> int:
        """Tokens beyond ``num_computed`` (block-aligned) the pool holds: the leading run of complete
        blocks, leaving at least one prompt token to compute. Asks ``exists`` at most once."""
        req = self._request(request_id, prompt)
        first, usable = num_computed // self.block_size, (len(prompt) - 1) // self.block_size
        if usable <= first:
            return 0
        present = exists(req.keys[first:usable])
        run = next((i for i, ok in enumerate(present) if not ok), len(present))
        return run * self.block_size

    def allocated(self, request_id: str, num_external: int) -> None:
        """vLLM allocated blocks for the request, ``num_external`` of its tokens to come from the pool."""
        if request_id in self._reqs:
            self._reqs[request_id].external = num_external

    def new_request(
        self, request_id: str, prompt: Sequence[int], block_ids: Sequence[int], num_computed: int, num_scheduled: int
    ) -> tuple[Transfer | None, Transfer | None]:
        """A request scheduled for the first time: (its load or None, its save or None)."""
        req = self._request(request_id, prompt)
        req.block_ids = list(block_ids)
        load = None
        if req.external:
            first = (num_computed - req.external) // self.block_size
            n = req.external // self.block_size
            load = self._transfer(request_id, req, first, first + n)
            req.external = 0
        req.saved = num_computed // self.block_size
        return load, self._save(request_id, req, num_computed + num_scheduled)

    def running_request(
        self, request_id: str, new_block_ids: Sequence[int] | None, resumed: bool, num_computed: int, num_scheduled: int
    ) -> Transfer | None:
        """A request scheduled again (``resumed``: after a preemption, ``new_block_ids`` is all of them)."""
        req = self._reqs.get(request_id)
        if req is None:
            return None
        if resumed:
            req.block_ids = list(new_block_ids or ())
            req.saved = num_computed // self.block_size
        elif new_block_ids:
            req.block_ids.extend(new_block_ids)
        return self._save(request_id, req, num_computed + num_scheduled)

    def _save(self, request_id: str, req: _Request, computed_after: int) -> Transfer | None:
        full = min(min(computed_after, req.prompt_len) // self.block_size, len(req.block_ids))
        if full <= req.saved:
            return None
        out = self._transfer(request_id, req, req.saved, full)
        req.saved = full
        return out

    def _transfer(self, request_id: str, req: _Request, start: int, end: int) -> Transfer | None:
        """The request's blocks ``[start, end)`` but those that are vLLM's null block (None if no block is left)."""
        start += skip_null(req.block_ids[start:end])
        if start >= end:
            return None
        return Transfer(request_id, tuple(req.keys[start:end]), tuple(req.block_ids[start:end]), start, self.group)

    def block_ids(self, request_id: str) -> tuple[int, ...] | None:
        """The request's vLLM blocks so far (None: not a request the store plans)."""
        req = self._reqs.get(request_id)
        return None if req is None else tuple(req.block_ids)

    def finished(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._reqs)
