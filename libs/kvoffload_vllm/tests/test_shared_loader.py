"""Reloads on shared layer buffers overlap the forward (``kvoffload_vllm.shared_loader``): a loader
thread reloads layer L+1 while layer L computes, never more than ``layerwise_prefetch_layers``
layers ahead; a reload into a buffer whose previous occupant is still held (a pull, a save) waits at
the reuse gate; a loader's failure reaches the forward; the store's ``wait_for_save`` no longer waits
for the host copies (the gate orders the next reload after them). Orderings are observed with events
(a grace period only where a thing must *not* happen)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from kvoffload_vllm.layout import CacheLayout
from kvoffload_vllm.reuse_gate import GATE, ReuseTimeout
from kvoffload_vllm.shared_buffers import plan_of, requested_in
from kvoffload_vllm.shared_loader import LayerLoader
from kvoffload_vllm.shared_steps import SharedSteps, StepBlocks
from kvoffload_vllm.stats import Counters

NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(5))
BS, NUM_BLOCKS = 4, 8
LAYOUT = CacheLayout(NAMES, NUM_BLOCKS, BS, (BS, 8), torch.float32)
WAIT_S = 10.0  # an event that must happen: far beyond its real time
GRACE_S = 0.2  # a thing that must not happen is given this long to happen


def transfer_config() -> dict:
    extra = {"backend": "kvoffload", "use_layerwise": True, "metastore": "h:1", "layerwise_num_shared_buffers": 2}
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra}


class Model:
    """5 layers: layer 0 on its own buffer, layers 1 and 3 on one, 2 and 4 on another; one request
    whose first step wrote blocks 0 and 1 of every layer (layer i: ``10 i + 1``), then steps of one
    token in block 2. ``prepared[layer]`` is set once the loader prepared the layer, ``began[layer]``
    when it began to."""

    def __init__(self, depth: int, saver: ThreadPoolExecutor | None = None) -> None:
        self.shared = plan_of(requested_in(transfer_config()), NAMES, BS, BS * 8 * 4, torch.float32)
        assert self.shared is not None and self.shared.plan.slots == ((0,), (1, 3), (2, 4))
        a, b = torch.zeros(NUM_BLOCKS, BS, 8), torch.zeros(NUM_BLOCKS, BS, 8)
        self.caches = {NAMES[0]: torch.zeros(NUM_BLOCKS, BS, 8), NAMES[1]: a, NAMES[3]: a, NAMES[2]: b, NAMES[4]: b}
        self.holder: dict = {"meta": None}
        self.errors: list[list[int]] = []
        self.saver = saver or ThreadPoolExecutor(1)
        self.steps = SharedSteps(
            self.shared,
            LAYOUT,
            self.caches,
            self.saver,
            self.errors.append,
            lambda: self.holder["meta"],
            Counters(["blocks_loaded", "bytes_loaded"]),
            depth=depth,
        )
        self.began = {n: threading.Event() for n in NAMES}
        self.prepared = {n: threading.Event() for n in NAMES}
        prepare = self.steps._prepare

        def observed(step, layer, pool):
            self.began[layer].set()
            prepare(step, layer, pool)
            self.prepared[layer].set()

        self.steps._prepare = observed
        self.forward(StepBlocks("r", (0, 1), 0, 2 * BS), lambda layer: None)  # blocks 0 and 1 of every layer
        for event in (*self.began.values(), *self.prepared.values()):
            event.clear()

    def forward(self, request: StepBlocks, compute) -> None:
        """One step: per layer ``before_attention``, then ``compute(layer)``, its write, its host copy."""
        self.holder["meta"] = SimpleNamespace(loads=[], steps=[request], host_copies=None)
        futures = []
        for i, layer in enumerate(NAMES):
            self.steps.before_attention(layer, None)
            compute(layer)
            _, written = request.positions(BS)
            self.caches[layer][list(request.block_ids[written.start : written.stop])] = 10.0 * i + 1
            futures += self.steps.after_attention(layer)
        for f in futures:
            f.result()
        self.steps.end_step()

    def block0(self, layer: str) -> float:
        return self.caches[layer][0, 0, 0].item()


NEXT = StepBlocks("r", (0, 1, 2), 2 * BS, 1)


def test_the_loader_reloads_the_next_layer_while_a_layer_computes():
    model = Model(depth=2)
    seen: dict[str, bool] = {}

    def compute(layer: str) -> None:
        if layer == NAMES[2]:  # layer 3 shares layer 1's buffer: its reload runs while layer 2 computes
            seen["layer 3 reloaded during layer 2"] = model.prepared[NAMES[3]].wait(WAIT_S)
        if layer == NAMES[0]:  # layer 1's buffer held layer 3: layer 1's blocks are back before it runs
            seen["layer 1 reloaded during layer 0"] = model.prepared[NAMES[1]].wait(WAIT_S)

    model.forward(NEXT, compute)
    assert seen == {"layer 3 reloaded during layer 2": True, "layer 1 reloaded during layer 0": True}
    assert model.errors == []
    assert model.block0(NAMES[4]) == 41.0  # every layer got its own blocks back: the last occupant's here


def test_the_loader_runs_at_most_p_layers_ahead():
    layers = [f"l{i}" for i in range(6)]
    ahead: list[int] = []
    at = {"layer": 0}
    went_to = {n: threading.Event() for n in layers}

    def prepare(layer: str) -> None:
        ahead.append(int(layer[1:]) - at["layer"])
        went_to[layer].set()

    loader = LayerLoader(layers, {}, 2, prepare).start()
    loader.wait("l0")
    assert went_to["l2"].wait(WAIT_S)  # layers 1 and 2 while layer 0 computes
    went_to["l3"].wait(GRACE_S)  # an unbounded loader would take layer 3 now
    assert ahead == [0, 1, 2], ahead
    for i, layer in enumerate(layers[1:], 1):
        at["layer"] = i
        loader.wait(layer)
    loader.close()
    assert max(ahead) == 2 and len(ahead) == 6, ahead


def test_a_reload_into_a_buffer_waits_for_its_previous_occupant_at_the_gate():
    model = Model(depth=2)
    seen: dict[str, object] = {}

    def compute(layer: str) -> None:
        if layer == NAMES[1]:  # a decode's pull reads layer 1's blocks from the buffer layer 3 reuses
            GATE.hold(NAMES[1], "pull", 30.0)
        if layer == NAMES[2]:
            seen["began"] = model.began[NAMES[3]].wait(WAIT_S)  # layer 3 may start: layer 1 is behind
            seen["reloaded while held"] = model.prepared[NAMES[3]].wait(GRACE_S)
            seen["layer 1 still there"] = model.block0(NAMES[1])
            GATE.release(NAMES[1], "pull")

    model.forward(NEXT, compute)
    assert seen == {"began": True, "reloaded while held": False, "layer 1 still there": 11.0}
    assert model.errors == []


def test_one_buffer_per_layer_pair_is_never_prefetched_past_the_occupant_that_computes():
    """Layer 3's previous occupant is layer 1: however deep p, layer 3 starts only once layer 1 is
    behind the forward (here: while layer 1 computes, it has not begun)."""
    model = Model(depth=8)
    seen: dict[str, bool] = {}

    def compute(layer: str) -> None:
        if layer == NAMES[1]:
            seen["layer 2 began"] = model.prepared[NAMES[2]].wait(WAIT_S)  # its occupant, layer 4, is the last step's
            seen["layer 3 began"] = model.began[NAMES[3]].wait(GRACE_S)

    model.forward(NEXT, compute)
    assert seen == {"layer 2 began": True, "layer 3 began": False}


def test_a_gate_past_its_bound_on_the_loader_fails_the_forward(monkeypatch):
    model = Model(depth=2)
    monkeypatch.setattr("kvoffload_vllm.reuse_gate.GRACE_S", 0.0)

    def compute(layer: str) -> None:
        if layer == NAMES[1]:
            GATE.hold(NAMES[1], "pull", 0.05)  # never released: a stuck pull

    try:
        with pytest.raises(ReuseTimeout, match="model.layers.1"):
            model.forward(NEXT, compute)
    finally:
        GATE.release(NAMES[1], "pull")
        model.steps.end_step()


def test_wait_for_save_does_not_wait_for_the_host_copies():
    from kvoffload_vllm.store import AscendStoreConnector, StoreStepMetadata

    blocker = threading.Event()
    saver = ThreadPoolExecutor(1)
    model = Model(depth=2, saver=saver)
    connector = object.__new__(AscendStoreConnector)  # the worker side's state, without a vLLM
    connector.__dict__.update(
        _shared_steps=model.steps,
        _shared=model.shared,
        _pools=[],
        _host_saves=[],
        _save_futures=[],
        _step_saves=None,
        _handoffs=[],
        _saved_at={},
        _counters=Counters(["blocks_saved"]),
    )
    meta = StoreStepMetadata(steps=[NEXT])
    connector._connector_metadata = model.holder["meta"] = meta
    saver.submit(blocker.wait, WAIT_S)  # the saver is busy: the step's host copies queue behind
    for layer in NAMES:
        model.steps.before_attention(layer, None)
        connector.save_kv_layer(layer, torch.empty(0), None)
    done = threading.Thread(target=connector.wait_for_save, daemon=True)
    done.start()
    done.join(WAIT_S / 2)
    returned = not done.is_alive()
    blocker.set()
    assert returned, "wait_for_save waited for host copies nothing needed yet"
    # the next step's reload of layer 1 waits at the gate for those copies, and finds them
    model.forward(NEXT, lambda layer: None)
    assert model.errors == [] and model.block0(NAMES[3]) == 31.0
