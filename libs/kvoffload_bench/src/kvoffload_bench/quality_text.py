"""The long documents ``kvoffload bench quality`` reads, and the facts it plants in them.

Documents come from files every installation already has (``dsamodel.indexer_corpus.Source``:
documentation, licences and source of torch, numpy and jinja2), none of them a file the PCA indexer
was calibrated on (``CALIBRATION``): each source is cut into consecutive, non-overlapping segments of
``segment`` tokens, taken in turn from each source, so the same installed files give the same
documents.

A planted fact is one sentence spliced into a document at a seeded random token depth ("the code
for the red door is 4721"), asked at the end of the context; the answer is right when the greedy
continuation names the number.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dsamodel.hf_tokenizer import HFTokenizer
from dsamodel.indexer_corpus import HELD_OUT, Source

SOURCES: tuple[Source, ...] = (
    *HELD_OUT,  # torch's nn.Module, numpy's fromnumeric, jinja2's environment
    Source("torch", "torch/_tensor_docs.py"),  # docstrings: prose with code examples
    Source("torch", "torch/_torch_docs.py"),
    Source("numpy", "numpy/_core/_add_newdocs.py"),
    Source("numpy", "numpy/lib/_function_base_impl.py"),
    Source("torch", "torch/functional.py"),
)

COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "golden", "white", "black")
THINGS = ("door", "box", "gate", "locker", "safe", "drawer", "chest", "vault")


def documents(tokenizer: HFTokenizer, count: int, segment: int) -> list[list[int]]:
    """``count`` documents of ``segment`` tokens each (module doc); ValueError when the sources hold
    fewer."""
    per_source = []
    for source in SOURCES:
        ids = tokenizer.encode(source.text())
        per_source.append([ids[i : i + segment] for i in range(0, len(ids) - segment + 1, segment)])
    docs: list[list[int]] = []
    for turn in range(max(len(s) for s in per_source)):
        docs += [s[turn] for s in per_source if turn < len(s)]
    if len(docs) < count:
        raise ValueError(f"the installed texts hold {len(docs)} documents of {segment} tokens, not {count}")
    return docs[:count]


@dataclass(frozen=True)
class Fact:
    """One planted fact: the key it is asked by, its number, where it sits, the tokens to ask it."""

    color: str
    thing: str
    number: int
    depth: int  # the token position the fact's sentence starts at
    question: list[int]  # the tokens after the context that ask for it

    def answered(self, text: str) -> bool:
        """Whether a greedy continuation ``text`` names the number before anything else does."""
        return text.strip().startswith(str(self.number))


def plant(
    tokenizer: HFTokenizer, doc: list[int], contexts: tuple[int, ...], rng: random.Random
) -> tuple[list[int], dict[int, Fact]]:
    """The document with one fact per context length spliced in at a random depth of that context
    (keys all different), cut back to its length; and each context length's fact."""
    pairs = rng.sample([(c, t) for c in COLORS for t in THINGS], len(contexts))
    planned = []
    for length, (color, thing) in zip(contexts, pairs, strict=True):
        number = rng.randrange(1000, 10000)
        sentence = tokenizer.encode(f"\nNote: the code for the {color} {thing} is {number}.\n")
        planned.append((length, color, thing, number, sentence, rng.randrange(0, length // 2)))
    # splice deepest first so the depths drawn stay the positions the sentences start at; every
    # sentence ends before its context does: depth < length / 2, and the sentences are short
    out = list(doc)
    facts: dict[int, Fact] = {}
    for length, color, thing, number, sentence, depth in sorted(planned, key=lambda p: -p[5]):
        out[depth:depth] = sentence
        question = tokenizer.encode(f"\nQuestion: what is the code for the {color} {thing}?\nAnswer: the code is")
        facts[length] = Fact(color, thing, number, depth, question)
    shifted = {}
    for length, fact in facts.items():  # a sentence spliced before another moves it
        moved = sum(len(p[4]) for p in planned if p[5] < fact.depth)
        shifted[length] = Fact(fact.color, fact.thing, fact.number, fact.depth + moved, fact.question)
    return out[: len(doc)], shifted
