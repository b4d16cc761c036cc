"""OpenAI request bodies -> prompt token ids and sampling parameters (both services use it).

``prompt`` may be a string or a list of token ids; chat ``messages`` go through the tokenizer's
chat template. Defaults follow the OpenAI API where they matter for determinism: ``max_tokens``
16, ``temperature`` 1.0, ``top_p`` 1.0; ``seed`` defaults to 0 so a request is repeatable.

``check_body`` is strict: a field outside the accepted set (``COMPLETION_FIELDS`` /
``CHAT_FIELDS``), or a parameter this engine cannot honour (``tools``, ``best_of`` != ``n``,
``echo`` with ``logprobs``, ...) is a ``RequestError`` naming it; a client never silently gets
something other than what it asked for. A JSON ``null`` counts as absent.
"""

from __future__ import annotations

import math
from typing import Any

from dsamodel.sampling import MAX_LOGPROBS, SamplingParams
from dsamodel.tokenizer import ByteTokenizer

# Accepted by both endpoints. kv_transfer_params(_list) are the P/D wiring the proxy adds.
COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "seed", "stop",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos", "user",
    "kv_transfer_params", "kv_transfer_params_list",
})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# Known OpenAI / vLLM parameters this engine cannot honour: refused by name.
UNSUPPORTED = frozenset({
    "suffix", "logit_bias", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "response_format", "top_k", "min_p", "repetition_penalty", "prediction", "audio", "modalities",
    "reasoning_effort", "service_tier", "store", "metadata", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "use_beam_search", "length_penalty", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "echo",
    "prompt_logprobs", "web_search_options",
})
MAX_STOP = 16
MAX_N = 64  # choices per prompt
MAX_SEED = 2**63


class RequestError(ValueError):
    """A request body field is missing or invalid; the message names the field."""


def _present(body: dict[str, Any], key: str) -> bool:
    return body.get(key) is not None


