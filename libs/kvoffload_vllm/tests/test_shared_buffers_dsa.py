"""Shared layer buffers on the KV cache configs vLLM 0.32.0 builds for DSA models (``dsa_configs``:
the models built from a config.json on the meta device, no weights).

DeepSeek-V3.2 with its MTP layer (4 layers + 1): one KV cache group whose layers each hold a latent
cache (``...self_attn.attn``, 64 tokens x 576 bf16 values) and an indexer key cache
(``...self_attn.indexer.k_cache``, 64 x 132 bytes). The plan gives each buffer one main and one
indexer descriptor, the seed's plan line counts both, the MTP layer shares a buffer like any other
layer (or stays alone when ``layerwise_independent_layers`` names it, -1), and vLLM's own sizing and
allocation, through the plugin's wrapper, lay every cache on its buffer's descriptor. DeepSeek-V4's
five groups are refused naming them."""

from __future__ import annotations

import pytest
import torch
from dsa_configs import V4, V32, build
from structlog.testing import capture_logs
from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
from vllm.v1.worker.utils import allocate_kv_cache

from kvcore.config.errors import ConfigError
from kvoffload_vllm import kv_cache_patch
from kvoffload_vllm.block_bytes import block_bytes
from kvoffload_vllm.kv_groups import kv_groups
from kvoffload_vllm.shared_buffers import check_caches, group_plan, requested_in

MAIN_PAGE = 64 * 576 * 2  # a 64-token block of the bf16 latent (kv_lora_rank 512 + rope 64)
INDEXER_PAGE = 64 * 132  # 128 fp8 key bytes + a 4-byte scale a token
BUDGET = 64 << 20


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def indexer(i: int) -> str:
    return f"model.layers.{i}.self_attn.indexer.k_cache"


def store(**extra) -> dict:
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"backend": "kvoffload", "use_layerwise": True, "metastore": "h:1", **extra},
    }


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    return build(tmp_path_factory.mktemp("v32"), V32, mtp=True, block_size=64, max_model_len=1024)


def plan(built, **extra):
    config = built.kv_cache_config(BUDGET)
    return group_plan(requested_in(store(**extra)), kv_groups(config.kv_cache_groups, "AscendStoreConnector"))


def test_vllm_gives_a_v32_model_one_group_of_latent_and_indexer_caches_mtp_layer_last(v32):
    (group,) = v32.kv_cache_config(BUDGET).kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs) and group.kv_cache_spec.block_size == 64
    assert sorted(group.layer_names) == sorted([attn(i) for i in range(5)] + [indexer(i) for i in range(5)])
    specs = group.kv_cache_spec.kv_cache_specs
    assert {specs[attn(i)].page_size_bytes for i in range(5)} == {MAIN_PAGE}
    assert {(specs[indexer(i)].page_size_bytes, specs[indexer(i)].cache_role) for i in range(5)} == {
        (INDEXER_PAGE, "indexer")
    }


def test_each_buffer_is_one_main_and_one_indexer_descriptor_and_the_mtp_layer_shares_one(v32):
    shared = plan(v32, layerwise_num_shared_buffers=2)
    assert shared.layer_names == tuple(attn(i) for i in range(5))  # the MTP layer is physical layer 4
    assert shared.plan.slots == ((0,), (1, 3), (2, 4))
    kinds = [(d.slot, d.kind, d.spec.row_bytes) for d in shared.plan.descriptors]
    assert kinds == [(s, k, b) for s in range(3) for k, b in (("main", 1152), ("indexer", 132))]
    assert shared.plan.log_line() == (
        "Layerwise KV cache reuse merged 10 descriptors into 6 descriptors using 3 buffer assignments."
    )
    assert shared.caches(attn(4)) == (attn(4), indexer(4))
    assert shared.previous_occupant[attn(4)] == attn(2) and shared.previous_occupant[attn(2)] == attn(4)
    assert shared.viewers == {
        attn(0): (attn(0),),
        indexer(0): (indexer(0),),
        attn(1): (attn(1), attn(3)),
        indexer(1): (indexer(1), indexer(3)),
        attn(2): (attn(2), attn(4)),
        indexer(2): (indexer(2), indexer(4)),
    }
    alone = plan(v32, layerwise_num_shared_buffers=2, layerwise_independent_layers=[-1])  # -1: the MTP layer
    assert alone.plan.slots == ((0, 2), (1, 3), (4,))
    assert plan(v32, layerwise_num_shared_buffers=2, layerwise_independent_layers="all") is None


