"""Top-k override of the sparse decode: a given choice of past tokens in place of the indexer's.

``SparseDecoder``'s ``topk_override`` (constructor keyword, or the attribute of the same name, set
or cleared between steps; benchmarks and tests) replaces the indexer's choice with a given one,
e.g. a recorded or synthetic trace (``kvoffload_engine.trace_topk``). In every layer the indexer
still runs (a step costs what a real decode step costs), then::

    topk = topk_override(layer, request_ids, positions)   # -> [N, k], k = index_topk

with ``layer`` the cache layer index (MTP layers included), ``request_ids`` [N] the request of
each token row and ``positions`` [N] (int64, host) the position each row processes: its context
holds ``positions[n] + 1`` tokens. The result (any integer dtype, any device) must give, per row,
distinct positions in ``[0, positions[n]]`` or ``-1`` (padding); it is checked (ValueError) and
converted to the indexer's dtype and device. The sparse path and the ``keep_device_kv_cache``
path both use it, so I2 holds on traces too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (cache layer, request id per token row [N], positions [N] int64 on the host) -> top-k [N, k]
TopkOverride = Callable[[int, list[str], torch.Tensor], torch.Tensor]


def overridden_topk(
    override: TopkOverride, layer: int, row_ids: list[str], positions: torch.Tensor, topk: torch.Tensor
) -> torch.Tensor:
    """``override``'s choice for this layer's rows in place of the indexer's ``topk`` [N, k], checked,
    as the indexer's dtype and device."""
    out = override(layer, row_ids, positions)
    if (
        not isinstance(out, torch.Tensor)
        or out.shape != topk.shape
        or out.dtype.is_floating_point
        or out.dtype.is_complex
        or out.dtype == torch.bool
    ):
        got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"topk_override of layer {layer} must return an integer [N, k] = {list(topk.shape)} tensor, got {got}"
        )
    pos = positions.to(out.device)[:, None]  # [N, 1]
    bad = (out < -1) | (out > pos)  # [N, k] outside [0, position] and not padding
    if bool(bad.any()):
        n, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"topk_override of layer {layer}: row {n} (request {row_ids[n]!r}, position "
            f"{int(positions[n])}) selects {int(out[n, j])}, outside [0, {int(positions[n])}] "
            f"and not -1"
        )
    return out.to(device=topk.device, dtype=topk.dtype)
