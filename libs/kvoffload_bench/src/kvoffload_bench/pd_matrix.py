"""``bench vllm``'s P/D equality matrix: the same greedy requests to the plain vLLM server and through
the P/D proxy, compared.

The requests: a completion of every prompt length (by default 1, 127, 2,100 and 8,000 tokens) with
its log-probabilities and the same prompt streamed (SSE), a chat with log-probabilities and the same
chat streamed, and 8 completions at once (150 to 850 tokens). Tokens must be equal, and
log-probabilities within ``TOLERANCE`` (the decode computes the last prompt token itself over the KV
it pulled: another kernel call than the plain server's prefill); a streamed answer is compared by
its text.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from kvoffload_testing.sse import sse_events
from kvoffload_testing.stack_client import post_json

MATRIX_TOKENS = (1, 127, 2100, 8000)
TOLERANCE = 1e-3
MAX_TOKENS = 8
BURST = 8
CHAT = [{"role": "user", "content": "Name three colours of the rainbow, one per line."}]

Answer = tuple[list[str], list[float]] | str  # (tokens, log-probabilities), or a streamed text


def prompt(tokens: int, salt: int = 0) -> list[int]:
    """A prompt of ``tokens`` token ids, the same for the same arguments (no two salts share a prefix)."""
    return [(i * 7907 + salt * 104729 + 17) % 40000 + 1000 for i in range(tokens)]


def _streamed_text(url: str, path: str, body: dict) -> str:
    req = urllib.request.Request(
        f"{url}{path}", json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    text = []
    with urllib.request.urlopen(req, timeout=900) as resp:
        for event in sse_events(resp, require_done=True):
            if "error" in event:
                raise RuntimeError(f"{path} on {url} failed: {event['error']}")
            for choice in event.get("choices") or ():
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def answers(url: str, model: str, lengths: tuple[int, ...] = MATRIX_TOKENS) -> dict[str, Answer]:
    """Every request of the matrix against ``url`` (a plain server or the proxy), by case name."""
    out: dict[str, Answer] = {}
    for n in lengths:
        body = {"model": model, "prompt": prompt(n, 1), "max_tokens": MAX_TOKENS, "temperature": 0}
        lp = post_json(f"{url}/v1/completions", {**body, "logprobs": 1}, timeout_s=900)["choices"][0]["logprobs"]
        out[f"completion-{n}"] = (lp["tokens"], lp["token_logprobs"])
        out[f"stream-{n}"] = _streamed_text(url, "/v1/completions", body)
    chat = {"model": model, "messages": CHAT, "max_tokens": 2 * MAX_TOKENS, "temperature": 0}
    content = post_json(f"{url}/v1/chat/completions", {**chat, "logprobs": True})["choices"][0]["logprobs"]["content"]
    out["chat"] = ([c["token"] for c in content], [c["logprob"] for c in content])
    out["chat-stream"] = _streamed_text(url, "/v1/chat/completions", chat)

    def one(i: int) -> str:
        body = {"model": model, "prompt": prompt(150 + 100 * i, 2 + i), "max_tokens": MAX_TOKENS, "temperature": 0}
        return post_json(f"{url}/v1/completions", body, timeout_s=900)["choices"][0]["text"]

    with ThreadPoolExecutor(BURST) as pool:
        for i, text in enumerate(pool.map(one, range(BURST))):
            out[f"burst-{i}"] = text
    return out


def mismatches(got: dict[str, Answer], want: dict[str, Answer]) -> list[str]:
    """Each case whose answer through P/D (``got``) differs from the plain server's (``want``), and how."""
    out = [f"{case}: missing" for case in want if case not in got]
    for case, w in want.items():
        g = got.get(case)
        if g is None:
            continue
        if isinstance(w, str) or isinstance(g, str):
            if g != w:
                out.append(f"{case}: text {g!r} != {w!r}")
            continue
        (tokens, logprobs), (want_tokens, want_logprobs) = g, w
        if tokens != want_tokens:
            out.append(f"{case}: tokens {tokens} != {want_tokens}")
            continue
        worst = max((abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)), default=0.0)
        if worst >= TOLERANCE:
            out.append(f"{case}: log-probabilities differ by {worst:.2e}")
    return out
