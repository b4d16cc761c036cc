"""Tensor parallel P/D under vLLM: which decode rank a prefill rank feeds, what it announces, and
where its bytes land.

The rule is the guide's (``kvcore.pdpair``): prefill TP must be >= decode TP and divisible by it;
with ``ratio = prefill_tp / decode_tp`` decode rank ``r`` pulls from prefill ranks
``[r × ratio, (r + 1) × ratio)``, its contributors. What a contributor holds of a decode rank's KV
decides the split:

- **Head slices** (a dense model: vLLM gives each rank ``heads / tp`` of the KV heads): each
  contributor holds its own ``1 / ratio`` of every row of the decode rank, so each announces every
  row of the step and the decode writes them into its slice of the block (``HeadSlice``). vLLM's
  CPU cache keeps the heads outermost in a block (``[num_blocks, heads, block_size, ...]``), so a
  contributor's slice is one dense run of each block's bytes.
- **Copies** (an MLA latent, or one KV head every rank holds): every contributor holds every row,
  so each announces only its share of the step's blocks (``announced_rows``: consecutive blocks,
  the shares partition the step, no row crosses twice).

With ``ratio == 1`` the two coincide: decode rank r pulls everything from prefill rank r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.pdpair import contributor_share, tp_target
from kvcore.transferregistry import EMBEDDED
from kvoffload_vllm.d2h_layers import D2HLayers
from kvoffload_vllm.d2h_plan import Peer, blocks_of


@dataclass(frozen=True)
class Contribution:
    """What one prefill rank sends one request's decode: to the decode rank at ``endpoint``, as
    contributor ``index`` of ``count``; ``shares`` when every contributor holds the same rows."""

    endpoint: str
    index: int
    count: int
    shares: bool


def contribution(peer: Peer, tp_rank: int, tp_size: int, replicated: bool) -> Contribution:
    """Prefill rank ``tp_rank`` of ``tp_size``'s part in sending to ``peer`` (ValueError naming both TP
    sizes when they do not pair: prefill TP >= decode TP and divisible)."""
    target = tp_target(tp_size, peer.decode_tp, tp_rank)
    count = tp_size // peer.decode_tp
    return Contribution(peer.endpoints[target], tp_rank % count, count, replicated and count > 1)


def announced_rows(start: int, end: int, block_size: int, part: Contribution) -> tuple[int, int]:
    """The rows of a step's ``[start, end)`` that contributor ``part`` announces: all of them for a
    head slice; for copies the rows of its share of the step's blocks (``contributor_share`` over the
    blocks, clipped to the step), possibly none (``start == end``)."""
    if not part.shares:
        return start, end
    blocks = blocks_of(start, end, block_size)
    a, b = contributor_share(blocks.start, blocks.stop, part.index, part.count)
    lo, hi = max(start, a * block_size), min(end, b * block_size)
    return (lo, hi) if lo < hi else (start, start)


@dataclass(frozen=True)
class HeadSlice:
    """Which part of a decode block a prefill rank's block is: slice ``index`` of ``count`` equal runs
    of its bytes (``count == 1``: the whole block)."""

    index: int = 0
    count: int = 1


def head_slice(
    prefill_row_bytes: int, decode_row_bytes: int, prefill_tp: int, prefill_rank: int, decode_tp: int
) -> HeadSlice | str:
    """The ``HeadSlice`` a prefill rank's rows fill in a decode rank's, or a str saying why they fit
    none: rows of equal bytes are whole (a copy, or ratio 1); rows ``ratio`` times smaller are the
    contributor's head slice."""
    ratio = prefill_tp // decode_tp
    if prefill_row_bytes == decode_row_bytes:
        return HeadSlice()
    if ratio > 1 and prefill_row_bytes * ratio == decode_row_bytes:
        return HeadSlice(prefill_rank % ratio, ratio)
    return (
        f"rows of {prefill_row_bytes} bytes (prefill tp rank {prefill_rank} of {prefill_tp}) fill neither a "
        f"whole row of {decode_row_bytes} bytes (decode tp {decode_tp}) nor its 1/{ratio} head slice"
    )


def slice_problem(part: HeadSlice, layers: D2HLayers, layer: int, kv_heads: int, engine: bool) -> str:
    """ "" when a decode rank can take ``part`` of each block of ``layer``, else why: a head slice is
    one run of a block's bytes only where the block's outermost dimension is this rank's ``kv_heads``
    KV heads, and a transfer engine reads whole blocks only."""
    if part.count == 1:
        return ""
    if engine:
        return (
            f"the prefill's ranks each hold 1/{part.count} of the KV heads, and a transfer engine reads whole "
            f"blocks only: use transfer_backend {EMBEDDED!r} for this TP pairing"
        )
    lead = layers.leads[layer]
    if lead != kv_heads or lead % part.count:
        return (
            f"a block's outermost dimension is {lead}, not this rank's {kv_heads} KV heads in {part.count} "
            "equal parts: a prefill rank's head slice is not one run of the block's bytes"
        )
    return ""


def sliced(page: torch.Tensor, part: HeadSlice) -> torch.Tensor:
    """``page`` (``[num_blocks, page_bytes]``) as the ``[num_blocks, page_bytes / count]`` view of the
    slice ``part`` of every block (``page`` itself for a whole block)."""
    return page if part.count == 1 else page.unflatten(1, (part.count, -1))[:, part.index]
