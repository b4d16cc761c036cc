"""The output side of the OpenAI API: sampled tokens -> completion / chat answers (a JSON object, or
the objects of an SSE stream), without any HTTP (the services write them; both use this module).

Stop strings are cut here with ``openai_api.stop_text.StopText``, the same matcher the sampler ends
the sequence with: the stop text and everything after it never reach the client, and in a stream
text that could still become a stop string (or an unfinished UTF-8 character) is held back until
decided. ``token_ids`` and ``logprobs`` cover the tokens whose text was returned; ``usage`` counts
every generated token. ``echo`` prepends the prompt's text; ``stream_options.include_usage`` adds
a last chunk with ``usage`` and no choices.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from openai_api.logprobs import TokenLogprob, chat_logprobs, completion_logprobs, finish_reason
from openai_api.sampling_params import SamplingParams
from openai_api.stop_text import StopText
from openai_api.tokenizer import Tokenizer

# the next (kind, value) of the request's queue: ("token", id), ("done", reason) or ("error", message)
Next = Callable[[], Awaitable[tuple[str, Any]]]


class Output:
    """One request's text, tokens and log-probabilities as they are released to the client."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        logprobs: Callable[[int], TokenLogprob] | None,
        *,
        chat: bool,
        echo: str = "",
    ) -> None:
        self.tokenizer, self.params, self.chat, self.echo = tokenizer, params, chat, echo
        self.text = StopText(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True), params.stop, min_tokens=params.min_tokens
        )
        self._logprob = logprobs if params.logprobs is not None else None
        self.num_tokens = 0

    def add(self, token: int) -> None:
        """The next generated token. A stop token id that ends the sequence is counted, not shown
        (its text is stop text); EOS shows no text either."""
        self.num_tokens += 1
        if token in self.params.stop_token_ids and self.num_tokens >= self.params.min_tokens:
            return
        extra = (self._logprob(self.num_tokens - 1) if self._logprob else None, len(self.echo) + self.text.stable_len)
        self.text.add(token, extra)

    def take(self, final: bool = False) -> tuple[str, list[int], dict | None]:
        """(text, token ids, logprobs object or None) released now."""
        piece, tokens = self.text.take(final)
        ids = [t for t, _ in tokens]
        if self._logprob is None:
            return piece, ids, None
        entries = [extra[0] for _, extra in tokens]
        if self.chat:
            return piece, ids, chat_logprobs(self.tokenizer, entries)
        return piece, ids, completion_logprobs(self.tokenizer, entries, [extra[1] for _, extra in tokens])


class Responder:
    """Builds the JSON answer and the SSE stream's objects for one served model."""

    def __init__(self, tokenizer: Tokenizer, model_name: str) -> None:
        self.tokenizer, self.model_name = tokenizer, model_name

    def output(self, body: dict, params: SamplingParams, prompt_ids: list[int], logprobs, *, chat: bool) -> Output:
        echo = self.tokenizer.decode(prompt_ids, skip_special_tokens=True) if body.get("echo") and not chat else ""
        return Output(self.tokenizer, params, logprobs, chat=chat, echo=echo)

    def chunk(
        self,
        rid: str,
        chat: bool,
        text: str,
        token_ids: list[int],
        finish: str | None,
        first: bool,
        logprobs: dict | None = None,
    ) -> dict:
        created = int(time.time())
        if chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "token_ids": token_ids, "logprobs": logprobs, "finish_reason": finish}
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }
        choice = {"index": 0, "text": text, "token_ids": token_ids, "logprobs": logprobs, "finish_reason": finish}
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": [choice],
        }

    def usage(self, n_prompt: int, n_completion: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}

    async def events(
        self,
        rid: str,
        next_event: Next,
        out: Output,
        n_prompt: int,
        include_usage: bool,
        on_error: Callable[[str], None],
        on_ok: Callable[[], None],
    ) -> AsyncIterator[dict]:
        """The objects of the SSE stream, in order (each goes out as ``data: <json>``; the writer
        ends with ``data: [DONE]``); an error ends it with an error object after ``on_error``."""
        first = True
        if out.echo:
            yield self.chunk(rid, out.chat, out.echo, [], None, first)
            first = False
        while True:
            kind, value = await next_event()
            if kind == "error":
                on_error(str(value))
                yield {"error": {"message": value, "type": "decode_error"}}
                return
            if kind == "done":
                piece, ids, lp = out.take(final=True)
                yield self.chunk(rid, out.chat, piece, ids, finish_reason(str(value)), first, lp)
                if include_usage:
                    yield {
                        "id": rid,
                        "object": "chat.completion.chunk" if out.chat else "text_completion",
                        "created": int(time.time()),
                        "model": self.model_name,
                        "choices": [],
                        "usage": self.usage(n_prompt, out.num_tokens),
                    }
                on_ok()
                return
            out.add(int(value))
            piece, ids, lp = out.take()
            if piece or ids or first:
                yield self.chunk(rid, out.chat, piece, ids, None, first, lp)
                first = False

    async def collect(self, rid: str, next_event: Next, out: Output, n_prompt: int) -> tuple[dict | None, str]:
        """The JSON answer, or (None, error message)."""
        while True:
            kind, value = await next_event()
            if kind == "error":
                return None, str(value)
            if kind == "done":
                break
            out.add(int(value))
        finish = finish_reason(str(value))
        text, ids, lp = out.take(final=True)
        if out.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "token_ids": ids,
                "logprobs": lp,
                "finish_reason": finish,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out.echo + text, "token_ids": ids, "logprobs": lp, "finish_reason": finish}
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": self.usage(n_prompt, out.num_tokens),
        }, ""


__all__ = ["Output", "Responder"]
