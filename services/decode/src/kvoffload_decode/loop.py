"""The decode engine loop: requests wait for their remote prefill, then decode in one batch.

Admission and deadlines (one deadline per request, end to end). A request is admitted into the
decode's queue at once, never after a wait: ``expect_remote`` raises ``DecodeFull`` (HTTP 429 with
``Retry-After``) only when ``max_queued`` requests already wait for the running batch. An admitted
request reserves its prompt's host-pool blocks right away — a sequence slot (device row) too when
one is free; otherwise its pulled indexer keys are staged on the host (``SparseDecoder.reserve``).
So the decode registers it at the proxy's metaserver at once, the prefill runs while other
requests decode, and the pulled KV waits in host memory (the cheap resource) for a slot. When the
host pool cannot hold the prompt either, the request still queues (``waiting``, FIFO) and gets its
blocks as soon as others free theirs; its ``on_reserved`` callback then lets the HTTP side
register it (meanwhile the HTTP side tells the metaserver the request is queued, which lifts the
proxy's registration deadline). Nothing in the decode times a queued request out: it waits until
the client (or the proxy's ``--request-timeout-s``) gives up, which cancels it.

The transfer servicer installs each pulled layer (``write_rows``) and the prefill's first token
(``prefill_done``). Once every layer holds the whole prompt and the first token is known, the
request joins the running batch as soon as it has (or gets) a sequence slot, in arrival order; the
loop thread runs one ``SparseDecoder`` step for the batch at a time, samples, and hands every token
to the request's ``emit`` callback. ``cancel`` frees a request at any stage.

Gathering a batch (``step_gather_s``, ``--step-gather-ms``). A step costs nearly the same for one
request as for a full batch (the model's fixed per-layer work dominates), and on cores it shares
with a prefill every step is time that prefill does not get. So at saturation — the batch has
room, and more admitted requests are on their way (their prefill or pull running) than that room
holds — the loop holds the next step until one of them can join or ``step_gather_s`` has passed
since the previous step began. Below saturation (every request on its way fits, or nothing is on
its way) it steps at once: a lone request, or a few long prompts arriving one by one, decode at
full speed, and only a backlog, which will fill the batch anyway, trades a little TPOT for
throughput (``bench load``: about 40 % less decode CPU for the same tokens, TPOT still under the
single-process engine's). ``stats()`` counts the waits.

Speculative decoding (``num_speculative_tokens`` 1, ``--speculative-config``): a greedy request
whose PrefillDone carried the prefill's MTP draft starts with it, and every step verifies and
redrafts (``dsamodel.engine.speculative``): one or two tokens per request and step, the same
greedy tokens as without it; ``stats()`` counts drafts and accepted drafts.

The ledger records each request's stage (admitted -> awaiting_prefill -> pulling -> ready ->
decoding) and outcome; while pulling — once the prefill has been heard from (heartbeat, ReadReady
or PrefillDone) and until the prompt is complete — silence longer than ``peer_timeout_s`` fails
the request with an error naming the prefill and the stage, and frees its host blocks: a prefill
that died or hung never strands a decode allocation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch
from dsamodel.engine.decode import SparseDecoder
from dsamodel.engine.speculative import DraftStats, decode_step
from dsamodel.engine.tp_decode import LeadDecoder
from dsamodel.sampling import RequestSampler, SamplingParams, TokenLogprob
from svcruntime.ledger import Entry, Ledger

log = structlog.get_logger(__name__)

YIELD_S = 0.0002  # the loop's pause between steps, so other threads can take the lock
RANK_POLL_S = 0.002  # TP: the pause between polls of the follower ranks while a request waits on them
DEFAULT_STEP_GATHER_S = 0.05  # the longest a step waits for requests on their way (module doc)
Emit = Callable[[str, object], None]  # ("token", id) | ("done", finish_reason) | ("error", message)


def default_max_queued(decoder: SparseDecoder) -> int:
    """The default queue limit (``--max-queued-requests 0``): as many requests as the host pool holds
    at a quarter of ``max_model_len`` each, at least 4 per sequence slot, at most 1024. Queued
    requests hold host blocks, not device rows, so host memory is what bounds the queue."""
    g = decoder.pool.geometry
    pool_tokens = g.num_blocks * g.block_size
    by_pool = pool_tokens // max(1, decoder.max_model_len // 4)
    return int(min(1024, max(4 * decoder.indexer.shape[1], by_pool)))


def installed_prefix(prefix: int, ahead: list[tuple[int, int]], start: int, end: int) -> int:
    """Rows ``[0, prefix)`` and the ranges in ``ahead`` are installed; so is ``[start, end)`` now.
    Returns the new length of the installed prefix; ``ahead`` keeps (sorted, updated in place) the
    ranges still separated from it by a gap. Contributor ranks send their shares of a layer in any
    order, and a retry or duplicate may repeat a range."""
    if end <= start:
        return prefix
    ahead.append((start, end))
    ahead.sort()
    while ahead and ahead[0][0] <= prefix:
        prefix = max(prefix, ahead.pop(0)[1])
    return prefix


class TooLarge(ValueError):
    """The prompt does not fit in the decode's whole host pool."""


