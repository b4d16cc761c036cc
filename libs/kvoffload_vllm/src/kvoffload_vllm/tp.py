"""This engine's tensor parallel facts, as both connectors need them: the process's TP rank, and
whether every rank holds the same KV (an MLA latent, or one KV head vLLM copies to every rank)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def tp_rank_of(vllm_config: VllmConfig) -> int:
    """This process's TP rank: its worker's (vLLM's TP group, once initialised), else 0 (the
    scheduler, which needs none)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

    return get_tensor_model_parallel_rank() if model_parallel_is_initialized() else 0


def kv_replicated(vllm_config: VllmConfig) -> bool:
    """Whether every TP rank holds the same KV: an MLA latent, or a model of one KV head (with one
    rank: whether it is MLA)."""
    model, tp = vllm_config.model_config, vllm_config.parallel_config.tensor_parallel_size
    return bool(model.use_mla) or (tp > 1 and model.get_total_num_kv_heads() == 1)


def kv_heads_copied(vllm_config: VllmConfig) -> int:
    """How many ranks hold each KV head where vLLM copies heads to some ranks only (fewer heads than
    ranks, more than one; MLA has none), else 1."""
    model, tp = vllm_config.model_config, vllm_config.parallel_config.tensor_parallel_size
    if model.use_mla:
        return 1
    heads = model.get_total_num_kv_heads()
    return tp // heads if 1 < heads < tp else 1
