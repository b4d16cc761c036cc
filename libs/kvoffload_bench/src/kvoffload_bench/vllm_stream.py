"""A streamed greedy completion as ``kvoffload bench vllm`` times it: TTFT, each token's arrival,
TPOT (``tpot``), a timed round of the P/D part's prompts (``timed_round``), whether two sets of
rounds timed their TPOT the same way (``tpot_sources_differ``: a ratio of TPOTs from different
sources is not measured), and the counters a server records a moment after the client has its
answer (``settled``)."""

from __future__ import annotations

import json
import time
import urllib.request

from kvoffload_testing.prom import metric
from kvoffload_testing.sse import sse_events


def stream(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[str], list[float]]:
    """(seconds to the first token, the tokens' texts, each token's arrival in seconds after the send)
    of a streaming greedy completion."""
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 0}
    ).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    tokens: list[str] = []
    stamps: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for event in sse_events(resp):
            if "error" in event:
                raise RuntimeError(f"the completion on {url} failed: {event['error']}")
            for choice in event["choices"]:
                got = (choice.get("logprobs") or {}).get("tokens") or []
                tokens += got
                stamps += [time.perf_counter() - t0] * len(got)
    if not stamps:
        raise RuntimeError(f"the completion on {url} streamed no token")
    return stamps[0], tokens, stamps


def tpot(stamps: list[float]) -> float | None:
    """Seconds per output token after the first: the span from the first token to the last over
    the tokens in between (None with one token: nothing to time). Not a median of gaps: a server
    that falls behind sends several tokens in one chunk, and those gaps of zero would make the median 0."""
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None


def settled(url: str, names: list[str], timeout_s: float = 10.0) -> dict[str, float]:
    """The sums of the counters ``names`` on ``url`` once two reads 0.5 s apart agree (vLLM records a
    step's connector stats with that step's outputs, a moment after the client may have its answer),
    or the last read after ``timeout_s``."""
    last, deadline = {n: metric(url, n) for n in names}, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = {n: metric(url, n) for n in names}
        if now == last:
            break
        last = now
    return last


def pd_prompt(r: int, tokens: int) -> list[int]:
    """Round ``r``'s P/D prompt (``r`` = -1: the warm-up), unlike any other round's or the store part's."""
    return [(i * 6151 + (r + 2) * 92821) % 40000 + 1000 for i in range(tokens)]


ITL = ("vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count")


def timed_round(url: str, name: str, r: int, prompt_tokens: int, max_tokens: int, server_url: str) -> dict:
    """The TTFT, TPOT and tokens of round ``r``'s prompt on ``url``. TPOT is what the client saw
    (``tpot``) unless every token reached it in one event: a server whose API process falls behind
    its engine merges the outputs it has not sent yet, and then the stream holds no timing at all.
    That round's TPOT is the generating server's (``server_url``) own inter-token latency over the
    round instead, and ``tpot_source`` says which one it is ("stream" or "server"). A round that
    gave one token has no TPOT at all: RuntimeError."""
    before = settled(server_url, list(ITL))
    ttft, tokens, stamps = stream(url, name, pd_prompt(r, prompt_tokens), max_tokens)
    if len(stamps) < 2:
        raise RuntimeError(
            f"{url} streamed {len(stamps)} token for round {r}: a TPOT needs two or more "
            "(the model stopped early; this round's TPOT cannot be measured)"
        )
    if stamps[-1] != stamps[0]:
        return {"ttft_s": ttft, "tpot_s": tpot(stamps), "tpot_source": "stream", "tokens": tokens}
    after = settled(server_url, list(ITL))
    total, steps = (after[k] - before[k] for k in ITL)
    if steps <= 0:
        raise RuntimeError(
            f"{server_url} streamed {len(stamps)} tokens in one event and counted no "
            "inter-token latency: this round's TPOT cannot be measured"
        )
    return {"ttft_s": ttft, "tpot_s": total / steps, "tpot_source": "server", "tokens": tokens}


def timed_rounds(url: str, name: str, rounds: int, prompt_tokens: int, max_tokens: int, server_url: str) -> list[dict]:
    """``timed_round`` of rounds 0 .. ``rounds`` - 1, one after the other."""
    return [timed_round(url, name, r, prompt_tokens, max_tokens, server_url) for r in range(rounds)]


def tpot_sources_differ(sides: dict[str, list[dict]]) -> str | None:
    """Why a TPOT ratio between the rounds of ``sides`` (name -> ``timed_round``'s, e.g. the plain
    server's and a P/D pair's) cannot be measured: their TPOTs come from more than one source, and a
    client stream's span between tokens is not the same quantity as a server's own inter-token
    latency (which leaves out the API process and the network); None when every round of every side
    has one and the same source."""
    found = {side: sorted({r["tpot_source"] for r in rounds}) for side, rounds in sides.items()}
    if len({source for sources in found.values() for source in sources}) <= 1:
        return None
    named = "; ".join(f"{side}: {', '.join(sources)}" for side, sources in found.items())
    return (
        f"the TPOTs compared come from different sources ({named}): a client stream's timing against "
        "a server's own inter-token latency"
    )
