"""The decode engine loop: requests wait for their remote prefill, then decode in one batch.

``DecodeLoop`` owns the ``SparseDecoder`` and the requests, from admission to the last token. Its
jobs, one module each: admission and the wait for host blocks (``kvoffload_decode.admission``), what
the transfer path reports — pulled rows, the first token, the prefill's news that keeps the
watchdog quiet (``kvoffload_decode.prefill_reports``, installing rows through
``kvoffload_decode.rows``), TP: the polls of the follower ranks (``kvoffload_decode.rank_poll``);
and here, the batch. A queued request starts within ``max_queue_wait_s`` or is refused (HTTP 429:
at admission when the queue's pace says it would not, ``kvoffload_decode.queue_wait``, else once the
bound has passed); the client (or the proxy's ``--request-timeout-s``) may give up sooner, which
cancels it; a prefill that goes quiet while the request is pulled fails it (the watchdog,
``_timed_out``).

Once every layer holds the whole prompt and the first token is known, the request joins the running
batch as soon as it has (or gets) a sequence slot, in arrival order; the loop thread runs one
``SparseDecoder`` step for the batch at a time, samples, and hands every token to the request's
``emit`` callback. ``cancel`` frees a request at any stage.

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
redrafts (``kvoffload_engine.speculative``): one or two tokens per request and step, the same
greedy tokens as without it; ``stats()`` counts drafts and accepted drafts.
"""

from __future__ import annotations

import threading
import time

import structlog

from kvoffload_decode.admission import Admission, default_max_queued
from kvoffload_decode.prefill_reports import PrefillReports
from kvoffload_decode.queue_wait import DEFAULT_MAX_QUEUE_WAIT_S, StartPace
from kvoffload_decode.rank_poll import RANK_POLL_S, RankPolling
from kvoffload_decode.request import DecodeRequest
from kvoffload_decode.rows import RowInstaller
from kvoffload_engine.decode import SparseDecoder
from kvoffload_engine.speculative import DraftStats, decode_step
from kvoffload_engine.tp_decode import LeadDecoder
from svcruntime.ledger import Entry, Ledger

log = structlog.get_logger(__name__)

YIELD_S = 0.0002  # the loop's pause between steps, so other threads can take the lock
DEFAULT_STEP_GATHER_S = 0.05  # the longest a step waits for requests on their way (module doc)


