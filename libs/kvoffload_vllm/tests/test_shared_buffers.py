"""Shared layer buffers inside vLLM: the plan from a kv_transfer_config, vLLM's KV cache config
sized and laid out for it (vLLM's own ``get_kv_cache_config_from_groups`` and ``allocate_kv_cache``
run through the plugin's wrapper), the version check, the reuse gate and the host copies."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from structlog.testing import capture_logs
from vllm.config.cache import _layout_from_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, UniformTypeKVCacheSpecs
from vllm.v1.worker.utils import allocate_kv_cache

from kvcore.config.errors import ConfigError
from kvoffload_vllm import kv_cache_patch, reuse_gate
from kvoffload_vllm.kv_groups import kv_groups
from kvoffload_vllm.request_kv import RequestKV
from kvoffload_vllm.reuse_gate import ReuseGate, ReuseTimeout
from kvoffload_vllm.shared_buffers import (
    SUPPORTED_VLLM,
    check_caches,
    check_eager,
    check_vllm_version,
    group_plan,
    plan_of,
    requested_in,
)
from kvoffload_vllm.shared_steps import StepBlocks

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)


def transfer_config(role: str = "kv_producer", **extra) -> dict:
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"backend": "kvoffload", "use_layerwise": True, "metastore": "h:1", **extra},
    }


def vllm_config(kv: dict, prefix_caching: bool = True) -> SimpleNamespace:
    """The fields of a VllmConfig that vLLM's KV cache sizing and the plugin read."""
    layout = _layout_from_name("LBHNC")
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(**kv),
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None,
            enable_prefix_caching=prefix_caching,
        ),
    )


def test_the_plan_follows_the_seed_keys_and_only_a_producer_with_shared_buffers_gets_one():
    shared = plan_of(
        requested_in(transfer_config(layerwise_num_shared_buffers=2)),
        LAYERS[::-1],
        16,
        SPEC.page_size_bytes,
        SPEC.dtype,
    )
    assert shared is not None and shared.plan.slots == ((0,), (1, 3, 5), (2, 4))
    assert shared.previous_occupant[LAYERS[3]] == LAYERS[1]
    assert shared.previous_occupant[LAYERS[1]] == LAYERS[5]  # the slot's last layer, of the previous step
    assert not shared.is_shared(LAYERS[0])  # independent (the default [0])
    assert plan_of(requested_in(transfer_config()), LAYERS, 16, SPEC.page_size_bytes, SPEC.dtype) is None
    assert (
        plan_of(requested_in(transfer_config("kv_both", layerwise_num_shared_buffers=2)), LAYERS, 16, 1024, SPEC.dtype)
        is None
    )
    every = transfer_config(layerwise_num_shared_buffers=2, layerwise_independent_layers="all")
    assert plan_of(requested_in(every), LAYERS, 16, SPEC.page_size_bytes, SPEC.dtype) is None  # nothing to share


def test_another_projects_connector_config_is_not_read_by_the_plugin():
    """The plugin's sizing runs in every vLLM process: a config of vLLM's own connectors (or of a
    MultiConnector's other children) is theirs, never refused by our config rules."""
    foreign = {"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"x": 1}}
    assert requested_in(foreign) is None
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": [foreign]},
    }
    assert requested_in(multi) is None
    ours = transfer_config(layerwise_num_shared_buffers=2)
    multi["kv_connector_extra_config"]["connectors"] = [foreign, ours]
    assert requested_in(multi) == requested_in(ours) == (2, (0,))


def test_another_vllm_version_and_graph_mode_are_refused_naming_why():
    check_vllm_version(SUPPORTED_VLLM)
    with pytest.raises(ConfigError, match=r"built for vLLM 0\.32\.0; this is vLLM 0\.33\.1"):
        check_vllm_version("0.33.1")
    check_eager(True)
    with pytest.raises(ConfigError, match=r"need vLLM's eager mode \(--enforce-eager\)"):
        check_eager(False)


def test_vllm_sizes_the_cache_for_the_buffers_and_every_layer_views_its_buffer():
    assert kv_cache_patch.install()
    assert kv_cache_patch.install()  # idempotent
    groups = [KVCacheGroupSpec(list(LAYERS), SPEC)]
    budget = 100 * SPEC.page_size_bytes * len(LAYERS)  # 100 blocks of every layer
    plain = kv_cache_utils.get_kv_cache_config_from_groups(vllm_config(transfer_config()), groups, budget)
    cfg = vllm_config(transfer_config(layerwise_num_shared_buffers=2))
    shared = kv_cache_utils.get_kv_cache_config_from_groups(cfg, groups, budget)
    assert plain.num_blocks == 100 and shared.num_blocks == 200  # 6 layers on 3 buffers
    assert cfg.cache_config.enable_prefix_caching is False
    assert kv_cache_utils._pool_bytes_per_block(cfg, groups) == 3 * SPEC.page_size_bytes
    assert shared.kv_cache_groups[0].layer_names == LAYERS
    caches = allocate_kv_cache(shared, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout())
    assert {n: tuple(t.shape)[0] for n, t in caches.items()} == dict.fromkeys(LAYERS, 200)
    ptr = [caches[n].data_ptr() for n in LAYERS]
    assert ptr[1] == ptr[3] == ptr[5] and ptr[2] == ptr[4] and len({ptr[0], ptr[1], ptr[2]}) == 3
    assert next(iter(caches.values())).untyped_storage().nbytes() == 3 * 200 * SPEC.page_size_bytes
    plan = plan_of(
        requested_in(transfer_config(layerwise_num_shared_buffers=2)), LAYERS, 16, SPEC.page_size_bytes, SPEC.dtype
    )
    assert plan is not None
    check_caches(plan, caches)
    apart = allocate_kv_cache(plain, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout())
    with pytest.raises(ConfigError, match="should share one KV buffer"):
        check_caches(plan, apart)


