"""vLLM's KV cache groups as the connectors take them (vLLM's own spec classes): a hybrid model's
full-attention and sliding-window groups each with its block size and layers, a DeepSeek-V4-style
group that mixes layer specs, hits whole in every group, and a Mamba state group refused by name."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvcore.config.errors import ConfigError
from kvoffload_vllm.kv_groups import hit_unit, kv_groups, skip_null

FULL = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32)
SWA = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)


def config(*groups: KVCacheGroupSpec) -> list[KVCacheGroupSpec]:
    """The groups as a ``KVCacheConfig`` holds them."""
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=list(groups)).kv_cache_groups


def test_a_hybrid_models_groups_keep_their_layers_block_sizes_and_specs():
    groups = kv_groups(
        config(KVCacheGroupSpec(["l.0", "l.2"], FULL), KVCacheGroupSpec(["l.1", "l.3"], SWA)), "AscendStoreConnector"
    )
    assert [(g.index, g.layer_names, g.block_size) for g in groups] == [
        (0, ("l.0", "l.2"), 128),
        (1, ("l.1", "l.3"), 128),
    ]
    assert groups[1].specs == (SWA, SWA)
    assert hit_unit(groups) == 128


def test_a_group_mixing_layer_specs_gives_each_layer_its_own_and_hits_are_whole_in_every_group():
    small = FullAttentionSpec(block_size=256, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    big = FullAttentionSpec(block_size=256, num_kv_heads=1, head_size=584, dtype=torch.uint8)
    mixed = UniformTypeKVCacheSpecs(block_size=256, kv_cache_specs={"idx.1": small, "attn.1": big})
    swa = SlidingWindowSpec(block_size=64, num_kv_heads=1, head_size=584, dtype=torch.uint8, sliding_window=128)
    groups = kv_groups(
        config(KVCacheGroupSpec(["swa.0"], swa), KVCacheGroupSpec(["idx.1", "attn.1"], mixed)), "AscendStoreConnector"
    )
    assert groups[1].specs == (small, big) and groups[1].block_size == 256
    assert hit_unit(groups) == 256


def test_a_state_group_is_refused_naming_the_connector_the_group_and_the_layer():
    mamba = MambaSpec(block_size=128, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ConfigError) as e:
        kv_groups(config(KVCacheGroupSpec(["l.0"], FULL), KVCacheGroupSpec(["m.1"], mamba)), "SfaRemoteD2HConnector")
    assert "SfaRemoteD2HConnector: saves attention KV caches only; KV cache group 1 holds {'m.1': 'MambaSpec'}" in str(
        e.value
    )


def test_only_the_leading_null_blocks_of_a_sliding_window_are_skipped():
    assert skip_null([0, 0, 5, 6]) == 2 and skip_null([3, 4]) == 0 and skip_null([0, 0]) == 2 and skip_null([]) == 0
