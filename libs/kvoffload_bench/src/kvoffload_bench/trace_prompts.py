"""The prompts the trace recorders read (``trace_record``, ``trace_indexer``): a chat asking to
summarize a document of this repository, exactly ``context`` tokens long."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]  # the repository: SOURCES are its documents
SOURCES = ("docs/design.md", "docs/configuration.md", "README.md", "docs/vllm.md", "docs/models.md")
INSTRUCTION = "Summarize the following document in a few sentences.\n\n"
_DOC = "\x00DOCUMENT\x00"  # placeholder splitting the rendered chat template


def prompt_ids(tokenizer, *, context: int, requests: int) -> tuple[torch.Tensor, list[list[str]]]:
    """``[requests, context]`` token ids of chat prompts asking to summarize a document, and the
    sources each one read. Request ``i`` starts with ``SOURCES[i % n]`` and continues through the
    next sources (cyclically) until the document part fills exactly its share of ``context``."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": INSTRUCTION + _DOC}], tokenize=False, add_generation_prompt=True
    )
    prefix, suffix = (tokenizer(part, add_special_tokens=False)["input_ids"] for part in rendered.split(_DOC))
    room = context - len(prefix) - len(suffix)
    if room < 1:
        raise ValueError(
            f"context {context} is too short: the chat template alone takes {len(prefix) + len(suffix)} tokens"
        )
    docs = [tokenizer((ROOT / src).read_text(), add_special_tokens=False)["input_ids"] for src in SOURCES]
    rows, used = [], []
    for r in range(requests):
        doc: list[int] = []
        names: list[str] = []
        i = r
        while len(doc) < room:
            doc += docs[i % len(docs)] + tokenizer("\n\n", add_special_tokens=False)["input_ids"]
            names.append(SOURCES[i % len(docs)])
            i += 1
        rows.append(prefix + doc[:room] + suffix)
        used.append(names)
    return torch.tensor(rows, dtype=torch.long), used


def sources_meta(sources: list[list[str]]) -> list[dict]:
    """What each prompt read, for a trace's metadata: its documents' paths and their SHA-256."""
    return [
        {"paths": paths, "sha256": [hashlib.sha256((ROOT / p).read_bytes()).hexdigest() for p in paths]}
        for paths in sources
    ]
