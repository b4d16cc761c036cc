"""What the transfer path tells the decode loop about a pending request (``PrefillReports``, a part
of ``DecodeLoop``): news from its prefill, its pulled rows, its first token.

The transfer servicer installs each pulled layer (``write_rows``, through the ``RowInstaller`` of
``kvoffload_decode.rows``: the copy runs outside the loop's locks) and the prefill's first token
(``prefill_done``). Once every layer holds the whole prompt and the first token is known, the
request is ready to join the running batch; ``check_prompt_complete`` says what is missing when the
prefill says it finished but the prompt is not whole — a partial transfer is never decoded over (I5).

The watchdog: the ledger records each request's stage (admitted -> awaiting_prefill -> pulling ->
ready -> decoding) and outcome; while pulling — once the prefill has been heard from
(``heard_from_prefill``: a heartbeat, ReadReady or PrefillDone) and until the prompt is complete —
silence longer than ``peer_timeout_s`` fails the request with an error naming the prefill and the
stage, and frees its host blocks (``DecodeLoop._timed_out``): a prefill that died or hung never
strands a decode allocation.

It works on the loop's state (``lock``, ``pending``, ``ledger``, ``decoder``, ``peer_timeout_s``,
``installer``; ``kvoffload_decode.loop_state``).
"""

from __future__ import annotations

import torch

from kvoffload_decode.loop_state import LoopState
from kvoffload_decode.request import DecodeRequest
from openai_api.logprobs import TokenLogprob


class PrefillReports(LoopState):
    """``DecodeLoop``'s side of the transfer path (module doc)."""

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
        return self.installer.write_rows(request_id, layer, start, kv, index_k)

    def prefill_done(
        self,
        request_id: str,
        num_prompt_tokens: int,
        first_token: int,
        first_logprob: TokenLogprob | None = None,
        draft_token: int | None = None,
    ) -> str:
        """The prefill's first token (and its log-probabilities when the request asked for them, and
        its MTP draft when it sent one); returns "" when accepted, else why not."""
        with self.lock:
            req = self.pending.get(request_id)
            if req is None:
                raise KeyError(request_id)
            if num_prompt_tokens != req.num_prompt_tokens:
                return f"prefill had {num_prompt_tokens} prompt tokens, the decode request {req.num_prompt_tokens}"
            want = req.sampler.params.logprobs
            if want is not None and (
                first_logprob is None or first_logprob.token != first_token or len(first_logprob.top) < want
            ):
                return (
                    f"the request asks for logprobs (top {want}); the prefill sent "
                    f"{'none' if first_logprob is None else 'others'} for its first token"
                )
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
        """ "" if the request's prompt KV and first token are all here (or it already runs), else what
        is missing — a partial transfer is never decoded over (I5)."""
        with self.lock:
            req = self.pending.get(request_id)
            if req is None or req.prompt_complete:
                return ""
            missing = [(i, r) for i, r in enumerate(req.rows) if r < req.num_prompt_tokens]
            what = (
                f"layer {missing[0][0]} has {missing[0][1]} of {req.num_prompt_tokens} rows"
                if missing
                else "no first token"
            )
            return f"the prefill finished but the prompt's KV is incomplete: {what}"
