"""Record real top-k traces from a pretrained model's attention (``kvoffload trace record``).

A recorded trace is what an ideal sparse-attention indexer on a real model would select: the
model reads a long prompt (a document from this repository, wrapped in its chat template with a
request to summarize it), then decodes greedily; at every decode step, for every layer and every
KV-head group (the query heads sharing one KV head), each context position is scored by the sum
over the group's heads of its attention probability, and the ``topk`` best positions form that
stream's row of the :class:`~kvcore.traces.trace.Trace`.

- ``kvoffload_bench.trace_prompts.prompt_ids`` builds the prompts: exactly ``context`` tokens each,
  a different document per request;
- :func:`record_ids` runs a model on given prompt ids: prefill (no attention weights: a 4K
  prefill with them would hold ~18 GB), then ``steps`` decode steps with
  ``output_attentions``. At step ``t`` the query is at position ``context - 1 + t`` and the
  context holds ``context + t`` tokens (the Trace contract with ``context0 = context``);
- :func:`record` loads a model directory and ties the two together, with metadata;
- :func:`ensure` gives the cached trace of a known model, recording it first when missing.

The defaults (context 4096, 128 steps, top-128, 2 requests) took 2.4 minutes on 2 busy CPU cores:
two 4K prefills of ~40 s each, then ~0.25 s per decode step. Decode steps run on one thread: with
two threads on shared cores they took ~2 s each (the first recording took 10 minutes).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvcore.traces.trace import Trace, traces_dir
from kvoffload_bench.trace_prompts import INSTRUCTION, prompt_ids, sources_meta

# the traces ``ensure`` can record: ``smollm2`` (the exact attention top-k, ``record``) and
# ``smollm2-indexer`` (the live indexer's selections, ``kvoffload_bench.trace_indexer``), both of
# SmolLM2-135M-Instruct (kvoffload_testing.model_fetch.SOURCES)
KNOWN = ("smollm2", "smollm2-indexer")
SCORE = (
    "sum over the KV-head group's query heads of the softmax attention probability of the decode "
    "query at each context position; top-k by descending score, ties to the lower position"
)


def select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` highest ``scores`` [..., P] in descending order, ties to the lower position."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


@contextlib.contextmanager
def _attention(model, impl: str) -> Iterator[None]:
    """Run ``model`` with attention implementation ``impl`` inside the block."""
    before = model.config._attn_implementation
    model.set_attn_implementation(impl)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run torch ops on ``n`` intra-op threads inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def record_ids(
    model, prompts: torch.Tensor, *, steps: int, topk: int, progress: Callable[[int, int], None] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``steps`` greedy tokens after each prompt of ``prompts`` [R, C] (one request at a time).

    Returns ``topk`` [R * L * G, steps, k] int32 (streams request-major, then layer, then KV group)
    and the generated ids [R, steps]. ``model`` is a transformers causal LM with eager attention.
    """
    R, C = prompts.shape
    cfg = model.config
    L, H, G = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    if C < 2 or steps < 1 or not 1 <= topk <= C:
        raise ValueError(f"need context >= 2, steps >= 1 and 1 <= topk <= context; got {C}, {steps}, {topk}")
    out = torch.empty(R, L, G, steps, topk, dtype=torch.int32)
    generated = torch.empty(R, steps, dtype=torch.long)
    with torch.inference_mode():
        for r in range(R):
            with _attention(model, "sdpa"):  # same math, no [H, C, C] weights: ~3x faster here
                past = model(prompts[r : r + 1, :-1], use_cache=True).past_key_values
            token = prompts[r : r + 1, -1:]  # [1, 1]
            with _threads(1):  # one token a step: one thread is as fast, and does not stall on shared cores
                for t in range(steps):
                    o = model(token, past_key_values=past, use_cache=True, output_attentions=True)
                    probs = torch.cat(o.attentions)[:, :, 0]  # [L, H, C + t]
                    scores = probs.view(L, G, H // G, C + t).sum(2)  # query head h reads KV head h // (H // G)
                    out[r, :, :, t] = select(scores, topk).to(torch.int32)  # [L, G, k]
                    past, token = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
                    generated[r, t] = token[0, 0]
                    if progress:
                        progress(r * steps + t + 1, R * steps)
    return out.view(R * L * G, steps, topk), generated


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' loading bars and warnings inside the block."""
    from transformers.utils import logging

    bars, level = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def record(
    model_dir: str | Path,
    *,
    name: str = "smollm2",
    context: int = 4096,
    steps: int = 128,
    topk: int = 128,
    requests: int = 2,
    progress: Callable[[int, int], None] | None = None,
) -> Trace:
    """The trace of ``requests`` summaries decoded by the model in ``model_dir`` (module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    with _quiet():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    prompts, sources = prompt_ids(tokenizer, context=context, requests=requests)
    topk_ids, generated = record_ids(model, prompts, steps=steps, topk=topk, progress=progress)
    L, G = model.config.num_hidden_layers, model.config.num_key_value_heads
    grid = torch.arange(requests * L * G, dtype=torch.int32)
    provenance = model_dir / "kvoffload-provenance.json"
    meta = {
        "kind": "recorded",
        "model": name,
        "model_provenance": json.loads(provenance.read_text()) if provenance.exists() else None,
        "context": context,
        "steps": steps,
        "topk": topk,
        "topk_fraction": topk / context,
        "requests": requests,
        "layers": L,
        "groups": G,
        "heads_per_group": model.config.num_attention_heads // G,
        "score": SCORE,
        "decode": "greedy; float32 on CPU; prefill of the prompt minus its last token with SDPA attention, "
        "decode steps with eager attention (attention weights); the last prompt token is step 0's query",
        "prompt": "chat template, user message: " + json.dumps(INSTRUCTION) + " + document, truncated so the "
        "prompt is exactly `context` tokens",
        "sources": sources_meta(sources),
        "versions": {d: importlib.metadata.version(d) for d in ("transformers", "torch")},
        "generated": [tokenizer.decode(row) for row in generated.tolist()],
    }
    return Trace(
        name,
        topk_ids,
        torch.full((grid.numel(),), context, dtype=torch.int64),
        grid // G % L,
        grid // (L * G),
        grid % G,
        meta,
    )


def ensure(
    name: str = "smollm2",
    *,
    path: str | Path | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
    progress: Callable[[int, int], None] | None = None,
    **params,
) -> Path:
    """The trace file of model ``name`` (default ``traces_dir()/NAME.pt``), recorded first when it is
    missing (or ``force``); processes asking at once wait for the first one's recording (a file lock)."""
    if name not in KNOWN:
        raise ValueError(f"no recipe for trace {name!r}; known: {', '.join(KNOWN)}")
    path = Path(path) if path else traces_dir() / f"{name}.pt"
    if path.exists() and not force:
        return path
    from kvoffload_testing.model_fetch import cached_model

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() and not force:  # recorded while we waited
            return path
        recorder: Callable[..., Trace]
        if name == "smollm2-indexer":
            from kvoffload_bench.trace_indexer import record_indexer
            from kvoffload_testing.model_indexer import served_model

            model_dir, recorder = served_model("smollm2", log=log), record_indexer  # its indexer built first
        else:
            model_dir, recorder = cached_model(name, log=log), record
        log(f"recording {name} from {model_dir} ({', '.join(f'{k}={v}' for k, v in params.items()) or 'defaults'})")
        recorder(model_dir, name=name, progress=progress, **params).save(path)
    return path
