"""The store's per-layer steps on shared layer buffers, on a real local host pool: two requests' prefix
hits in one step land in the right blocks of a layer's buffer, and a layer whose buffer another layer
overwrote gets its earlier blocks back (hits and what it wrote itself) before it writes again."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.local import LocalHostPool
from kvoffload_vllm.layout import CacheLayout
from kvoffload_vllm.plan import Transfer
from kvoffload_vllm.shared_buffers import plan_of, requested_in
from kvoffload_vllm.shared_steps import SharedSteps, StepBlocks
from kvoffload_vllm.stats import Counters

NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))
BS, NUM_BLOCKS = 4, 8
LAYOUT = CacheLayout(NAMES, NUM_BLOCKS, BS, (BS, 8), torch.float32)
KEYS = [b"k0", b"k1", b"k2"]


def transfer_config() -> dict:
    extra = {"backend": "kvoffload", "use_layerwise": True, "metastore": "h:1", "layerwise_num_shared_buffers": 1}
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra}


@pytest.fixture
def pool():
    geometry = PoolGeometry(1, (LAYOUT.block_bytes,) * len(NAMES), 16)  # one row per plane: the page
    pool = LocalHostPool.create(f"kvoffload-test-{uuid.uuid4().hex[:8]}", geometry)
    pool.alloc(KEYS)
    for plane in range(len(NAMES)):  # block i of plane p holds 100 p + i everywhere
        blocks = torch.stack([torch.full((BS, 8), 100.0 * plane + i) for i in range(len(KEYS))])
        pool.put_from(KEYS, plane, blocks.view(torch.uint8).view(len(KEYS), 1, -1))
    yield pool
    pool.close()


def run_step(steps: SharedSteps, pool, caches: dict[str, torch.Tensor], written: dict[str, float]) -> None:
    """One forward: each layer prepared, then its attention writes ``written[layer]`` into the blocks
    the step writes, then its host copy is queued."""
    futures = []
    for layer in NAMES:
        steps.before_attention(layer, pool)
        meta = steps._metadata()
        for r in meta.steps:
            _, write = r.positions(BS)
            ids = list(r.block_ids[write.start : write.stop])
            caches[layer][ids] = written[layer]
        futures += steps.after_attention(layer)
    for f in futures:
        f.result()
    steps.end_step()


def test_hits_of_two_requests_and_the_blocks_a_reused_buffer_lost_come_back(pool):
    shared = plan_of(requested_in(transfer_config()), NAMES, BS, BS * 8 * 4, torch.float32)
    assert shared is not None and shared.plan.slots == ((0,), (1, 2))
    slot0, slot1 = torch.zeros(NUM_BLOCKS, BS, 8), torch.zeros(NUM_BLOCKS, BS, 8)
    caches = {NAMES[0]: slot0, NAMES[1]: slot1, NAMES[2]: slot1}  # layers 1 and 2 share a buffer
    errors: list[list[int]] = []
    meta = SimpleNamespace(
        loads=[Transfer("r1", (KEYS[0], KEYS[1]), (2, 3), 0), Transfer("r2", (KEYS[2],), (5,), 0)],
        steps=[StepBlocks("r1", (2, 3, 4), 2 * BS, 3), StepBlocks("r2", (5, 6), BS, 2)],
        host_copies=None,
    )
    holder = {"meta": meta}
    counters = Counters(["blocks_loaded", "bytes_loaded"])
    steps = SharedSteps(shared, LAYOUT, caches, ThreadPoolExecutor(1), errors.append, lambda: holder["meta"], counters)
    steps.before_attention(NAMES[1], pool)
    assert [caches[NAMES[1]][b, 0, 0].item() for b in (2, 3, 5)] == [100.0, 101.0, 102.0]  # plane 1's hits
    holder["meta"] = SimpleNamespace(loads=meta.loads, steps=meta.steps, host_copies=None)  # that step over, whole
    run_step(steps, pool, caches, {NAMES[0]: 1000.0, NAMES[1]: 1001.0, NAMES[2]: 1002.0})
    assert errors == []
    # the hits: 3 blocks, loaded into the 3 layers of the whole step and into layers 0 and 1 before it
    # (the loader prepares the layers in forward order: layer 0 first)
    assert counters.take() == {"blocks_loaded": 3, "bytes_loaded": 5 * 3 * LAYOUT.block_bytes}
    assert caches[NAMES[1]][2, 0, 0].item() == 200.0  # layer 2 (plane 2, key k0) was the last occupant
    # the next step: layer 1 first gets back its hits and the block it wrote, over layer 2's
    holder["meta"] = SimpleNamespace(loads=[], steps=[StepBlocks("r1", (2, 3, 4), 2 * BS + 3, 1)], host_copies=None)
    steps.before_attention(NAMES[1], pool)
    assert [caches[NAMES[1]][b, 0, 0].item() for b in (2, 3, 4)] == [100.0, 101.0, 1001.0]
    assert caches[NAMES[0]][2, 0, 0].item() == 0.0  # layer 0 keeps its own buffer: nothing reloaded there
    assert errors == []
