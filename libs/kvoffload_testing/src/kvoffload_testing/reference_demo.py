"""``kvoffload demo`` (the reference engine): one question over a long document through a running
reference stack, the answer, and what the stack held and moved for it.

On SmolLM2 the document is the model's own licence (``LICENSE`` beside its weights: the Apache License
2.0, ~2,300 tokens with the chat template) and the question asks which licence it is, so the answer
can be checked by eye: the prefill computes the prompt layer by layer on a few shared buffers, the
decode pulls every layer and answers with sparse attention over the indexer's top-k (512 of ~2,300
rows per layer). On the tiny random model (``--model tiny``) the prompt is a repeated sentence and the
text is random bytes. The summary puts each side's device KV beside what an engine that keeps every
row on the device reserves (``summary_of``).
"""

from __future__ import annotations

import time
from pathlib import Path

from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import post_json, stack_stats

DEMO_QUESTION = "Which license is the text above, and which version of it?"
TINY_PROMPT = (
    "kvoffload keeps almost no KV cache in accelerator memory: layerwise offload on prefill, "
    "sparse offload on decode, a remote pull in between. "
) * 40
DEFAULT_MAX_TOKENS = 32


def demo_body(model_dir: Path, max_tokens: int) -> dict:
    """The demo's request: a chat over the model's licence (a real model), else the tiny prompt."""
    licence = model_dir / "LICENSE"
    if (model_dir / "tokenizer.json").is_file() and licence.is_file():
        messages = [{"role": "user", "content": f"{licence.read_text()}\n\n{DEMO_QUESTION}"}]
        return {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return {"prompt": TINY_PROMPT, "max_tokens": max_tokens, "temperature": 0}


def run_demo(cfg: StackConfig, max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[str, dict]:
    """Start the stack, ask, stop; the answer's text and the summary (module doc)."""
    body = demo_body(cfg.model, max_tokens)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with Stack(cfg) as stack:
        t = time.monotonic()
        answer = post_json(f"{stack.url}{path}", body, headers=stack.auth_headers, timeout_s=600)
        elapsed = time.monotonic() - t
        stats = stack_stats(cfg)
    choice = answer["choices"][0]
    text = choice["message"]["content"] if "messages" in body else choice["text"]
    return text, summary_of(cfg, answer, stats, elapsed)


def summary_of(cfg: StackConfig, answer: dict, stats: dict[str, dict[str, float]], elapsed: float) -> dict:
    """Tokens, seconds, what was pulled, and each side's device KV beside what a dense engine holds: the
    prefill's few shared buffers against every layer's KV of a max_model_len prompt, the decode's
    indexer keys and hot buffers of one sequence slot against that slot's full KV (both reserve
    max_model_len rows per slot), and this request's own KV."""
    from dsamodel.served import read_config
    from kvoffload_engine.model_layout import kv_layout

    layout = kv_layout(read_config(cfg.model), cfg.block_size)
    main_bytes = sum(layer.main.row_bytes for layer in layout.layers)  # a token's KV, every layer
    p, d = stats["prefill-0"], stats["decode-0"]
    usage = answer["usage"]
    slot_dense = cfg.max_model_len * main_bytes  # a dense engine's KV of one sequence slot
    slot_sparse = d["device_kv_bytes"] / d["max_num_seqs"]  # one slot's indexer rows and hot buffers
    out = {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "seconds": round(elapsed, 3),
        "layers": layout.num_layers,
        "request_kv_bytes": (usage["prompt_tokens"] + usage["completion_tokens"]) * main_bytes,
        "prefill_device_kv_bytes": int(p["device_kv_bytes"]),
        "prefill_device_kv_ratio_to_dense": round(p["device_kv_bytes"] / slot_dense, 4),
        "decode_device_kv_bytes_per_sequence": int(slot_sparse),
        "decode_device_kv_ratio_to_dense": round(slot_sparse / slot_dense, 4),
        "decode_bytes_pulled": int(d["bytes_read"]),
        "decode_layer_pulls": int(d["read_done"]),
        "prefill_pool_used_bytes": int(p["pool_used_bytes"]),
        "decode_pool_used_bytes_after": int(d["pool_used_bytes"]),
        "prefill_held_slots_after": int(p["held_slots"]),
    }
    if "metastore" in stats:  # pool "kvoffload" (with --pool mooncake the stack runs no metastore)
        m = stats["metastore"]
        out["metastore"] = {k: m[k] for k in sorted(m) if k.startswith(("objects", "pools", "live"))}
    return out
