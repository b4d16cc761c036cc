"""One prefill chunk's sparse attention for one layer, as every TP rank computes it.

``attend``: the chunk's queries select their top-k rows with the lightning indexer and attend over
them (absorbed MLA). ``LayerwisePrefill`` calls it over its slot's rows; a TP follower
(``kvoffload_engine.tp_prefill``) over the rows rank 0 sent it plus its own, so both run the same code.
"""

from __future__ import annotations

import torch

from dsamodel.attention import gather_rows, indexer_topk, sparse_mla_attention
from dsamodel.model import DecoderLayer, DSAModel


def attend(
    model: DSAModel, layer: DecoderLayer, proj, main: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """``proj`` (the layer's projections of the chunk) selects top-k of the rows ``main`` / ``idx``
    (every row up to the chunk's end) and attends over them -> latent [T, H, R] for ``layer.finish``."""
    topk = indexer_topk(proj.index_q, proj.index_w, model.index_codec.decode(idx), positions, model.config.index_topk)
    rows, valid = gather_rows(main, topk)  # [T, k, R + r], [T, k]
    return sparse_mla_attention(proj.q_latent, proj.q_rope, rows, valid, layer.softmax_scale)
