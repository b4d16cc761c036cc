"""``kvoffload bench quality``: what sparse decode does to a real model's answers, and its speed.

SmolLM2-135M-Instruct with its PCA indexer (``kvoffload model fetch smollm2``), the same weights and
the same layer steps dense and sparse, side by side in one run, on ``prompts`` documents of installed
text (``quality_text``) at each context length of ``contexts`` (2K, 4K and 7K tokens), the indexer
selecting ``k = min(index_topk, context / 8)`` tokens per query. Per document and context, the
context's rows are computed once (``quality_branch.ContextRows``, dense as the prefill is) and two
branches continue it, dense and sparse (``quality_branch.Branch``):

- ``indexer_recall``: the share of the dense attention mass (summed over a layer's heads) in the
  sparse branch's selection, median over documents, layers and continuation steps; beside it the
  exact top-k's (``oracle``, the ceiling) and a window of the first 4 and the last k - 4 tokens'
  (``recency``, the floor); ``recall_by_k``: the same median at other k (the curve).
  Goal >= 0.90.
- ``ppl_ratio``: perplexity of the ``continuation`` tokens after each context (teacher-forced),
  sparse / dense, pooled over every document and context. Goal <= 1.03.
- ``greedy_agreement``: greedy tokens after the context, dense and sparse in lockstep: how many
  agree before the first divergence (cap ``greedy_cap``); median over documents and contexts.
  Goal >= 32.
- ``planted_facts``: one fact per context length planted at a random depth of each document
  (``quality_text.plant``), asked after the context; accuracy dense and sparse over every case.
  Goal: sparse >= dense - 5 points, over >= 40 cases; not measured when dense itself answers under
  half of them (near zero on both sides says nothing about sparse decode).
- Speed (``speed=True``): ``quality_speed.measure_speed``'s decode TPOT of the stack with sparse
  offload, the stack dense and a plain vLLM server at batch 1 per context, side by side, and the
  device KV per request (``tpot_ratio_to_vllm.<ctx>``: goal at 7K <= 1.0; ``device_kv_ratio``:
  goal <= its bound, (hot buffer + indexer) / dense KV).

A figure not measured is not met (``not_measured`` says why). ``plot``: a directory the curves go
to as PNG files (``quality_plot``).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from dsamodel.hf_tokenizer import HFTokenizer
from dsamodel.llama import LlamaModel
from kvoffload_bench.quality_branch import Branch, ContextRows, Recall
from kvoffload_bench.quality_text import Fact, documents, plant

log = structlog.get_logger(__name__)

CONTEXTS = (2048, 4096, 7168)
GOALS = {"indexer_recall": 0.90, "ppl_ratio": 1.03, "greedy_agreement": 32, "facts_points": 5.0, "tpot_7k": 1.0}
# below this dense accuracy the planted facts cannot tell sparse from dense (both near zero): not measured
FACTS_DENSE_FLOOR = 0.5
RECALL_KS = (64, 128, 256, 512, 1024)
ANSWER_TOKENS = 8


def run(
    prompts: int = 16,
    contexts: tuple[int, ...] = CONTEXTS,
    continuation: int = 256,
    greedy_cap: int = 64,
    seed: int = 0,
    speed: bool = True,
    plot: str | None = None,
    model_dir: str | None = None,
    say: Callable[[str], None] = lambda line: log.info("bench_quality", progress=line),
) -> dict[str, Any]:
    """The bench (module doc) -> its JSON-able result."""
    if prompts < 1 or not contexts or continuation < 2 or greedy_cap < 1:
        raise ValueError("prompts >= 1, at least one context, continuation >= 2 and greedy_cap >= 1")
    model, tok, where = _model(model_dir)
    index_topk = model.config.index_topk
    assert index_topk is not None  # _model refuses a model without an indexer
    ks = {ctx: min(index_topk, ctx // 8) for ctx in contexts}
    docs = documents(tok, prompts, max(contexts) + continuation)
    rng = random.Random(seed)
    acc = _Tally(contexts)
    t0 = time.monotonic()
    with torch.inference_mode():
        for d, doc in enumerate(docs):
            planted, facts = plant(tok, doc, contexts, rng)
            for ctx in contexts:
                _document(model, tok, planted, ctx, ks[ctx], continuation, greedy_cap, facts[ctx], acc)
                say(f"document {d + 1}/{len(docs)}, context {ctx}: {time.monotonic() - t0:.0f} s")
    result = {
        "bench": "quality",
        "model": where,
        "prompts": len(docs),
        "contexts": list(contexts),
        "index_topk_by_context": {_name(c): ks[c] for c in contexts},
        "continuation_tokens": continuation,
        "greedy_cap": greedy_cap,
        "context_attention": "sdpa (the rows both branches read; quality_branch)",
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    } | acc.summary()
    result["quality_s"] = round(time.monotonic() - t0, 1)
    if speed:
        from kvoffload_bench.quality_speed import measure_speed

        result["speed"] = measure_speed(contexts)
    result |= _goals(result, contexts)
    if plot is not None:
        from kvoffload_bench.quality_plot import write_plots

        result["plots"] = write_plots(result, plot)
    return result


def _model(model_dir: str | None) -> tuple[LlamaModel, HFTokenizer, str]:
    """SmolLM2 with its indexer (built once per machine) or the Llama model in ``model_dir``."""
    from dsamodel.weights import load_model
    from kvoffload_testing.model_indexer import served_model

    where = model_dir or str(served_model("smollm2"))
    model = load_model(where)
    if not isinstance(model, LlamaModel) or not model.has_indexer:
        raise ValueError(f"bench quality needs a Llama model with an indexer (kvoffload model indexer DIR): {where}")
    return model, HFTokenizer.from_dir(where), where


def _document(model, tok, doc: list[int], ctx: int, k: int, cont: int, cap: int, fact: Fact, acc: _Tally) -> None:
    """Every figure of one document at one context length."""
    tokens = torch.tensor(doc, dtype=torch.long)
    rows = ContextRows.compute(model, tokens[:ctx])
    first = int(torch.argmax(rows.last_logits))
    # perplexity: the context's last logits predict token ctx (the same for both branches)
    targets = tokens[ctx : ctx + cont]
    nll_first = -torch.log_softmax(rows.last_logits, -1)[targets[0]]
    recall = Recall()
    for mode in ("dense", "sparse"):
        branch = Branch(
            model,
            rows,
            mode,
            topk=k,
            capacity=cont,
            recall=recall if mode == "sparse" else None,
            recall_ks=tuple(x for x in RECALL_KS if x < ctx),
        )
        logits = branch.extend(targets[:-1])  # [cont - 1, V]
        nll = -torch.log_softmax(logits, -1).gather(1, targets[1:, None])[:, 0]
        acc.nll[mode][ctx].append(torch.cat((nll_first[None], nll)))
    acc.add_recall(ctx, recall)
    acc.agreement[ctx].append(_agreement(model, rows, k, first, cap))
    for mode in ("dense", "sparse"):
        acc.facts[mode][ctx].append(_ask(model, tok, rows, mode, k, tokens[:ctx], fact))


def _agreement(model: LlamaModel, rows: ContextRows, k: int, first: int, cap: int) -> int:
    """Greedy tokens dense and sparse agree on before their first divergence (the first, the
    prefill's, always agrees), up to ``cap``."""
    dense = Branch(model, rows, "dense", capacity=cap)
    sparse = Branch(model, rows, "sparse", topk=k, capacity=cap)
    a = b = first
    agreed = 0
    while a == b and agreed < cap:
        agreed += 1
        nxt = torch.tensor([a])
        a, b = int(torch.argmax(dense.extend(nxt)[-1])), int(torch.argmax(sparse.extend(nxt)[-1]))
    return agreed


def _ask(model, tok, rows: ContextRows, mode: str, k: int, context: torch.Tensor, fact: Fact) -> bool:
    """Whether a branch of ``mode`` answers the fact's question after the context."""
    if not fact.depth + 1 < context.shape[0]:
        raise ValueError(f"the fact at depth {fact.depth} is not inside the {context.shape[0]}-token context")
    branch = Branch(model, rows, mode, topk=k, capacity=len(fact.question) + ANSWER_TOKENS)
    nxt = int(torch.argmax(branch.extend(torch.tensor(fact.question))[-1]))
    out = [nxt]
    for _ in range(ANSWER_TOKENS - 1):
        nxt = int(torch.argmax(branch.extend(torch.tensor([nxt]))[-1]))
        out.append(nxt)
    return fact.answered(tok.decode(out, skip_special_tokens=True))


class _Tally:
    """What the documents measured, per context length, and its summary."""

    def __init__(self, contexts: tuple[int, ...]) -> None:
        self.contexts = contexts
        self.nll: dict[str, dict[int, list[torch.Tensor]]] = {m: {c: [] for c in contexts} for m in ("dense", "sparse")}
        self.recall: dict[str, dict[int, list[torch.Tensor]]] = {
            w: {c: [] for c in contexts} for w in ("indexer", "oracle", "recency")
        }
        self.recall_by_k: dict[int, dict[int, list[torch.Tensor]]] = {c: {} for c in contexts}
        self.agreement: dict[int, list[int]] = {c: [] for c in contexts}
        self.facts: dict[str, dict[int, list[bool]]] = {m: {c: [] for c in contexts} for m in ("dense", "sparse")}

    def add_recall(self, ctx: int, recall: Recall) -> None:
        for what in ("indexer", "oracle", "recency"):
            self.recall[what][ctx] += getattr(recall, what)
        for k, shares in recall.by_k.items():
            self.recall_by_k[ctx].setdefault(k, []).extend(shares)

    def summary(self) -> dict[str, Any]:
        cs = self.contexts
        med = {w: {_name(c): _median(self.recall[w][c]) for c in cs} for w in self.recall}
        ppl = {m: {_name(c): _ppl(self.nll[m][c]) for c in cs} for m in self.nll}
        acc = {m: {_name(c): _share(self.facts[m][c]) for c in cs} for m in self.facts}
        pooled = {m: _ppl([x for c in cs for x in self.nll[m][c]]) for m in self.nll}
        every = [a for c in cs for a in self.agreement[c]]
        cases = {m: [x for c in cs for x in self.facts[m][c]] for m in self.facts}
        return {
            "indexer_recall": _median([x for c in cs for x in self.recall["indexer"][c]]),
            "oracle_recall": _median([x for c in cs for x in self.recall["oracle"][c]]),
            "recency_recall": _median([x for c in cs for x in self.recall["recency"][c]]),
            "recall_by_context": med,
            "recall_by_k": {_name(c): {str(k): _median(v) for k, v in sorted(self.recall_by_k[c].items())} for c in cs},
            "ppl": pooled,
            "ppl_by_context": ppl,
            "ppl_ratio": pooled["sparse"] / pooled["dense"],
            "ppl_ratio_by_context": {_name(c): ppl["sparse"][_name(c)] / ppl["dense"][_name(c)] for c in cs},
            "continuations": sum(len(self.nll["dense"][c]) for c in cs),
            "greedy_agreement": statistics.median(every),
            "greedy_agreement_by_context": {_name(c): statistics.median(self.agreement[c]) for c in cs},
            "planted_facts": {
                "cases": len(cases["dense"]),
                "dense_accuracy": _share(cases["dense"]),
                "sparse_accuracy": _share(cases["sparse"]),
                "by_context": acc,
            },
        }


def _goals(result: dict[str, Any], contexts: tuple[int, ...]) -> dict[str, Any]:
    """``goals_met`` and ``not_measured`` (a figure not measured is not met)."""
    facts = result["planted_facts"]
    met = {
        "indexer_recall": result["indexer_recall"] >= GOALS["indexer_recall"],
        "ppl_ratio": result["ppl_ratio"] <= GOALS["ppl_ratio"],
        "greedy_agreement": result["greedy_agreement"] >= GOALS["greedy_agreement"],
        "planted_facts": facts["cases"] >= 40
        and facts["dense_accuracy"] >= FACTS_DENSE_FLOOR
        and facts["sparse_accuracy"] * 100 >= facts["dense_accuracy"] * 100 - GOALS["facts_points"],
    }
    not_measured: dict[str, str] = {}
    if facts["cases"] < 40:
        not_measured["planted_facts"] = f"{facts['cases']} cases, fewer than 40"
    elif facts["dense_accuracy"] < FACTS_DENSE_FLOOR:
        not_measured["planted_facts"] = (
            f"dense answers {facts['dense_accuracy']:.1%} of the cases, under {FACTS_DENSE_FLOOR:.0%}: "
            "the model cannot retrieve the facts, so they cannot tell sparse from dense"
        )
    speed = result.get("speed")
    seven = next((_name(c) for c in contexts if c >= 7 * 1024), None)
    if speed is None:
        not_measured["tpot_ratio_to_vllm"] = not_measured["device_kv_ratio"] = "speed not measured (speed=False)"
    else:
        ratios = speed.get("tpot_ratio_to_vllm", {})
        if seven is None or seven not in ratios:
            not_measured["tpot_ratio_to_vllm"] = speed.get("not_measured", {}).get(seven, "no 7K context measured")
        bound = speed.get("device_kv_ratio_bound")
        if speed.get("device_kv_ratio") is None or bound is None:
            not_measured["device_kv_ratio"] = "the decode's device KV bytes were not measured"
        met["device_kv_ratio"] = "device_kv_ratio" not in not_measured and speed["device_kv_ratio"] <= bound
    met["tpot_ratio_to_vllm"] = (
        "tpot_ratio_to_vllm" not in not_measured
        and speed is not None
        and (speed["tpot_ratio_to_vllm"][seven] <= GOALS["tpot_7k"])
    )
    met.setdefault("device_kv_ratio", False)
    return {"goals": GOALS, "goals_met": met, "not_measured": not_measured}


def _name(ctx: int) -> str:
    return f"{round(ctx / 1024)}k"


def _median(values: list[torch.Tensor]) -> float:
    if not values:
        raise ValueError("nothing was measured (no document ran)")
    return round(float(torch.cat(values).median()), 4)


def _ppl(nll: list[torch.Tensor]) -> float:
    return float(torch.exp(torch.cat(nll).mean()))


def _share(cases: list[bool]) -> float:
    if not cases:
        raise ValueError("no planted-fact case ran")
    return round(sum(cases) / len(cases), 4)
