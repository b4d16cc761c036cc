"""Generation over a full KV kept per layer: ``generate_dense``'s tokens without its recompute.

``generate_full_kv(model, prompt_ids, params)`` is ``reference.generate_dense`` (which recomputes
``forward_dense`` over the whole sequence for every token) done incrementally: the prompt runs as
one chunk (through ``forward_dense``'s layers bit for bit), then each new token alone (its logits
are ``forward_dense``'s up to rounding: a one-row matmul may sum in another order). ``FullKV`` is the
only state: per base layer, its own tensors of every KV row and every indexer key so far, on the
model's device. Per layer: project, write this step's rows, then the prompt attends as the model's
prefill does (``layer.prefill_attend``: the DSA model's indexer top-k, a Llama model's dense causal
attention) and each new token over the indexer's top-k of every row so far (``layer.select``,
``gather_rows`` in top-k order, ``layer.attend``: what sparse decode computes), finish.

No blocks, no buffer shared between layers, no host pool, no hot cache, no native code, no MTP
(drafts never change greedy tokens): the plainest path a serving engine's tokens are checked
against.
"""

from __future__ import annotations

import torch

from dsamodel.attention import gather_rows
from dsamodel.sampling import RequestSampler
from dsamodel.served import ServedModel, index_keys, index_topk
from openai_api.sampling_params import SamplingParams


class FullKV:
    """Every base layer's latent-KV rows and (decoded) indexer keys of one sequence, ``capacity``
    rows each; rows not yet written are NaN, so a read of one poisons the logits."""

    def __init__(self, model: ServedModel, capacity: int) -> None:
        cfg, dev = model.config, model.device
        index_topk(model)  # a model without an indexer cannot decode sparsely: ValueError naming the fix
        self.model = model
        self.capacity = capacity
        self.num_tokens = 0
        self.kv = [
            torch.full((capacity, cfg.kv_row_width), float("nan"), dtype=model.dtype, device=dev) for _ in model.layers
        ]
        key_dtype = torch.float32 if model.index_codec.fp8 else model.dtype  # what the codec decodes to
        width = cfg.index_head_dim or 0  # set: index_topk() above refused a model without an indexer
        self.keys = [torch.full((capacity, width), float("nan"), dtype=key_dtype, device=dev) for _ in model.layers]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] at positions num_tokens.. -> float32 logits [V] after the last one (what a
        serving engine computes: the LM head over that row alone); every token's rows are kept."""
        start, end = self.num_tokens, self.num_tokens + tokens.shape[0]
        if end > self.capacity:
            raise ValueError(f"{end} tokens exceed the capacity of {self.capacity} rows")
        positions = torch.arange(start, end, device=self.model.device)  # [T]
        h = self.model.embed(tokens.to(self.model.device))  # [T, D]
        for layer, kv, keys in zip(self.model.layers, self.kv, self.keys, strict=True):
            h = self._layer(layer, kv, keys, h, positions)
        self.num_tokens = end
        return self.model.logits(h[-1:])[0]

    def _layer(
        self, layer, kv: torch.Tensor, keys: torch.Tensor, h: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """One layer over h [T, D] at ``positions`` (num_tokens..): keep the rows, select over every
        row so far, attend -> h [T, D]."""
        codec, topk = self.model.index_codec, index_topk(self.model)
        start, end = self.num_tokens, self.num_tokens + h.shape[0]
        proj = layer.project(h, positions)
        kv[start:end] = proj.kv  # [T, W]
        keys[start:end] = codec.decode(codec.encode(index_keys(proj)))  # the keys as a cache holds them
        if start == 0:  # the prompt, as one prefill chunk
            return layer.finish(h, layer.prefill_attend(proj, kv[:end], keys[:end], positions, topk))
        indices = layer.select(proj, keys[:end], positions, topk)  # [T, k]
        rows, valid = gather_rows(kv[:end], indices)  # [T, k, W] in top-k order, [T, k]
        return layer.finish(h, layer.attend(proj, rows, valid))


def generate_full_kv(model: ServedModel, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """Sample up to ``params.max_tokens`` tokens after ``prompt_ids`` over a ``FullKV``."""
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    sampler = RequestSampler(params, eos_token_id=model.config.eos_token_id)
    cache = FullKV(model, len(prompt_ids) + params.max_tokens)
    logits = cache.forward(torch.tensor(prompt_ids, dtype=torch.long))  # [V]
    while True:
        token = sampler.step(logits)
        if sampler.finished:
            return list(sampler.output_ids)
        logits = cache.forward(torch.tensor([token], dtype=torch.long))