class DecodeFull(RuntimeError):
    """The decode's queue is full: a new request is refused at once (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


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
    copies: int = 0  # pulled rows being installed right now (outside the loop's lock)
    free_after_copies: str | None = None  # cancelled while copies ran: the last copy frees it
    reserved: bool = False  # holds its prompt's host-pool blocks (else it waits for them, FIFO)
    ranks_whole: bool = False  # TP: every follower rank said it holds the prompt whole
    on_reserved: Callable[[], None] | None = None  # called (under the lock) when a waiting one got blocks

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_complete(self) -> bool:
        return self.first_token is not None and all(r >= self.num_prompt_tokens for r in self.rows)


class DecodeLoop:
    """Owns the ``SparseDecoder``.

    Two locks, always taken in this order: ``engine_lock`` serializes every call that changes the
    decoder's state (a step, admission, freeing); ``lock`` (a condition) guards the bookkeeping —
    pending and running requests, rows installed, first tokens. A step holds ``engine_lock`` for
    its whole compute and sampling but ``lock`` only to pick the batch and to hand out the tokens, so
    the transfer path (ReadReady, heartbeats, PrefillDone: ``lock`` only) never waits for a step,
    and a prefill's reuse gates never wait for the decode's batch. Pulled rows are copied outside
    both locks (a request's rows and blocks are its own)."""

    def __init__(self, decoder: SparseDecoder, eos_token_id: int | None, peer_timeout_s: float = 10.0,
                 max_queued: int | None = None, num_speculative_tokens: int = 0,
                 step_gather_s: float = DEFAULT_STEP_GATHER_S) -> None:
        if num_speculative_tokens not in (0, 1):
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens}: must be 0 or 1")
        if num_speculative_tokens and not decoder.model.config.num_nextn_predict_layers:
            raise ValueError("speculative decoding needs a model with an MTP layer (num_nextn_predict_layers >= 1)")
        self.decoder = decoder
        # TP (a LeadDecoder): the follower ranks pull their own rows; a request runs once all hold it
        self.lead = decoder if isinstance(decoder, LeadDecoder) else None
        self.speculative = num_speculative_tokens
        self.draft_stats = DraftStats()
        self.peer_timeout_s = peer_timeout_s
        if step_gather_s < 0:
            raise ValueError(f"step_gather_s={step_gather_s}: must be >= 0")
        self.step_gather_s = step_gather_s
        self.gather_waits = 0  # steps held for a request on its way
        self.gather_wait_s = 0.0
        self._step_started = 0.0  # monotonic start of the previous step
        self.max_queued = max_queued if max_queued is not None else default_max_queued(decoder)
        self.ledger = Ledger(self._timed_out).start()
        self.eos_token_id = eos_token_id
        self.engine_lock = threading.RLock()  # taken before ``lock``, never after
        self.lock = threading.Condition(threading.RLock())
        self.pending: dict[str, DecodeRequest] = {}  # admitted, not running yet (blocks reserved or waiting)
        self.waiting: list[DecodeRequest] = []  # the pending ones still waiting for host blocks, FIFO
        self.running: list[DecodeRequest] = []
        self.rejected = 0  # requests refused because the queue was full
        self._next: dict[str, int] = {}
        self._drafts: dict[str, int] = {}  # running greedy requests' MTP drafts (speculative decoding)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        self._thread.start()

    # ---- called by the HTTP handlers and the transfer servicer --------------------------------

    def expect_remote(self, request_id: str, prompt_ids: list[int], params: SamplingParams, emit: Emit,
                      on_reserved: Callable[[], None] | None = None) -> DecodeRequest:
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
                raise DecodeFull(f"decode queue is full ({len(self.pending)} queued, {len(self.running)} "
                                 f"running, limit --max-queued-requests={self.max_queued}); retry later",
                                 retry_after_s=self.retry_after_s())
            req = DecodeRequest(request_id, prompt_ids, RequestSampler(params, self.eos_token_id), emit,
                                len(self.decoder.model.cache_layers), on_reserved=on_reserved)
            req.rows = [0] * req.num_layers
            req.ahead = [[] for _ in range(req.num_layers)]
            reserved = not self.waiting and self._reserve(req)  # TooLarge: refused, nothing held
            self.ledger.open(request_id, "admitted")
            self.pending[request_id] = req
            if not reserved:
                self.waiting.append(req)
                self.ledger.advance(request_id, "queued")
            return req

    def retry_after_s(self) -> float:
        """A client's pause before retrying a refused request: 1 s, up to 5 s for a queue many times
        deeper than the batch (a refusal is cheap; a long pause would leave the queue idle)."""
        return float(max(1, min(5, len(self.pending) // (16 * max(1, self.decoder.indexer.shape[1])))))

    def _reserve(self, req: DecodeRequest) -> bool:
        """Host blocks for the prompt (+ the first sampled token), and a sequence slot when one is free
        and no queued request waits for one (a slot taken at arrival idles through the prefill, so
        with a queue, slots go to complete prompts in arrival order); False when the pool cannot
        hold the blocks now."""
        n = len(req.prompt_ids) + 1
        if not self.decoder.can_reserve(n):
            if not self.decoder.seqs:  # nothing holds blocks, so none will be freed: it can never fit
                raise TooLarge(f"the prompt ({len(req.prompt_ids)} tokens) does not fit in this decode's "
                               f"host pool ({self.decoder.pool.stats().capacity_bytes} bytes)")
            return False
        self.decoder.reserve(req.request_id, n)
        if self.decoder.free_slots and not any(self.decoder.seqs[r.request_id].seq_slot is None
                                               for r in self.pending.values() if r.reserved):
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
            self.ledger.advance(req.request_id, "admitted")
            if req.on_reserved is not None:
                req.on_reserved()

    def awaiting_prefill(self, request_id: str) -> None:
        """The decode told the proxy where to push; the prefill's first report starts the watchdog."""
        self.ledger.advance(request_id, "awaiting_prefill")

    def heard_from_prefill(self, request_id: str, peer: str) -> bool:
        """News from the prefill about a pending request (heartbeat, ReadReady, PrefillDone): from
        now on its silence is bounded by ``peer_timeout_s``. False when the request is not pending."""
        with self.lock:
            if request_id not in self.pending:
                return False
        if self.ledger.stage_of(request_id) in ("admitted", "awaiting_prefill"):
            self.ledger.advance(request_id, "pulling", peer=peer, silence_limit_s=self.peer_timeout_s)
        return self.ledger.touch(request_id)

    def pending_request(self, request_id: str) -> DecodeRequest | None:
        with self.lock:
            return self.pending.get(request_id)

    def write_rows(self, request_id: str, layer: int, start: int, kv: torch.Tensor, index_k: torch.Tensor) -> float:
        """Install rows [start, start + n) of a layer pulled from the prefill; returns the seconds the
        copy took. The copy runs outside the loop's lock (a decode step need not wait for it, nor it
        for a step): the request's rows and blocks are its own, and a cancel that arrives meanwhile
        is carried out by the last copy to finish."""
        with self.lock:
            req = self.pending.get(request_id)
            if req is None:
                raise KeyError(request_id)
            if start + kv.shape[0] > req.num_prompt_tokens:
                raise ValueError(f"rows [{start}, {start + kv.shape[0]}) go past the prompt's "
                                 f"{req.num_prompt_tokens} tokens")
            req.copies += 1
        t = time.perf_counter()
        ok = False
        try:
            self.decoder.write_prompt_layer(request_id, layer, kv, index_k, start=start)
            ok = True
        finally:
            elapsed = time.perf_counter() - t
            free = None
            with self.lock:
                req.copies -= 1
                if req.free_after_copies is not None:
                    if not req.copies:
                        free = req.free_after_copies  # the last copy frees it (decoder state: engine_lock)
                    ok = False
                elif ok:
                    req.rows[layer] = installed_prefix(req.rows[layer], req.ahead[layer], start, start + kv.shape[0])
                self.lock.notify_all()
            if free is not None:
                with self.engine_lock, self.lock:
                    self._free(req, free)
        if not ok:
            raise KeyError(request_id)  # cancelled while its rows were copied
        return elapsed

    def prefill_done(self, request_id: str, num_prompt_tokens: int, first_token: int,
                     first_logprob: TokenLogprob | None = None, draft_token: int | None = None) -> str:
        """The prefill's first token (and its log-probabilities when the request asked for them, and
        its MTP draft when it sent one); returns "" when accepted, else why not."""
        with self.lock:
            req = self.pending.get(request_id)
            if req is None:
                raise KeyError(request_id)
            if num_prompt_tokens != req.num_prompt_tokens:
                return (f"prefill had {num_prompt_tokens} prompt tokens, the decode request "
                        f"{req.num_prompt_tokens}")
            want = req.sampler.params.logprobs
            if want is not None and (first_logprob is None or first_logprob.token != first_token
                                     or len(first_logprob.top) < want):
                return (f"the request asks for logprobs (top {want}); the prefill sent "
                        f"{'none' if first_logprob is None else 'others'} for its first token")
            vocab = self.decoder.model.config.vocab_size
            if not 0 <= first_token < vocab:
                return f"first token {first_token} is outside the vocabulary"
            if draft_token is not None and not 0 <= draft_token < vocab:
                return f"draft token {draft_token} is outside the vocabulary"
            req.first_token = first_token
            req.draft = draft_token
            req.first_logprob = first_logprob if want is not None else None
            if req.prompt_complete:  # nothing more to hear from the prefill: the watchdog stands down
                self.ledger.advance(request_id, "ready")
            self.lock.notify_all()
            return ""

    def check_prompt_complete(self, request_id: str) -> str:
        """"" if the request's prompt KV and first token are all here (or it already runs), else what
        is missing — a partial transfer is never decoded over (I5)."""
        with self.lock:
            req = self.pending.get(request_id)
            if req is None or req.prompt_complete:
                return ""
            missing = [(i, r) for i, r in enumerate(req.rows) if r < req.num_prompt_tokens]
            what = f"layer {missing[0][0]} has {missing[0][1]} of {req.num_prompt_tokens} rows" if missing \
                else "no first token"
            return f"the prefill finished but the prompt's KV is incomplete: {what}"

    def cancel(self, request_id: str, reason: str, outcome: str = "cancelled") -> bool:
        """Stop a request wherever it is and free everything it holds. False if unknown."""
        with self.engine_lock, self.lock:
            req = self.pending.pop(request_id, None)
            if req is None:
                req = next((r for r in self.running if r.request_id == request_id), None)
                if req is None:
                    return False
                self.running.remove(req)
            elif not req.reserved:
                self.waiting.remove(req)
            if req.copies:
                req.free_after_copies = outcome
            else:
                self._free(req, outcome, reason)
            log.info("request_cancelled", request_id=request_id, reason=reason, outcome=outcome)
            return True

    def _timed_out(self, entry: Entry, reason: str) -> None:
        """The watchdog: the request's prefill went quiet; fail it and free what it holds."""
        with self.engine_lock, self.lock:
            req = self.pending.get(entry.request_id) or next(
                (r for r in self.running if r.request_id == entry.request_id), None)
            if req is None:
                return
            req.emit("error", reason)
            self.cancel(entry.request_id, reason, outcome="timeout")
        log.warning("request_timed_out", request_id=entry.request_id, reason=reason)

    def stats(self) -> dict[str, float]:
        with self.lock:
            return {"pending": len(self.pending), "running": len(self.running),
                    "sequences": len(self.decoder.seqs), "queued": len(self.pending),
                    "waiting_for_blocks": len(self.waiting), "max_queued": self.max_queued,
                    "free_slots": self.decoder.free_slots, "rejected": self.rejected,
                    "drafts": self.draft_stats.drafts, "drafts_accepted": self.draft_stats.accepted,
                    "gather_waits": self.gather_waits, "gather_wait_s": self.gather_wait_s,
                    **self.ledger.counters()}

    def load(self) -> dict[str, float]:
        """What the proxy balances on (the ``X-Decode-Load`` header, ``/health``): queue depth,
        running requests, free sequence slots and free host-pool bytes."""
        pool = self.decoder.pool.stats()
        with self.lock:
            return {"queued": len(self.pending), "running": len(self.running), "max_queued": self.max_queued,
                    "free_slots": self.decoder.free_slots,
                    "free_pool_bytes": max(0, pool.capacity_bytes - pool.used_bytes)}

    def close(self) -> None:
        with self.engine_lock, self.lock:
            self._stop = True
            for req in list(self.pending.values()) + list(self.running):
                req.emit("error", "decode is shutting down")
                if req.copies:
                    req.free_after_copies = "shutdown"
                else:
                    self._free(req, "shutdown")
            self.pending.clear()
            self.waiting.clear()
            self.running.clear()
            self.lock.notify_all()
        self._thread.join(timeout=10)
        self.ledger.close()

    # ---- the loop thread ----------------------------------------------------------------------

    def _free(self, req: DecodeRequest, outcome: str, error: str = "") -> None:
        self.decoder.finish(req.request_id)
        self.lock.notify_all()  # a queued request may fit now
        self._next.pop(req.request_id, None)
        self._drafts.pop(req.request_id, None)
        self.ledger.finish(req.request_id, outcome, error)
        if self.waiting and not self._stop:
            self._reserve_waiting()

    def _runnable(self, req: DecodeRequest) -> bool:
        """Its prompt is complete and it holds a sequence slot or one is free (no copy in flight)."""
        if not req.prompt_complete or not req.reserved or req.copies:
            return False
        if self.lead is not None and not req.ranks_whole:
            return False
        return self.decoder.seqs[req.request_id].seq_slot is not None or self.decoder.free_slots > 0

    def _admit_ready(self) -> None:
        for rid, req in list(self.pending.items()):  # arrival order
            if not self._runnable(req):
                continue
            self.decoder.bind(rid)  # a staged request gets its device row now
            del self.pending[rid]
            self.ledger.advance(rid, "decoding")
            self.decoder.set_prompt_done(rid, req.num_prompt_tokens)
            req.sampler.accept(req.first_token, req.first_logprob)  # penalties, stop, logprobs see it
            req.emit("token", req.first_token)
            if req.sampler.finished:
                req.emit("done", req.sampler.finish_reason)
                self._free(req, "ok")
            else:
                self._next[rid] = req.first_token
                if self.speculative and req.draft is not None and req.sampler.params.temperature == 0:
                    self._drafts[rid] = req.draft
                self.running.append(req)

    def _run(self) -> None:
        while True:
            # Between steps the lock is free for a moment *without* this thread holding the GIL:
            # released and re-taken in one breath, it starves every other thread (Stats, admission,
            # pulls, cancels waited seconds behind a long generation).
            time.sleep(YIELD_S)
            with self.lock:
                while not self._stop and not self.running and not any(self._runnable(r) for r in self.pending.values()):
                    if self._awaiting_ranks():
                        break  # polled below
                    self.lock.wait(timeout=1.0)
                self._gather()
            if self.lead is not None and not self._poll_ranks() and not self.running:
                time.sleep(RANK_POLL_S)
            with self.engine_lock:  # the batch cannot change until the step is sampled
                with self.lock:
                    if self._stop:
                        return
                    self._admit_ready()
                    if not self.running:
                        continue
                    batch = [(r.request_id, r.sampler) for r in self.running]
                    self._step_started = time.monotonic()
                try:  # without ``lock``: pulls go on (``engine_lock`` keeps the batch as it is)
                    produced = decode_step(self.decoder, batch, self._next, self._drafts, self.draft_stats)
                    with self.lock:
                        self._hand_out(produced)
                except Exception as exc:  # a failed step fails the batch, not the service
                    with self.lock:
                        log.error("decode_step_failed", error=repr(exc),
                                  request_ids=[r.request_id for r in self.running])
                        for req in self.running:
                            req.emit("error", f"decode step failed: {exc}")
                            self._free(req, "error", repr(exc))
                        self.running.clear()

    def _awaiting_ranks(self) -> list[DecodeRequest]:
        """Under ``lock``, TP: the requests rank 0 holds whole that not every follower has confirmed."""
        if self.lead is None:
            return []
        return [r for r in self.pending.values() if r.prompt_complete and r.reserved and not r.ranks_whole]

    def _poll_ranks(self) -> bool:
        """TP: ask the followers which requests they hold whole; True when one became runnable. A
        poll that fails (a follower is gone) fails the requests that waited on it."""
        with self.lock:
            waiting = self._awaiting_ranks()
        if not waiting:
            return False
        try:
            with self.engine_lock:
                answers = self.lead.poll()
        except Exception as exc:
            log.error("tp_poll_failed", error=repr(exc), request_ids=[r.request_id for r in waiting])
            for req in waiting:
                req.emit("error", f"decode TP ranks: {exc}")
                self.cancel(req.request_id, str(exc), outcome="error")
            return False
        whole = set.intersection(*(set(a) for a in answers))
        with self.lock:
            ready = [r for r in waiting if r.request_id in whole and r.request_id in self.pending]
            for req in ready:
                req.ranks_whole = True
            if ready:
                self.lock.notify_all()
        return bool(ready)

    def _gather(self) -> None:
        """Under ``lock``: at saturation (more requests on their way than the batch has room for),
        hold the next step until one can join or ``step_gather_s`` has passed since the previous
        step began (module doc)."""
        began = time.monotonic()
        deadline = self._step_started + self.step_gather_s
        waited = False
        while not self._stop and self.running:
            room = self.decoder.max_num_seqs - len(self.running)
            coming = [r for r in self.pending.values() if r.reserved]  # not those still waiting for blocks
            if room <= 0 or len(coming) <= room or any(self._runnable(r) for r in coming):
                break  # a full batch, not saturated (every request on its way fits), or one can join now
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waited = True
            self.lock.wait(left)  # write_rows / prefill_done / _free notify
        if waited:
            self.gather_waits += 1
            self.gather_wait_s += time.monotonic() - began

    def _hand_out(self, produced: dict[str, list[int]]) -> None:
        """Hand the step's tokens (one or two per request, already sampled) to the running requests."""
        for req in list(self.running):
            for token in produced[req.request_id]:
                req.emit("token", token)
            if req.sampler.finished:
                req.emit("done", req.sampler.finish_reason)
                self.running.remove(req)
                self._free(req, "ok")