def test_a_multi_group_cache_is_refused_for_shared_buffers():
    kv_cache_patch.install()
    groups = [KVCacheGroupSpec(LAYERS[:3], SPEC), KVCacheGroupSpec(LAYERS[3:], SPEC)]
    with pytest.raises(ConfigError, match="one attention KV cache group"):
        kv_cache_utils.get_kv_cache_config_from_groups(
            vllm_config(transfer_config(layerwise_num_shared_buffers=2)), groups, 10**6
        )


def test_one_group_whose_layers_differ_in_spec_is_refused_for_shared_buffers():
    """A buffer holds any layer of its bucket: a group mixing cache specs (DeepSeek-V4's indexer and
    latent caches in one group) has no one page size to plan with."""
    small = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    mixed = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={LAYERS[0]: small, LAYERS[1]: SPEC})
    asked = requested_in(transfer_config(layerwise_num_shared_buffers=1))
    with pytest.raises(ConfigError, match="one attention KV cache group of one cache spec"):
        group_plan(asked, kv_groups([KVCacheGroupSpec(LAYERS[:2], mixed)], "AscendStoreConnector"))
    with pytest.raises(ConfigError, match="this model has 0 group"):  # no attention cache at all
        group_plan(asked, ())
    one = kv_groups([KVCacheGroupSpec(LAYERS, SPEC)], "AscendStoreConnector")
    assert group_plan(asked, one) == plan_of(asked, LAYERS, 16, SPEC.page_size_bytes, SPEC.dtype)


def test_the_gate_waits_for_every_holder_and_fails_loudly_past_their_deadline(monkeypatch):
    gate = ReuseGate()
    gate.hold("a", "save", 10)
    gate.hold("a", "pull", 10)
    threading.Timer(0.1, gate.release, ("a", "save")).start()
    threading.Timer(0.3, gate.release, ("a", "pull")).start()
    with capture_logs() as logs:
        assert 0.25 < gate.wait_free("a", waiter="b") < 5
    held = [e for e in logs if e["event"] == "kvoffload_shared_gate_held"]
    assert len(held) == 1 and held[0]["waiter"] == "b" and held[0]["layer"] == "a", logs  # once, while it waited
    assert held[0]["holders"] in ({"pull": 1}, {"save": 1, "pull": 1})
    assert gate.held("a") == {}
    with pytest.raises(ValueError, match="not held"):
        gate.release("a", "pull")
    monkeypatch.setattr(reuse_gate, "GRACE_S", 0.1)
    gate.hold("a", "pull", 0.1)
    t0 = time.monotonic()
    with pytest.raises(ReuseTimeout, match=r"'a' is still held by \{'pull': 1\}"):
        gate.wait_free("a", waiter="b")
    assert time.monotonic() - t0 < 2


def test_host_copies_grow_keep_their_blocks_and_refuse_what_was_never_saved():
    kv = RequestKV(["x", "y"], 4)
    kv.reserve("r", 1)
    kv.put("r", "y", range(0, 1), torch.full((1, 4), 7, dtype=torch.uint8))
    kv.reserve("r", 5)
    kv.put("r", "y", range(3, 5), torch.full((2, 4), 9, dtype=torch.uint8))
    assert kv.get("r", "y", range(0, 1)).tolist() == [[7] * 4]
    assert kv.get("r", "y", range(3, 5)).tolist() == [[9] * 4] * 2
    with pytest.raises(KeyError, match="not reserved"):
        kv.get("r", "y", range(0, 99))
    kv.drop(["r"])
    assert "r" not in kv and kv.nbytes() == 0


@pytest.mark.parametrize(
    ("computed", "scheduled", "blocks", "reload", "write"),
    [
        (0, 100, 7, range(0, 0), range(0, 7)),  # a first chunk: nothing to reload
        (100, 1, 7, range(0, 7), range(6, 7)),  # a decode step: the partial block comes back too
        (112, 16, 8, range(0, 7), range(7, 8)),  # a chunk that starts on a block boundary
    ],
)
def test_a_step_reloads_every_block_computed_before_it_and_writes_the_blocks_it_touches(
    computed, scheduled, blocks, reload, write
):
    assert StepBlocks("r", tuple(range(blocks)), computed, scheduled).positions(16) == (reload, write)