def _int(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise RequestError(f"{key}: must be an integer {bound}, got {body.get(key)!r}")
    return v


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise RequestError(f"{key}: must be a number in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _bool(body: dict[str, Any], key: str) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise RequestError(f"{key}: must be a boolean, got {v!r}")
    return v


def check_body(body: dict[str, Any], *, chat: bool, max_n: int | None = 1) -> None:
    """Refuse what this engine cannot honour; the message names the field. ``max_n``: the largest
    ``n`` this service serves (the decode serves one choice per request; the proxy splits ``n``)."""
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key in body:
        if key in allowed:
            continue
        if key in UNSUPPORTED or key in COMPLETION_FIELDS | CHAT_FIELDS:
            raise RequestError(f"{key}: not supported by this server"
                               f"{' on /v1/chat/completions' if chat else ' on /v1/completions'}")
        raise RequestError(f"{key}: unknown parameter")
    for key in ("stream", "ignore_eos") + (() if chat else ("echo",)):
        _bool(body, key)
    if _present(body, "stream_options"):
        opts = body["stream_options"]
        if not isinstance(opts, dict):
            raise RequestError("stream_options: must be an object")
        if not body.get("stream"):
            raise RequestError("stream_options: only allowed with stream: true")
        for key in opts:
            if key != "include_usage":
                raise RequestError(f"stream_options.{key}: unknown option (only include_usage)")
        if opts.get("include_usage") is not None and not isinstance(opts["include_usage"], bool):
            raise RequestError("stream_options.include_usage: must be a boolean")
    n = _int(body, "n", 1, MAX_N) or 1
    if max_n is not None and n > max_n:
        raise RequestError(f"n: this service returns at most {max_n} choice(s) per request; send n > 1 "
                           "through the proxy")
    if not chat:
        best_of = _int(body, "best_of", 1)
        if best_of is not None and best_of != n:
            raise RequestError(f"best_of: only best_of == n is supported (got best_of={best_of}, n={n})")
        if body.get("echo") and _present(body, "logprobs"):
            raise RequestError("echo: echo together with logprobs (prompt log-probabilities) is not supported")
    if _present(body, "model") and not isinstance(body["model"], str):
        raise RequestError("model: must be a string")
    if _present(body, "user") and not isinstance(body["user"], str):
        raise RequestError("user: must be a string")


def stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop: must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
    return tuple(stops)


def _logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
    if not chat:
        return _int(body, "logprobs", 0, MAX_LOGPROBS)
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise RequestError("top_logprobs: needs logprobs: true")
    return (top or 0) if want else None


def prompt_ids(body: dict[str, Any], tokenizer: ByteTokenizer, *, chat: bool) -> list[int]:
    """The prompt's token ids: ``messages`` for chat, else ``prompt`` (text or token ids)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages: must be a non-empty list of {role, content}")
        plain = []
        for k, m in enumerate(messages):
            if not isinstance(m, dict):
                raise RequestError(f"messages[{k}]: must be an object {{role, content}}")
            extra = sorted(set(m) - {"role", "content"})
            if extra:
                raise RequestError(f"messages[{k}].{extra[0]}: not supported by this server")
            if m.get("role") not in ("system", "user", "assistant"):
                raise RequestError(f"messages[{k}].role: must be system, user or assistant, got {m.get('role')!r}")
            plain.append({"role": m["role"], "content": _content(m.get("content"), k)})
        return tokenizer.encode(tokenizer.apply_chat_template(plain), add_bos=False)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt, add_bos=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise RequestError(f"prompt: token id {bad[0]} outside the vocabulary [0, {tokenizer.vocab_size})")
        return list(prompt)
    raise RequestError("prompt: must be a non-empty string or a non-empty list of token ids")


def _content(content: Any, k: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            and set(p) <= {"type", "text"} for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{k}].content: must be a string or a list of text parts "
                       "({type: text, text: str}); other content is not supported")


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of a request with ``n`` > 1 (choice 0 keeps the request's seed,
    so its first choice equals the n = 1 answer). The proxy derives the same."""
    return (seed + choice * 0x9E3779B97F4A7C15) % MAX_SEED


def sampling_params(body: dict[str, Any], *, chat: bool = False, choice: int = 0,
                    first_token_only: bool = False) -> SamplingParams:
    """``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed`` (derived
    per ``choice``), ``ignore_eos``, ``stop``, ``stop_token_ids``, the penalties, ``min_tokens``,
    ``logprobs``. ``first_token_only``: the prefill, which samples one token with the client's
    other parameters (``min_tokens`` may exceed its ``max_tokens: 1``)."""
    max_tokens = _int(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    max_tokens = 16 if max_tokens is None else max_tokens
    min_tokens = _int(body, "min_tokens", 0) or 0
    if min_tokens > max_tokens and not first_token_only:
        raise RequestError(f"min_tokens: {min_tokens} exceeds max_tokens ({max_tokens})")
    seed = _int(body, "seed", 0, MAX_SEED - 1) or 0
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids)):
        raise RequestError("stop_token_ids: must be a list of token ids (integers >= 0)")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = body.get("top_p")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not math.isfinite(top_p) or not 0 < top_p <= 1):
        raise RequestError(f"top_p: must be a number in (0, 1], got {top_p!r}")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else float(top_p),
            seed=choice_seed(seed, choice),
            ignore_eos=bool(_bool(body, "ignore_eos")),
            stop=stop_strings(body),
            stop_token_ids=tuple(stop_ids or ()),
            presence_penalty=_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
            frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
            min_tokens=min_tokens,
            logprobs=_logprobs(body, chat=chat),
        )
    except (TypeError, ValueError) as exc:
        raise RequestError(str(exc)) from exc


# ---- output: the OpenAI shapes of log-probabilities and finish reasons ---------------------------

def finish_reason(reason: str | None) -> str | None:
    """The sampler's reason in OpenAI terms: EOS and stop strings/ids are both ``"stop"``."""
    return "stop" if reason == "eos" else reason


def token_text(tokenizer: ByteTokenizer, token: int) -> str:
    """One token as OpenAI shows it in logprobs: its text, ``bytes:\\xNN`` for a byte that is not
    text on its own, a special token's name."""
    if token < 256:
        try:
            return bytes([token]).decode("utf-8")
        except UnicodeDecodeError:
            return f"bytes:\\x{token:02x}"
    return tokenizer.decode([token])


def _token_bytes(tokenizer: ByteTokenizer, token: int) -> list[int]:
    return [token] if token < 256 else list(tokenizer.decode([token]).encode("utf-8"))


def completion_logprobs(tokenizer: ByteTokenizer, entries: list, offsets: list[int]) -> dict[str, Any]:
    """``/v1/completions`` ``choices[].logprobs`` for ``TokenLogprob`` entries: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (the top k and the chosen token) and ``text_offset``."""
    top = []
    for e in entries:
        alts = {token_text(tokenizer, t): lp for t, lp in e.top}
        alts.setdefault(token_text(tokenizer, e.token), e.logprob)
        top.append(alts)
    return {"tokens": [token_text(tokenizer, e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries], "top_logprobs": top, "text_offset": list(offsets)}


def chat_logprobs(tokenizer: ByteTokenizer, entries: list) -> dict[str, Any]:
    """``/v1/chat/completions`` ``choices[].logprobs``: ``{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}``."""
    def one(t: int, lp: float) -> dict[str, Any]:
        return {"token": token_text(tokenizer, t), "logprob": lp, "bytes": _token_bytes(tokenizer, t)}
    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}
