"""The store's per-layer steps on the shared buffers of a DSA model: vLLM 0.32.0's own KV cache config
and allocation for DeepSeek-V3.2 with its MTP layer (``dsa_configs``; the plugin's wrapper lays
layers 1-4 on one buffer), a real local host pool whose planes are the group's ten caches.

Each layer's indexer runs before its attention writes (vLLM's DSA layer) and reads its keys from the
buffer: the hook before the indexer's forward must have put back both of the layer's caches — the
prefix hit from the pool's planes of that layer, the blocks it wrote in the step before — over what
the buffer's other layers left there; what a layer writes goes to its host copy, latent and indexer
side by side. A layer with an indexer cache and no indexer module to hook is refused."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from dsa_configs import V32, build
from vllm.v1.worker.utils import allocate_kv_cache

from kvcore.config.errors import ConfigError
from kvcore.pool.local import LocalHostPool
from kvoffload_vllm import kv_cache_patch
from kvoffload_vllm.group_caches import GroupCaches
from kvoffload_vllm.kv_groups import kv_groups
from kvoffload_vllm.layout import CacheLayout
from kvoffload_vllm.plan import Transfer
from kvoffload_vllm.shared_buffers import group_plan, requested_in
from kvoffload_vllm.shared_steps import SharedSteps, StepBlocks
from kvoffload_vllm.stats import Counters

BS = 64
KEY = b"hit-0"
STORE = {
    "kv_connector": "AscendStoreConnector",
    "kv_role": "kv_producer",
    "kv_connector_extra_config": {
        "backend": "kvoffload",
        "use_layerwise": True,
        "metastore": "h:1",
        "layerwise_num_shared_buffers": 1,
    },
}


class Indexer(torch.nn.Module):
    """What a DSA layer's indexer sees of its cache when its forward starts: blocks 3 and 4's first bytes."""

    def __init__(self, cache: torch.Tensor, main: torch.Tensor, seen: list) -> None:
        super().__init__()
        self.cache, self.main, self.seen = cache, main, seen

    def forward(self, layer: str) -> None:
        self.seen.append((layer, [(self.cache[b, 0].item(), self.main[b, 0].item()) for b in (3, 4)]))


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    """vLLM's caches of the shared-buffer config, its group, the plan, the caches as bytes."""
    kv_cache_patch.install()
    built = build(tmp_path_factory.mktemp("v32"), V32, mtp=True, block_size=BS, max_model_len=1024)
    config = built.kv_cache_config(8 << 20, STORE)
    caches = allocate_kv_cache(
        config, torch.device("cpu"), built.vllm_config.cache_config.get_resolved_kv_cache_layout()
    )
    (group,) = kv_groups(config.kv_cache_groups, "AscendStoreConnector")
    shared = group_plan(requested_in(STORE), (group,))
    assert shared is not None and shared.plan.slots == ((0,), (1, 2, 3, 4))
    return SimpleNamespace(config=config, caches=caches, group=group, shared=shared)


@pytest.fixture
def pool(dsa):
    """One object, key ``KEY``: plane p (the group's cache p) filled with p + 1."""
    pages = GroupCaches.of(dsa.group, dsa.caches, dsa.config.num_blocks)
    pool = LocalHostPool.create(f"kvoffload-test-{uuid.uuid4().hex[:8]}", pages.geometry(4))
    pool.alloc([KEY])
    for plane, width in enumerate(pages.page_bytes):
        pool.put_from([KEY], plane, torch.full((1, 1, width), plane + 1, dtype=torch.uint8))
    yield pool
    pool.close()


def steps_of(dsa, holder: dict, errors: list) -> tuple[SharedSteps, dict]:
    layers = list(dsa.shared.layer_names)
    layout = CacheLayout.of({n: dsa.caches[n] for n in layers}, layers, dsa.config.num_blocks, BS, BS * 1152)
    counters = Counters(["blocks_loaded", "bytes_loaded"])
    steps = SharedSteps(
        dsa.shared,
        layout,
        dict(dsa.caches),
        ThreadPoolExecutor(1),
        errors.extend,
        lambda: holder["meta"],
        counters,
        planes=dsa.group.layer_names,
    )
    return steps, {n: steps._bytes[n] for n in dsa.caches}


def forward(steps: SharedSteps, context: dict, pages: dict, value: int) -> None:
    """One step of the model: per layer its indexer (hooked), then its attention writes ``value + 10 i``
    (``+ 5`` in the indexer cache) into block 4, then the connector's save."""
    futures = []
    for i, layer in enumerate(steps.shared.layer_names):
        context[layer].indexer(layer)
        context[layer].impl.do_kv_cache_update()
        for cache in steps.shared.caches(layer):
            pages[cache][4].fill_(value + 10 * i + (5 if "indexer" in cache else 0))
        futures += steps.after_attention(layer)
    for f in futures:
        f.result()
    steps.end_step()


def test_a_layer_gets_back_both_caches_before_its_indexer_runs(dsa, pool):
    holder: dict = {"meta": None}
    errors: list = []
    steps, pages = steps_of(dsa, holder, errors)
    seen: list = []
    context = {
        layer: SimpleNamespace(
            impl=SimpleNamespace(do_kv_cache_update=lambda: None),
            indexer=Indexer(pages[caches[-1]], pages[layer], seen),
        )
        for layer in dsa.shared.layer_names
        for caches in [dsa.shared.caches(layer)]
    }
    steps.hook_layers(context, lambda: pool)
    plane = {n: i + 1 for i, n in enumerate(dsa.group.layer_names)}  # the pool's value of each cache
    # step 1: a 1-block prefix hit (block 3) and 10 new tokens (block 4)
    hit = Transfer("r1", (KEY,), (3,), 0)
    holder["meta"] = SimpleNamespace(loads=[hit], steps=[StepBlocks("r1", (3, 4), BS, 10)], host_copies=None)
    forward(steps, context, pages, 100)
    for layer, blocks in seen:
        main, indexer = dsa.shared.caches(layer)
        assert blocks[0] == (plane[indexer], plane[main]), layer  # the layer's own planes of the hit
    # step 2: one more token; layers 1-4 share a buffer that layer 4 wrote last
    seen.clear()
    holder["meta"] = SimpleNamespace(loads=[], steps=[StepBlocks("r1", (3, 4), BS + 10, 1)], host_copies=None)
    forward(steps, context, pages, 200)
    for i, (layer, blocks) in enumerate(seen):
        main, indexer = dsa.shared.caches(layer)
        assert blocks == [(plane[indexer], plane[main]), (105 + 10 * i, 100 + 10 * i)], layer
    assert errors == []


def test_a_layer_with_an_indexer_cache_and_no_indexer_module_is_refused(dsa):
    steps, _ = steps_of(dsa, {"meta": None}, [])
    context = {
        layer: SimpleNamespace(impl=SimpleNamespace(do_kv_cache_update=lambda: None))
        for layer in dsa.shared.layer_names
    }
    with pytest.raises(
        ConfigError, match=r"'model\.layers\.0\.self_attn\.attn' has an indexer cache .* no indexer module"
    ):
        steps.hook_layers(context, lambda: None)
