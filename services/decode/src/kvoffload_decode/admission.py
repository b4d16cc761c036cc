"""The decode loop's admission (``Admission``, a part of ``DecodeLoop``): a request is admitted into
the decode's queue at once, never after a wait.

``expect_remote`` raises ``DecodeFull`` (HTTP 429 with ``Retry-After``) when ``max_queued``
requests already wait for the running batch, or when the queue's measured pace says the request
would not start within ``max_queue_wait_s`` (``kvoffload_decode.queue_wait``); a request still
queued past that bound is refused then (``_expire_queued``, called by the loop). Each refusal's
``Retry-After`` is when the same pace says the request, sent again, would be admitted
(``StartPace.retry_after_s``). An admitted
request reserves its prompt's host-pool blocks right away — a sequence slot (device row) too when
one is free; otherwise its pulled indexer keys are staged on the host (``SparseDecoder.reserve``).
So the decode registers it at the proxy's metaserver at once, the prefill runs while other
requests decode, and the pulled KV waits in host memory (the cheap resource) for a slot. When the
host pool cannot hold the prompt either, the request still queues (``waiting``, FIFO) and gets its
blocks as soon as others free theirs (``_reserve_waiting``); its ``on_reserved`` callback then lets
the HTTP side register it (meanwhile the HTTP side tells the metaserver the request is queued,
which lifts the proxy's registration deadline). A queued request waits at most
``max_queue_wait_s`` (or until the client gives up, which cancels it). A prompt that does not fit
in the whole host pool is refused (``TooLarge``, HTTP 413).

It works on the loop's state (``decoder``, ``engine_lock`` and ``lock``, ``pending``, ``waiting``,
``running``, ``ledger``, ``pace``; ``kvoffload_decode.loop_state``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dsamodel.sampling import RequestSampler
from kvoffload_decode.loop_state import LoopState
from kvoffload_decode.queue_wait import EXPIRY_SCAN_S, DecodeFull, expired, refusal
from kvoffload_decode.request import DecodeRequest, Emit
from kvoffload_engine.decode import SparseDecoder
from openai_api.sampling_params import SamplingParams


class TooLarge(ValueError):
    """The prompt does not fit in the decode's whole host pool."""


def default_max_queued(decoder: SparseDecoder) -> int:
    """The default queue limit (``--max-queued-requests 0``): as many requests as the host pool holds
    at a quarter of ``max_model_len`` each, at least 4 per sequence slot, at most 1024. Queued
    requests hold host blocks, not device rows, so host memory is what bounds the queue."""
    g = decoder.pool.geometry
    pool_tokens = g.num_blocks * g.block_size
    by_pool = pool_tokens // max(1, decoder.max_model_len // 4)
    return int(min(1024, max(4 * decoder.indexer.shape[1], by_pool)))


