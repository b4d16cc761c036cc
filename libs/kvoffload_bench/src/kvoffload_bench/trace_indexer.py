"""Record the live indexer's top-k trace of a Llama model with an indexer (``kvoffload trace record
smollm2-indexer``).

``kvoffload_bench.trace_record`` records what an ideal selector would pick (the exact attention top-k
of each KV-head group, from transformers' attention weights). This records what the sparse decode
actually asks the hot cache for: the model's own indexer (``dsamodel.pca_indexer``), one selection
per layer shared by the layer's heads, along the sparse decode's own greedy tokens. The prompts are
``trace_prompts.prompt_ids``'s (a document of this repository to summarize, exactly ``context``
tokens). As the engine serves them: the prompt is computed densely (the prefill,
``quality_branch.ContextRows``) and its logits give the first token; then each decode step is one
token of a sparse ``quality_branch.Branch`` whose selections are kept. Streams are request-major,
then layer; every stream's group is 0 (the selection is the layer's). Step ``t``'s query is
generated token ``t`` at position ``context + t``, over ``context + t + 1`` tokens (the Trace
contract with ``context0 = context + 1``), so ``kvoffload_engine.trace_topk.TraceTopK`` replays it
on an engine request with the same prompt from its first decode step on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvcore.traces.trace import Trace
from kvoffload_bench.trace_prompts import prompt_ids, sources_meta

SCORE = (
    "the model's indexer (PCA keys and queries, dsamodel.pca_indexer): softmax mass over the layer's "
    "query heads summed, top-k shared by the layer's heads, as the sparse decode selects"
)


def record_indexer(
    model_dir: str | Path,
    *,
    name: str = "smollm2-indexer",
    context: int = 4096,
    steps: int = 128,
    topk: int | None = None,
    requests: int = 2,
    attention: str = "sdpa",
    progress: Callable[[int, int], None] | None = None,
) -> Trace:
    """The live indexer's trace of ``requests`` summaries decoded sparsely by the model in ``model_dir``
    (module docstring); ``topk`` defaults to the model's ``index_topk``; ``attention`` is the prompt's
    (``ContextRows``: ``"model"`` is bit-exact with the engine's prefill, ``"sdpa"`` faster)."""
    from transformers import AutoTokenizer

    from dsamodel.llama import LlamaModel
    from dsamodel.weights import load_model

    model = load_model(model_dir)
    if not isinstance(model, LlamaModel) or not model.has_indexer:
        raise ValueError(f"{model_dir}: recording the indexer's trace needs a Llama model with an indexer")
    k = model.config.index_topk if topk is None else topk
    if k is None:
        raise ValueError(f"{model_dir}: the model's config names no index_topk: give topk")
    if context < 2 or steps < 1 or not 1 <= k <= context:
        raise ValueError(f"need context >= 2, steps >= 1 and 1 <= topk <= context; got {context}, {steps}, {k}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, sources = prompt_ids(tokenizer, context=context, requests=requests)
    layers = len(model.layers)
    out = torch.empty(requests, layers, steps, k, dtype=torch.int32)
    generated = torch.empty(requests, steps + 1, dtype=torch.long)
    for r in range(requests):

        def step_done(t: int, r: int = r) -> None:
            if progress:
                progress(r * steps + t + 1, requests * steps)

        out[r], generated[r] = _decode(model, prompts[r], k, steps, attention, step_done)
    grid = torch.arange(requests * layers, dtype=torch.int32)
    meta = _meta(name, model, tokenizer, k, context, steps, attention, sources, generated)
    return Trace(
        name,
        out.view(requests * layers, steps, k),
        torch.full((grid.numel(),), context + 1, dtype=torch.int64),
        grid % layers,
        grid // layers,
        torch.zeros(grid.numel(), dtype=torch.int32),
        meta,
    )


def _decode(
    model, prompt: torch.Tensor, k: int, steps: int, attention: str, step_done: Callable[[int], None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request as the engine serves it (module docstring): each step's selection of every layer
    [layers, steps, k] int32 and the tokens [steps + 1] (the prefill's first, then each step's)."""
    from kvoffload_bench.quality_branch import Branch, ContextRows

    layers = len(model.layers)
    picked: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    tokens = torch.empty(steps + 1, dtype=torch.long)
    with torch.inference_mode():
        rows = ContextRows.compute(model, prompt, attention)  # the prefill: its logits give token 0
        branch = Branch(model, rows, "sparse", topk=k, capacity=steps, selections=picked)
        token = rows.last_logits.argmax(-1, keepdim=True)  # [1]
        tokens[0] = token[0]
        for t in range(steps):  # step t: token t at position context + t
            token = branch.extend(token)[-1:].argmax(-1)
            tokens[t + 1] = token[0]
            step_done(t)
    return torch.stack([torch.cat(per_layer) for per_layer in picked]).to(torch.int32), tokens


def _meta(name, model, tokenizer, k, context, steps, attention, sources, generated) -> dict:
    """How the trace was made: the recording's parameters, its sources and the tokens decoded."""
    return {
        "kind": "recorded",
        "model": name,
        "selector": "indexer",
        "context": context,
        "steps": steps,
        "topk": k,
        "topk_fraction": k / context,
        "requests": len(sources),
        "layers": len(model.layers),
        "groups": 1,
        "score": SCORE,
        "decode": f"greedy sparse decode (top-{k}) in {str(model.dtype).removeprefix('torch.')} on CPU after a "
        f"dense prefill of the prompt ({attention} attention); step 0's query is the prefill's token",
        "sources": sources_meta(sources),
        "generated": [tokenizer.decode(row) for row in generated.tolist()],
        "generated_ids": generated.tolist(),
    }
