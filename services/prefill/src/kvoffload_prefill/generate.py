"""Offload-only mode: the prefill serves complete requests itself (the seed's "layerwise offload
alone" deployment: an ``AscendStoreConnector`` and no ``SfaRemoteD2HConnector``, so no decode node
and no proxy).

``GenerateLoop`` runs ``kvoffload_engine``'s single-process ``Engine`` on one thread: layerwise prefill
over the shared layer buffers, saving to and loading the prefix cache from the node's host pool
(any backend), then decode steps of up to ``max_num_seqs`` requests. HTTP handlers ``submit`` a
request with an ``emit`` callback and get ``("token", id)`` as each is sampled, ``("done",
finish_reason)`` at the end, or ``("error", message)``; ``cancel`` drops a request whose client
went away. A failed prefill fails that request only; a failed decode step fails the running batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import structlog

from dsamodel.sampling import RequestSampler
from kvoffload_engine.engine import Engine, Sequence
from kvoffload_prefill.prefix_cache import remove_unleased
from openai_api.sampling_params import SamplingParams

log = structlog.get_logger(__name__)

Emit = Callable[[str, object], None]  # ("token", id) | ("done", finish_reason) | ("error", message)


@dataclass
class _Live:
    seq: Sequence
    emit: Emit
    sent: int = 0  # output tokens emitted so far


class GenerateLoop:
    """One engine thread serving complete requests (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._live: dict[str, _Live] = {}
        self._cancels: list[str] = []
        self._calls: list[tuple[Callable[[], object], Future]] = []  # run on the engine thread between steps
        self._closed = False
        self.totals = {"prompt_tokens": 0, "cached_tokens": 0}  # of finished requests
        self._thread = threading.Thread(target=self._run, name="generate-loop", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, emit: Emit) -> RequestSampler:
        """Queue a request; ValueError when it cannot run (e.g. longer than max_model_len) or the
        id is in use."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the prefill is shutting down")
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use")
            seq = self.engine.add_request(request_id, prompt_ids, params)
            self._live[request_id] = _Live(seq, emit)
            self._cond.notify()
            return seq.sampler

    def cancel(self, request_id: str) -> None:
        with self._cond:
            if request_id in self._live:
                self._cancels.append(request_id)
                self._cond.notify()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "waiting": len(self.engine.waiting),
                "running": len(self.engine.running),
                "requests": len(self._live),
                **self.totals,
            }

    def reset_prefix_cache(self) -> dict[str, int]:
        """Remove the prefix-cache objects the prompts wrote or reused, except those being read now
        (``ObjectLeased``: kept); runs on the engine thread between steps. Removed / kept counts."""
        done: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the prefill is shutting down")
            self._calls.append((self._reset_prefix_cache, done))
            self._cond.notify()
        return done.result()

    def _reset_prefix_cache(self) -> dict[str, int]:
        keys, self.engine.prefix_keys = list(self.engine.prefix_keys), set()
        counts, kept = remove_unleased(self.engine.prefill_pool, keys)
        self.engine.prefix_keys.update(kept)
        return counts

    def busy(self) -> int:
        with self._cond:
            return len(self._live)

    def close(self) -> None:
        """Fail what is left and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._cancels and not self._live and not self._calls:
                    self._cond.wait()
                calls, self._calls = self._calls, []
                for fn, done in calls:
                    try:
                        done.set_result(fn())
                    except Exception as exc:  # noqa: BLE001 - the caller's: raised where it awaits its future
                        done.set_exception(exc)
                if self._closed:
                    for rid in list(self._live):
                        self._fail(rid, "the prefill is shutting down")
                    return
                for rid in self._cancels:
                    if rid in self._live:
                        self.engine.cancel(rid)
                        del self._live[rid]
                        log.info("request_cancelled", request_id=rid)
                self._cancels.clear()
                if not (self.engine.waiting or self.engine.running):
                    continue
                before = {s.request_id for s in self.engine.waiting}
            try:
                self.engine.step()  # prefill what fits, then one decode step
            except Exception as exc:  # noqa: BLE001 - a pool or step failure: fail the requests it hit, keep serving
                self._step_failed(before, exc)
            self._publish()

    def _publish(self) -> None:
        """Emit every live request's new tokens; retire the finished ones."""
        with self._cond:
            for rid, live in list(self._live.items()):
                out = live.seq.output_ids
                for token in out[live.sent :]:
                    live.emit("token", token)
                live.sent = len(out)
                if live.seq.finished:
                    live.emit("done", live.seq.sampler.finish_reason)
                    del self._live[rid]
                    self.totals["prompt_tokens"] += int(live.seq.prompt.numel())
                    self.totals["cached_tokens"] += live.seq.num_cached_tokens
                    log.info(
                        "request_finished",
                        request_id=rid,
                        prompt_tokens=int(live.seq.prompt.numel()),
                        cached_tokens=live.seq.num_cached_tokens,
                        output_tokens=len(out),
                        finish_reason=live.seq.sampler.finish_reason,
                    )

    def _step_failed(self, waiting_before: set[str], exc: Exception) -> None:
        """The request being prefilled (left the queue, not running) failed; if none did, the
        decode step failed every running request."""
        with self._cond:
            queued = {s.request_id for s in self.engine.waiting}
            running = {s.request_id for s in self.engine.running}
            prefilled = [
                rid
                for rid in waiting_before - queued - running
                if rid in self._live and not self._live[rid].seq.finished
            ]
            victims = prefilled or sorted(running)
            for rid in victims:
                self.engine.cancel(rid)
                self._fail(rid, f"{'prefill' if prefilled else 'decode step'} failed: {exc}")

    def _fail(self, rid: str, message: str) -> None:
        live = self._live.pop(rid)
        log.error("request_failed", request_id=rid, error=message)
        live.emit("error", message)
