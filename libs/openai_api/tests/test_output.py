"""The OpenAI output side: stop text never shown, stop token ids counted not shown, echo, logprobs."""

import asyncio

from dsamodel.tokenizer import ByteTokenizer
from openai_api.logprobs import TokenLogprob
from openai_api.output import Responder
from openai_api.sampling_params import SamplingParams

TOK = ByteTokenizer()


def _collect(params, tokens, *, chat=False, body=None, logprobs=None, finish="stop"):
    responder = Responder(TOK, "m")
    out = responder.output(body or {}, params, TOK.encode("P", add_bos=True), logprobs, chat=chat)
    events = [("token", t) for t in tokens] + [("done", finish)]

    async def run():
        it = iter(events)

        async def next_event():
            return next(it)

        return await responder.collect("r", next_event, out, 2)

    obj, error = asyncio.run(run())
    assert not error
    return obj


def test_stop_string_and_what_follows_are_cut():
    obj = _collect(SamplingParams(max_tokens=9, stop=("7",)), list(b"ab7c"))
    choice = obj["choices"][0]
    assert choice["text"] == "ab" and choice["token_ids"] == list(b"ab") and choice["finish_reason"] == "stop"
    assert obj["usage"]["completion_tokens"] == 4


def test_stop_token_id_is_counted_not_shown_and_eos_is_stop():
    obj = _collect(SamplingParams(max_tokens=9, stop_token_ids=(ord("7"),)), list(b"ab7"))
    assert obj["choices"][0]["text"] == "ab" and obj["usage"]["completion_tokens"] == 3
    obj = _collect(SamplingParams(max_tokens=9), list(b"ab") + [TOK.eos_token_id], chat=True, finish="eos")
    assert obj["choices"][0]["message"]["content"] == "ab" and obj["choices"][0]["finish_reason"] == "stop"


def test_echo_and_logprob_offsets():
    obj = _collect(SamplingParams(max_tokens=9), list(b"ab"), body={"echo": True}, finish="length")
    assert obj["choices"][0]["text"] == "Pab"
    lps = [TokenLogprob(t, -1.0 - k, ((t, -1.0 - k),)) for k, t in enumerate(b"xy")]
    obj = _collect(SamplingParams(max_tokens=9, logprobs=1), list(b"xy"), logprobs=lps.__getitem__, finish="length")
    lp = obj["choices"][0]["logprobs"]
    assert lp["tokens"] == ["x", "y"] and lp["token_logprobs"] == [-1.0, -2.0] and lp["text_offset"] == [0, 1]
