"""How ``test_openai_params`` talks to the stack and to what it compares with: a raw POST that returns the
status and the JSON body (a 400's too), an SSE stream's events, a choice's text, the per-choice pieces of a
streamed response, ``engine_runner``, the body of its ``engine`` fixture (the single-process engine run
with the same sampling parameters), and ``dense_logprobs``, the oracle the log-probabilities are judged
against that shares nothing with the engine's decode: no offload, no hot cache, no sampler."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from kvoffload_testing.sse import sse_events
from openai_api.body import validate_body


def post_status(stack, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{stack.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def sse_stream(stack, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(
        f"{stack.url}{path}",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        events = list(sse_events(resp))
    assert all("error" not in event for event in events), events
    return events


def choice_text(choice: dict, chat: bool) -> str:
    return choice["message"]["content"] if chat else choice["text"]


def streamed_choices(events: list[dict], chat: bool) -> dict[int, dict]:
    """index -> {text, pieces, token_ids, finish_reason, logprobs entries} from SSE chunks."""
    out: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            o = out.setdefault(c["index"], {"pieces": [], "token_ids": [], "finish_reason": None, "lp": []})
            o["pieces"].append(c["delta"].get("content", "") if chat else c["text"])
            o["token_ids"] += c.get("token_ids", [])
            o["finish_reason"] = c["finish_reason"] or o["finish_reason"]
            if c.get("logprobs"):
                o["lp"] += c["logprobs"]["content"] if chat else c["logprobs"]["token_logprobs"]
    for o in out.values():
        o["text"] = "".join(o["pieces"])
    return out


def engine_runner(model_dir: Path, block_size: int):
    """run(prompt_ids, body, chat) -> (token ids, TokenLogprobs) of the single-process engine."""
    from dsamodel.weights import load_model
    from kvoffload_engine.engine import Engine, EngineConfig

    model = load_model(model_dir)

    def run(ids: list[int], body: dict, *, chat: bool = False, choice: int = 0):
        eng = Engine(
            model,
            EngineConfig(
                block_size=block_size,
                max_model_len=2048,
                chunk_size=2048,
                buffers=3,
                topk_buffer_size=128,
                prefill_pool_bytes=64 << 20,
                decode_pool_bytes=64 << 20,
            ),
        )
        try:
            seq = eng.add_request("ref", ids, validate_body(body, chat=chat).sampling_params(choice))
            while eng.waiting or eng.running:
                eng.step()
            return list(seq.output_ids), list(seq.sampler.logprobs)
        finally:
            eng.close()

    return run


# the reference model is bfloat16: the engine's incremental decode and one whole-sequence forward round
# differently, by up to 0.03 in a log-probability on the tests' prompts
DENSE_LOGPROB_TOL = 0.06


def dense_logprobs(model_dir: Path, prompt_ids: list[int], output_ids: list[int]):
    """``log_softmax`` of ``dsamodel.dense_reference.forward_dense``'s logits over the prompt and the output
    (no caches, no offload, no sampler): row i is the distribution ``output_ids[i]`` was drawn from,
    [len(output_ids), V] float32."""
    import torch

    from dsamodel.dense_reference import forward_dense
    from dsamodel.weights import load_model

    model = load_model(model_dir)
    with torch.no_grad():
        logits = forward_dense(model, torch.tensor(prompt_ids + output_ids[:-1]))
    return torch.log_softmax(logits.float(), dim=-1)[len(prompt_ids) - 1 :]
