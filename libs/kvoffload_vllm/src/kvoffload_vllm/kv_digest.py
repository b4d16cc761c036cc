"""Digests of a request's prompt KV, layer by layer: what a decode with ``kv_digests`` on logs once a
pull landed, so the KV it took from a prefill can be compared byte for byte with any other copy of
the same blocks (another engine's cache, a pool's objects: a pool object's plane is the block's page
bytes, ``kvoffload_vllm.block_bytes``, as here).

A layer's digest is blake2b-128 over its full prompt blocks' page bytes, in the prompt's order,
from the first block that is not vLLM's null block (a sliding window's skipped ones lead).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from kvoffload_vllm.d2h_layers import D2HLayers
from kvoffload_vllm.kv_groups import skip_null


def pages_digest(pages: torch.Tensor) -> str:
    """blake2b-128 (hex) of ``pages``: ``[n, page_bytes]`` uint8, the blocks in the prompt's order."""
    data = pages.contiguous().cpu().view(-1).numpy()
    return hashlib.blake2b(data.data, digest_size=16).hexdigest()


def prompt_digests(
    layers: D2HLayers, block_ids: Sequence[Sequence[int]], num_tokens: int
) -> tuple[list[str], list[tuple[int, int]]]:
    """(each layer's digest, each KV cache group's digested blocks ``(first, stop)`` of the prompt):
    the full blocks of ``num_tokens`` prompt tokens, ``block_ids[g]`` the request's blocks of group g."""
    spans = []
    for g in layers.groups:
        full = list(block_ids[g.index])[: num_tokens // g.block_size]
        spans.append((skip_null(full), len(full)))
    digests = []
    for page, group in zip(layers.pages, layers.group_of, strict=True):
        first, stop = spans[group]
        ids = torch.tensor(list(block_ids[group])[first:stop], dtype=torch.long, device=page.device)
        digests.append(pages_digest(page.index_select(0, ids)))
    return digests, spans