# layout -> (blocks of a plain cache, of 3 buffers, bytes of a block of the 3): vLLM resolves LBNHC here
# (every cache a region of its own); a block-outer layout rounds a block up to the latent's 32-token
# kernel blocks (36,864 bytes)
LAYOUTS = {
    "LBNHC": (BUDGET // (5 * 82176), BUDGET // (3 * 82176), 3 * 82176),
    "BLHNC": (BUDGET // (12 * 36864), BUDGET // (7 * 36864), 7 * 36864),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_vllm_sizes_and_lays_out_the_v32_cache_for_the_buffers(tmp_path, v32, layout):
    built = v32 if layout == v32.vllm_config.cache_config.kv_cache_layout else None
    built = built or build(tmp_path, V32, mtp=True, block_size=64, max_model_len=1024, layout=layout)
    assert kv_cache_patch.install()
    plain = built.kv_cache_config(BUDGET)
    with capture_logs() as logs:
        config = built.kv_cache_config(BUDGET, store(layerwise_num_shared_buffers=2))
    lines = [e["event"] for e in logs]
    assert "Layerwise KV cache reuse merged 10 descriptors into 6 descriptors using 3 buffer assignments." in lines
    plain_blocks, blocks, block = LAYOUTS[layout]
    assert (plain.num_blocks, config.num_blocks) == (plain_blocks, blocks)
    assert config.kv_cache_groups == plain.kv_cache_groups  # the scheduler's groups: every cache
    vllm_layout = built.vllm_config.cache_config.get_resolved_kv_cache_layout()
    caches = allocate_kv_cache(config, torch.device("cpu"), vllm_layout)
    assert {tuple(t.shape)[0] for t in caches.values()} == {config.num_blocks} and len(caches) == 10
    shared = plan(built, layerwise_num_shared_buffers=2)
    check_caches(shared, caches)
    pages = {n: block_bytes(t, n) for n, t in caches.items()}
    for head, names in shared.viewers.items():
        pages[head][7].fill_(len(names) + 10 * names[0].count("indexer"))
        assert all(torch.equal(pages[n][7], pages[head][7]) for n in names)  # one buffer's bytes
    for i in range(5):  # no two descriptors overlap: each kept its own value
        assert pages[attn(i)][7].unique().tolist() == [1 if i == 0 else 2]
        assert pages[indexer(i)][7].unique().tolist() == [11 if i == 0 else 12]
    storage = next(iter(caches.values())).untyped_storage().nbytes()
    assert storage == blocks * block
    with pytest.raises(ConfigError, match="should share one KV buffer"):
        check_caches(shared, allocate_kv_cache(plain, torch.device("cpu"), vllm_layout))


def test_layers_without_an_indexer_share_a_buffer_whose_indexer_descriptor_is_their_peers(tmp_path):
    """vLLM's IndexCache (``index_topk_freq`` 2): layer 2 reuses layer 1's top-k and holds no indexer
    cache; its buffer's indexer descriptor is the MTP layer's, which always has one."""
    built = build(tmp_path, {**V32, "index_topk_freq": 2}, mtp=True, block_size=64, max_model_len=1024)
    shared = plan(built, layerwise_num_shared_buffers=2)
    assert shared.caches(attn(2)) == (attn(2),) and shared.caches(attn(4)) == (attn(4), indexer(4))
    assert shared.viewers[attn(2)] == (attn(2), attn(4)) and shared.viewers[indexer(4)] == (indexer(4),)
    assert shared.plan.log_line() == (
        "Layerwise KV cache reuse merged 9 descriptors into 6 descriptors using 3 buffer assignments."
    )
    kv_cache_patch.install()
    config = built.kv_cache_config(BUDGET, store(layerwise_num_shared_buffers=2))
    caches = allocate_kv_cache(
        config, torch.device("cpu"), built.vllm_config.cache_config.get_resolved_kv_cache_layout()
    )
    check_caches(shared, caches)


def test_deepseek_v4s_five_groups_are_refused_naming_them(tmp_path):
    built = build(tmp_path, V4, max_model_len=1024)
    groups = built.kv_cache_config(1 << 27).kv_cache_groups
    assert [g.kv_cache_spec.block_size for g in groups] == [64, 64, 256, 4, 8]  # the spec file's table
    kv_cache_patch.install()
    with pytest.raises(ConfigError, match=r"this model has 5 group\(s\) \(block sizes \[64, 64, 256, 4, 8\]"):
        built.kv_cache_config(1 << 27, store(layerwise_num_shared_buffers=1))
