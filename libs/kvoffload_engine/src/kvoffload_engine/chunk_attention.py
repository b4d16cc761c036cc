"""One prefill chunk's attention for one layer, as every TP rank computes it.

``attend``: the chunk's queries attend over their request's rows as the model's prefill does
(``layer.prefill_attend``: the DSA model's queries select their top-k rows with the lightning
indexer and attend over them; a Llama model's attend over every row before them).
``LayerwisePrefill`` calls it over its slot's rows; a TP follower (``kvoffload_engine.tp_prefill``)
over the rows rank 0 sent it plus its own, so both run the same code.
"""

from __future__ import annotations

import torch

from dsamodel.served import ServedLayer, ServedModel, index_topk


def attend(
    model: ServedModel, layer: ServedLayer, proj, main: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """``proj`` (the layer's projections of the chunk) attends over the rows ``main`` / ``idx`` (every
    row up to the chunk's end) -> the attention output ``layer.finish`` takes."""
    return layer.prefill_attend(proj, main, model.index_codec.decode(idx), positions, index_topk(model))
