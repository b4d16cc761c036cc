"""Shared by the node-settings tests: a model layout with an MTP layer, the guide's connector configs
as dicts, and helpers that collect the problems of prefill_settings / decode_settings."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.config.decode_settings import decode_settings
from kvcore.config.errors import ConfigError
from kvcore.config.prefill_settings import prefill_settings
from kvcore.layout import KVLayout

# 4 base layers + 1 MTP layer = 5 physical layers; latent 512 + rope 64 in bf16 = 1152 bytes per layer
# and token; indexer keys are not part of the host pool.
KV_LORA_RANK, ROPE_DIM, BLOCK = 512, 64, 64
LAYOUT = KVLayout.for_mla(
    num_hidden_layers=4,
    kv_lora_rank=KV_LORA_RANK,
    qk_rope_head_dim=ROPE_DIM,
    block_size=BLOCK,
    num_mtp_layers=1,
    index_head_dim=128,
)
NUM_LAYERS = 5
MAIN_BYTES_PER_TOKEN = NUM_LAYERS * (KV_LORA_RANK + ROPE_DIM) * 2
EXTRA = "kv_connector_extra_config"
SPARSE = "sparse_kv_offload_config"


def store(backend: str = "memcache", role: str = "kv_producer", **extra: Any) -> dict[str, Any]:
    config = {
        "backend": backend,
        "use_layerwise": True,
        "layerwise_num_shared_buffers": 3,
        "layerwise_independent_layers": [0],
    }
    config.update(extra)
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": role,
        EXTRA: {k: v for k, v in config.items() if v is not None},
    }


def d2h(
    transfer_backend: str | None = "memfabric", role: str = "kv_consumer", kv_port: int | None = 20050
) -> dict[str, Any]:
    out: dict[str, Any] = {"kv_connector": "SfaRemoteD2HConnector", "kv_role": role, EXTRA: {"use_layerwise": True}}
    if transfer_backend is not None:
        out[EXTRA]["transfer_backend"] = transfer_backend
    if kv_port is not None:
        out["kv_port"] = kv_port
    return out


def multi(*children: dict[str, Any], role: str = "kv_producer") -> dict[str, Any]:
    return {"kv_connector": "MultiConnector", "kv_role": role, EXTRA: {"connectors": list(children)}}


def prefill_multi(
    backend: str = "memcache", transfer_backend: str | None = "memfabric", **extra: Any
) -> dict[str, Any]:
    return multi(d2h(transfer_backend, role="kv_producer"), store(backend, **extra))


def additional(**sparse: Any) -> dict[str, Any]:
    return {SPARSE: sparse}


DECODE_SPARSE = additional(enabled=True, topk_buffer_size=4096, dram_size_per_dp_GB=128)
DECODE_KW: dict[str, Any] = {"index_topk": 2048, "max_num_seqs": 4, "max_model_len": 1000}


def prefill_errors(kv: Any, add: Any = None, layout: KVLayout = LAYOUT, **kw: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        prefill_settings(kv, add, layout, **kw)
    return info.value.errors


def decode_errors(kv: Any, add: Any, **kw: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        decode_settings(kv, add, LAYOUT, **{**DECODE_KW, **kw})
    return info.value.errors


def assert_error(errors: list[str], path: str, words: list[str]) -> None:
    matching = [e for e in errors if e.startswith(f"{path}: ")]
    assert matching, errors
    for word in words:
        assert any(word in e for e in matching), (word, matching)