class DecodeLoop(Admission, PrefillReports, RankPolling):
    """Owns the ``SparseDecoder``.

    Two locks, always taken in this order: ``engine_lock`` serializes every call that changes the
    decoder's state (a step, admission, freeing); ``lock`` (a condition) guards the bookkeeping —
    pending and running requests, rows installed, first tokens. A step holds ``engine_lock`` for
    its whole compute and sampling but ``lock`` only to pick the batch and to hand out the tokens, so
    the transfer path (ReadReady, heartbeats, PrefillDone: ``lock`` only) never waits for a step,
    and a prefill's reuse gates never wait for the decode's batch. Pulled rows are copied outside
    both locks (a request's rows and blocks are its own)."""

    def __init__(
        self,
        decoder: SparseDecoder,
        eos_token_id: int | None,
        peer_timeout_s: float = 10.0,
        max_queued: int | None = None,
        num_speculative_tokens: int = 0,
        step_gather_s: float = DEFAULT_STEP_GATHER_S,
        max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S,
    ) -> None:
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
        if not max_queue_wait_s >= 0:
            raise ValueError(f"max_queue_wait_s={max_queue_wait_s}: must be >= 0 (0: no bound)")
        self.max_queue_wait_s = max_queue_wait_s
        self.pace = StartPace()
        self.queue_timeouts = 0
        self.expiry_scanned_at = 0.0  # monotonic time of the last scan for requests past the bound
        self.ledger = Ledger(self._timed_out).start()
        self.eos_token_id = eos_token_id
        self.engine_lock = threading.RLock()  # taken before ``lock``, never after
        self.lock = threading.Condition(threading.RLock())
        self.pending: dict[str, DecodeRequest] = {}  # admitted, not running yet (blocks reserved or waiting)
        self.waiting: list[DecodeRequest] = []  # the pending ones still waiting for host blocks, FIFO
        self.running: list[DecodeRequest] = []
        self.rejected = 0  # requests refused at admission (queue full, or the estimate past the bound)
        self.rejected_by_estimate = 0
        self._next: dict[str, int] = {}
        self._drafts: dict[str, int] = {}  # running greedy requests' MTP drafts (speculative decoding)
        self.installer = RowInstaller(decoder, self.lock, self.pending, free=self._free_copied)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        self._thread.start()

    # ---- called by the HTTP handlers and the transfer servicer (more in the mixins) -----------

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
                (r for r in self.running if r.request_id == entry.request_id), None
            )
            if req is None:
                return
            req.emit("error", reason)
            self.cancel(entry.request_id, reason, outcome="timeout")
        log.warning("request_timed_out", request_id=entry.request_id, reason=reason)

    def stats(self) -> dict[str, float]:
        with self.lock:
            return {
                "pending": len(self.pending),
                "running": len(self.running),
                "sequences": len(self.decoder.seqs),
                "queued": len(self.pending),
                "waiting_for_blocks": len(self.waiting),
                "max_queued": self.max_queued,
                "free_slots": self.decoder.free_slots,
                "rejected": self.rejected,
                "rejected_by_estimate": self.rejected_by_estimate,
                "queue_timeouts": self.queue_timeouts,
                "start_interval_s": self.pace.interval_s or 0.0,
                "max_queue_wait_s": self.max_queue_wait_s,
                "drafts": self.draft_stats.drafts,
                "drafts_accepted": self.draft_stats.accepted,
                "gather_waits": self.gather_waits,
                "gather_wait_s": self.gather_wait_s,
                **self.ledger.counters(),
            }

    def load(self) -> dict[str, float]:
        """What the proxy balances on (the ``X-Decode-Load`` header, ``/health``): queue depth,
        running requests, free sequence slots and free host-pool bytes."""
        pool = self.decoder.pool.stats()
        with self.lock:
            return {
                "queued": len(self.pending),
                "running": len(self.running),
                "max_queued": self.max_queued,
                "free_slots": self.decoder.free_slots,
                "free_pool_bytes": max(0, pool.capacity_bytes - pool.used_bytes),
            }

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

    def _free_copied(self, req: DecodeRequest, outcome: str) -> None:
        """A request cancelled while its rows were copied, freed by its last copy."""
        with self.engine_lock, self.lock:
            self._free(req, outcome)

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
            first = req.first_token  # known once runnable (its prompt is complete)
            if first is None or not self._runnable(req):
                continue
            self.decoder.bind(rid)  # a staged request gets its device row now
            del self.pending[rid]
            self.pace.started(time.monotonic(), backlog=bool(self.pending))
            self.ledger.advance(rid, "decoding")
            self.decoder.set_prompt_done(rid, req.num_prompt_tokens)
            req.sampler.accept(first, req.first_logprob)  # penalties, stop, logprobs see it
            req.emit("token", first)
            if req.sampler.finished:
                req.emit("done", req.sampler.finish_reason)
                self._free(req, "ok")
            else:
                self._next[rid] = first
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
                    if self._awaiting_ranks() or self._queue_expired():
                        break  # polled / refused below
                    self.lock.wait(timeout=1.0)
                self._gather()
            if self.lead is not None and not self._poll_ranks() and not self.running:
                time.sleep(RANK_POLL_S)
            with self.engine_lock:  # the batch cannot change until the step is sampled
                with self.lock:
                    if self._stop:
                        return
                    self._expire_queued()
                    self._admit_ready()
                    if not self.running:
                        continue
                    batch = [(r.request_id, r.sampler) for r in self.running]
                    self._step_started = time.monotonic()
                try:  # without ``lock``: pulls go on (``engine_lock`` keeps the batch as it is)
                    produced = decode_step(self.decoder, batch, self._next, self._drafts, self.draft_stats)
                    with self.lock:
                        self._hand_out(produced)
                except Exception as exc:  # noqa: BLE001 - a failed step fails the batch, not the service
                    with self.lock:
                        log.error(
                            "decode_step_failed", error=repr(exc), request_ids=[r.request_id for r in self.running]
                        )
                        for req in self.running:
                            req.emit("error", f"decode step failed: {exc}")
                            self._free(req, "error", repr(exc))
                        self.running.clear()

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