class Admission(LoopState):
    """``DecodeLoop``'s admission (module doc)."""

    expiry_scanned_at: float  # (LoopState's; declared here too, as this part assigns it)

    def expect_remote(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: Emit,
        on_reserved: Callable[[], None] | None = None,
    ) -> DecodeRequest:
        """Admit a request whose KV a prefill will push, at once: its host blocks (and a sequence slot
        if one is free) are reserved now, or — host pool full — it waits for them (``req.reserved``
        False; ``on_reserved`` is called, under the loop's lock, when it got them). Raises DecodeFull
        when ``max_queued`` requests already wait for the batch, ValueError for a reused id."""
        with self.engine_lock, self.lock:
            if request_id in self.pending or any(r.request_id == request_id for r in self.running):
                raise ValueError(f"request id {request_id!r} is already in use")
            if self._stop:
                raise DecodeFull("decode is shutting down")
            if len(self.pending) >= self.max_queued:
                self.rejected += 1
                wait = self._retry_after_s(len(self.pending))
                raise DecodeFull(
                    f"decode queue is full ({len(self.pending)} queued, {len(self.running)} "
                    f"running, limit --max-queued-requests={self.max_queued}); retry after {wait} s",
                    retry_after_s=wait,
                )
            estimate = self.pace.estimate_s(len(self.pending)) if not self.decoder.free_slots else None
            if self.max_queue_wait_s and estimate is not None and estimate > self.max_queue_wait_s:
                self.rejected += 1
                self.rejected_by_estimate += 1
                wait = self._retry_after_s(len(self.pending))
                raise refusal(estimate, len(self.pending), self.pace, self.max_queue_wait_s, wait)
            req = DecodeRequest(
                request_id,
                prompt_ids,
                RequestSampler(params, self.eos_token_id),
                emit,
                len(self.decoder.model.cache_layers),
                on_reserved=on_reserved,
            )
            req.rows = [0] * req.num_layers
            req.ahead = [[] for _ in range(req.num_layers)]
            reserved = not self.waiting and self._reserve(req)  # TooLarge: refused, nothing held
            self.ledger.open(request_id, "admitted")
            self.pending[request_id] = req
            if not reserved:
                req.waiting_since = req.arrived_s
                self.waiting.append(req)
                self.ledger.advance(request_id, "queued")
            return req

    def _retry_after_s(self, ahead: int) -> int:
        """A refused request's ``Retry-After``, behind ``ahead`` queued ones: when the queue's pace says
        it would be admitted (``StartPace.retry_after_s``); before a pace is measured, 1 s, up to 5 s
        for a queue many times deeper than the batch."""
        wait = self.pace.retry_after_s(time.monotonic(), ahead, self.max_queue_wait_s, self.max_queued)
        if wait is None:
            return max(1, min(5, len(self.pending) // (16 * max(1, self.decoder.indexer.shape[1]))))
        return wait

    def _queue_expired(self) -> bool:
        """Under ``lock``: the request waiting longest for host blocks has waited past the bound
        (``waiting`` is FIFO; a request waits for a slot only while others run, and steps check it)."""
        oldest = self.waiting[0] if self.waiting else None
        return (
            bool(self.max_queue_wait_s)
            and oldest is not None
            and (oldest.waited_s(time.monotonic()) > self.max_queue_wait_s)
        )

    def _expire_queued(self) -> None:
        """Under both locks, at most every ``EXPIRY_SCAN_S``: refuse (``QueueWaitExceeded``, HTTP 429)
        and free every queued request that waited past the bound in the decode's queues — for host
        blocks, or for a slot once its prompt is complete (``kvoffload_decode.queue_wait``)."""
        now = time.monotonic()
        if not self.max_queue_wait_s or now - self.expiry_scanned_at < EXPIRY_SCAN_S and not self._queue_expired():
            return
        self.expiry_scanned_at = now
        for req in list(self.pending.values()):
            if req.waiting_since is None and req.reserved and req.prompt_complete:
                req.waiting_since = now  # complete: from now on it waits for a slot
            waited = req.waited_s(now)
            if waited > self.max_queue_wait_s:
                refused = expired(waited, self.max_queue_wait_s, self._retry_after_s(len(self.pending) - 1))
                req.emit("error", refused)
                self.cancel(req.request_id, str(refused), outcome="queue_timeout")
                self.queue_timeouts += 1

    def _reserve(self, req: DecodeRequest) -> bool:
        """Host blocks for the prompt (+ the first sampled token), and a sequence slot when one is free
        and no queued request waits for one (a slot taken at arrival idles through the prefill, so
        with a queue, slots go to complete prompts in arrival order); False when the pool cannot
        hold the blocks now."""
        n = len(req.prompt_ids) + 1
        if not self.decoder.can_reserve(n):
            if not self.decoder.seqs:  # nothing holds blocks, so none will be freed: it can never fit
                raise TooLarge(
                    f"the prompt ({len(req.prompt_ids)} tokens) does not fit in this decode's "
                    f"host pool ({self.decoder.pool.stats().capacity_bytes} bytes)"
                )
            return False
        self.decoder.reserve(req.request_id, n)
        if self.decoder.free_slots and not any(
            self.decoder.seqs[r.request_id].seq_slot is None for r in self.pending.values() if r.reserved
        ):
            self.decoder.bind(req.request_id)
        req.reserved = True
        return True

    def _reserve_waiting(self) -> None:
        """Blocks were freed: give them to the waiting requests, first come first served."""
        while self.waiting and not self._stop:
            req = self.waiting[0]
            try:
                if not self._reserve(req):
                    return
            except TooLarge as exc:
                req.emit("error", str(exc))
                self.cancel(req.request_id, str(exc), outcome="error")
                continue
            self.waiting.pop(0)
            now = time.monotonic()
            req.blocks_wait_s, req.waiting_since = req.waited_s(now), None
            self.ledger.advance(req.request_id, "admitted")
            if req.on_reserved is not None:
                req.on_reserved()
