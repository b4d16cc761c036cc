"""The decode engine loop: requests wait for their remote prefill, then decode in one batch.

A request is admitted (device row + host-pool blocks) when it arrives; the transfer servicer
installs each pulled layer (``write_rows``) and the prefill's first token (``prefill_done``). Once
every layer holds the whole prompt and the first token is known, the request joins the running
batch; the loop thread runs one ``SparseDecoder`` step for the batch at a time, samples, and hands
every token to the request's ``emit`` callback. ``cancel`` frees a request at any stage.

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
from dsamodel.sampling import RequestSampler, SamplingParams
from svcruntime.ledger import Entry, Ledger

log = structlog.get_logger(__name__)

YIELD_S = 0.0002  # the loop's pause between steps, so other threads can take the lock
Emit = Callable[[str, object], None]  # ("token", id) | ("done", finish_reason) | ("error", message)


class DecodeFull(RuntimeError):
    """No sequence slot or host-pool room for a new request right now."""


@dataclass
class DecodeRequest:
    """One request from arrival to its last token."""

    request_id: str
    prompt_ids: list[int]
    sampler: RequestSampler
    emit: Emit
    num_layers: int
    rows: list[int] = field(default_factory=list)  # prompt rows installed, per layer
    first_token: int | None = None
    arrived_s: float = field(default_factory=time.monotonic)
    copies: int = 0  # pulled rows being installed right now (outside the loop's lock)
    free_after_copies: str | None = None  # cancelled while copies ran: the last copy frees it

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_complete(self) -> bool:
        return self.first_token is not None and all(r >= self.num_prompt_tokens for r in self.rows)


class DecodeLoop:
    """Owns the ``SparseDecoder``; every decoder call happens under ``self.lock``."""

    def __init__(self, decoder: SparseDecoder, eos_token_id: int | None, peer_timeout_s: float = 10.0) -> None:
        self.decoder = decoder
        self.peer_timeout_s = peer_timeout_s
        self.ledger = Ledger(self._timed_out).start()
        self.eos_token_id = eos_token_id
        self.lock = threading.Condition(threading.RLock())
        self.pending: dict[str, DecodeRequest] = {}  # waiting for the remote prefill
        self.running: list[DecodeRequest] = []
        self._next: dict[str, int] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        self._thread.start()

    # ---- called by the HTTP handlers and the transfer servicer --------------------------------

    def expect_remote(self, request_id: str, prompt_ids: list[int], params: SamplingParams, emit: Emit,
                      wait_s: float = 0.0) -> DecodeRequest:
        """Admit a request whose KV a prefill will push, waiting up to ``wait_s`` for a free sequence
        slot and host blocks (requests queue rather than fail); raises DecodeFull or ValueError."""
        deadline = time.monotonic() + wait_s
        with self.lock:
            if request_id in self.pending or any(r.request_id == request_id for r in self.running):
                raise ValueError(f"request id {request_id!r} is already in use")
            while not self.decoder.can_admit(len(prompt_ids) + 1):
                left = deadline - time.monotonic()
                if left <= 0 or self._stop:
                    raise DecodeFull(f"decode is full ({len(self.decoder.seqs)} requests) and stayed full for "
                                     f"{wait_s:.0f} s; retry later")
                self.lock.wait(timeout=min(left, 1.0))
            self.decoder.admit(request_id, len(prompt_ids) + 1)
            req = DecodeRequest(request_id, prompt_ids, RequestSampler(params, self.eos_token_id), emit,
                                len(self.decoder.model.cache_layers))
            req.rows = [0] * req.num_layers
            self.pending[request_id] = req
            self.ledger.open(request_id, "admitted")
            return req

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
            with self.lock:
                req.copies -= 1
                if req.free_after_copies is not None:
                    if not req.copies:
                        self._free(req, req.free_after_copies)
                    ok = False
                elif ok and start <= req.rows[layer]:
                    req.rows[layer] = max(req.rows[layer], start + kv.shape[0])
                self.lock.notify_all()
        if not ok:
            raise KeyError(request_id)  # cancelled while its rows were copied
        return elapsed

    def prefill_done(self, request_id: str, num_prompt_tokens: int, first_token: int) -> str:
        """The prefill's first token; returns "" when accepted, else why not."""
        with self.lock:
            req = self.pending.get(request_id)
            if req is None:
                raise KeyError(request_id)
            if num_prompt_tokens != req.num_prompt_tokens:
                return (f"prefill had {num_prompt_tokens} prompt tokens, the decode request "
                        f"{req.num_prompt_tokens}")
            req.first_token = first_token
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
        with self.lock:
            req = self.pending.pop(request_id, None)
            if req is None:
                req = next((r for r in self.running if r.request_id == request_id), None)
                if req is None:
                    return False
                self.running.remove(req)
            if req.copies:
                req.free_after_copies = outcome
            else:
                self._free(req, outcome, reason)
            log.info("request_cancelled", request_id=request_id, reason=reason, outcome=outcome)
            return True

    def _timed_out(self, entry: Entry, reason: str) -> None:
        """The watchdog: the request's prefill went quiet; fail it and free what it holds."""
        with self.lock:
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
                    "sequences": len(self.decoder.seqs), **self.ledger.counters()}

    def close(self) -> None:
        with self.lock:
            self._stop = True
            for req in list(self.pending.values()) + list(self.running):
                req.emit("error", "decode is shutting down")
                if req.copies:
                    req.free_after_copies = "shutdown"
                else:
                    self._free(req, "shutdown")
            self.pending.clear()
            self.running.clear()
            self.lock.notify_all()
        self._thread.join(timeout=10)
        self.ledger.close()

    # ---- the loop thread ----------------------------------------------------------------------

    def _free(self, req: DecodeRequest, outcome: str, error: str = "") -> None:
        self.decoder.finish(req.request_id)
        self.lock.notify_all()  # a queued request may fit now
        self._next.pop(req.request_id, None)
        self.ledger.finish(req.request_id, outcome, error)

    def _admit_ready(self) -> None:
        for rid, req in list(self.pending.items()):
            if not req.prompt_complete:
                continue
            del self.pending[rid]
            self.ledger.advance(rid, "decoding")
            self.decoder.set_prompt_done(rid, req.num_prompt_tokens)
            req.sampler.output_ids.append(req.first_token)
            req.emit("token", req.first_token)
            if req.sampler.finished:
                req.emit("done", req.sampler.finish_reason)
                self._free(req, "ok")
            else:
                self._next[rid] = req.first_token
                self.running.append(req)

    def _run(self) -> None:
        while True:
            # Between steps the lock is free for a moment *without* this thread holding the GIL:
            # released and re-taken in one breath, it starves every other thread (Stats, admission,
            # pulls, cancels waited seconds behind a long generation).
            time.sleep(YIELD_S)
            with self.lock:
                while not self._stop and not self.running and not any(r.prompt_complete for r in self.pending.values()):
                    self.lock.wait(timeout=1.0)
                if self._stop:
                    return
                self._admit_ready()
                if not self.running:
                    continue
                try:
                    self._step()
                except Exception as exc:  # a failed step fails the batch, not the service
                    log.error("decode_step_failed", error=repr(exc),
                              request_ids=[r.request_id for r in self.running])
                    for req in self.running:
                        req.emit("error", f"decode step failed: {exc}")
                        self._free(req, "error", repr(exc))
                    self.running.clear()

    def _step(self) -> None:
        ids = [r.request_id for r in self.running]
        logits = self.decoder.step(ids, torch.tensor([self._next[i] for i in ids]))  # [R, V]
        for req, row in zip(list(self.running), logits):
            token = req.sampler.step(row)
            self._next[req.request_id] = token
            req.emit("token", token)
            if req.sampler.finished:
                req.emit("done", req.sampler.finish_reason)
                self.running.remove(req)
                self._free(req, "ok")
