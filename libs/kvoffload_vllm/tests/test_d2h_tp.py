"""Tensor parallel P/D under vLLM, without vLLM: the producers of a TP 2 prefill's two ranks and the
consumers of a TP 1 or TP 2 decode in one process, over real gRPC on loopback, with the
metaserver stand-in of ``test_d2h_pull``.

- Head slices (a dense model: each prefill rank holds half the KV heads, the heads outermost in a
  block as vLLM's CPU cache keeps them): a TP 1 decode assembles every block from both ranks'
  halves, byte for byte, each rank serving its half once; a TP 2 decode's rank t takes prefill rank
  t's blocks whole.
- Copies (an MLA latent: every rank holds the same rows): each prefill rank announces its share of
  the step's blocks, the shares partition them, and no block crosses twice.
- Every decode rank registers rank 0's port and the TP size; a layout its rank cannot take (a head
  slice through a transfer engine, rows of neither size) is refused naming both sides.
"""

from __future__ import annotations

import pytest
import torch
from d2h_support import Metaserver, ended, free_port, settings, until

from kvoffload_vllm.d2h_consumer import Consumer
from kvoffload_vllm.d2h_layers import D2HLayers
from kvoffload_vllm.d2h_plan import Peer, Send
from kvoffload_vllm.d2h_step import D2HStepMetadata, Recv
from kvoffload_vllm.d2h_tp import Contribution, HeadSlice, announced_rows, contribution, head_slice
from kvoffload_vllm.kv_groups import KVGroup
from kvoffload_vllm.producer import Producer

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
GROUPS = (KVGroup(0, LAYERS, 4, ()),)
HEADS, NUM_BLOCKS = 2, 8


def test_each_prefill_rank_feeds_the_decode_rank_of_its_contributor_group():
    peer = Peer("r", ("10.0.0.2:20050", "10.0.0.2:20051"))
    assert contribution(peer, 3, 4, replicated=False) == Contribution("10.0.0.2:20051", 1, 2, False)
    assert contribution(peer, 0, 4, replicated=True) == Contribution("10.0.0.2:20050", 0, 2, True)
    assert contribution(Peer("r", ("h:7",)), 0, 1, replicated=True) == Contribution("h:7", 0, 1, False)
    with pytest.raises(ValueError, match="prefill tp 2, decode tp 4"):
        contribution(Peer("r", ("h:7", "h:8", "h:9", "h:10")), 0, 2, replicated=False)


def test_copies_split_a_steps_blocks_between_the_contributors_and_head_slices_send_every_row():
    copies = [Contribution("h:1", i, 2, True) for i in range(2)]
    assert [announced_rows(6, 30, 4, c) for c in copies] == [(6, 16), (16, 30)]  # blocks 1-3, 4-7
    assert [announced_rows(0, 3, 4, c) for c in copies] == [(0, 0), (0, 3)]  # one block: the second's
    assert announced_rows(6, 30, 4, Contribution("h:1", 1, 2, False)) == (6, 30)
    assert head_slice(96, 96, 2, 1, 1) == HeadSlice()
    assert head_slice(48, 96, 2, 1, 1) == HeadSlice(1, 2)
    assert "nor its 1/2 head slice" in head_slice(32, 96, 2, 1, 1)


def caches(seed: int | None, heads: int) -> dict[str, torch.Tensor]:
    """``LAYERS``' caches of ``NUM_BLOCKS`` blocks ``[heads, 4 rows, 6]`` (zeros without a seed)."""
    shape = (NUM_BLOCKS, heads, 4, 6)
    if seed is None:
        return {name: torch.zeros(shape) for name in LAYERS}
    torch.manual_seed(seed)
    return {name: torch.randn(shape) for name in LAYERS}


def layers(c: dict[str, torch.Tensor]) -> D2HLayers:
    return D2HLayers.of(GROUPS, c, NUM_BLOCKS)


class TPPair:
    """The producers of prefill ranks 0 and 1 (TP 2, over ``full``'s heads or copies of it) and the
    consumers of a decode of ``decode_tp`` ranks on consecutive ports."""

    def __init__(self, decode_tp: int, *, replicated: bool, backend: str = "kvoffload") -> None:
        torch.manual_seed(0)
        self.full = caches(0, HEADS)  # every head of every layer: what a TP 1 engine would hold
        self.meta = Metaserver()
        if replicated:
            shards = [self.full, self.full]
        else:
            shards = [{n: t[:, r : r + 1].clone() for n, t in self.full.items()} for r in range(2)]
        self.producers = [
            Producer(settings("kv_producer", backend, tp_rank=r, tp_size=2, kv_replicated=replicated), "m", layers(c))
            for r, c in enumerate(shards)
        ]
        base = free_port()
        heads = HEADS if replicated else HEADS // decode_tp
        self.decode = [caches(None, heads) for _ in range(decode_tp)]
        self.consumers = [
            Consumer(
                settings("kv_consumer", backend, base + t, tp_rank=t, tp_size=decode_tp, kv_heads=heads),
                "m",
                layers(c),
            )
            for t, c in enumerate(self.decode)
        ]
        self.peer = Peer("cmpl-1", tuple(c.endpoint for c in self.consumers))

    def run(self, num_tokens: int, chunks: tuple[tuple[int, int], ...], prefill_blocks, decode_blocks) -> None:
        for consumer in self.consumers:
            consumer.begin_step(
                D2HStepMetadata(recvs=[Recv("vllm-d", "cmpl-1", self.meta.url, None, num_tokens, 0, (decode_blocks,))])
            )
        until(lambda: len(self.meta.bodies) == len(self.consumers))
        for start, end in chunks:
            step = D2HStepMetadata(sends=[Send("vllm-p", self.peer, start, end, num_tokens, (prefill_blocks,))])
            for producer in self.producers:
                for name in LAYERS:
                    producer.layer_saved(name, step)
                producer.end_step()
        for consumer in self.consumers:
            assert ended(consumer) == ({"vllm-d"}, set())
        for producer in self.producers:
            assert until(lambda p=producer: p.finished({"vllm-p"})) == {"vllm-p"}

    def close(self) -> None:
        for side in (*self.producers, *self.consumers):
            side.close()
        self.meta.close()


@pytest.fixture
def tp_pairs():
    made: list[TPPair] = []
    yield lambda *a, **kw: made.append(TPPair(*a, **kw)) or made[-1]
    for p in made:
        p.close()


PREFILL_BLOCKS, DECODE_BLOCKS = (1, 2, 3), (5, 7, 6)
CHUNKS = ((0, 6), (6, 10))  # 10 tokens in blocks of 4, in two steps; block 1 written by both


def test_a_tp1_decode_assembles_every_block_from_both_prefill_ranks_head_slices(tp_pairs):
    pair = tp_pairs(1, replicated=False)
    pair.run(10, CHUNKS, PREFILL_BLOCKS, DECODE_BLOCKS)
    for name in LAYERS:
        got = pair.decode[0][name]
        assert torch.equal(got[list(DECODE_BLOCKS)], pair.full[name][list(PREFILL_BLOCKS)])
        assert not got[[0, 1, 2, 3, 4]].any()
    params = [b["kv_transfer_params"] for b in pair.meta.bodies]
    assert [(p["remote_port"], p["remote_tp_size"]) for p in params] == [(pair.consumers[0].settings.control_port, 1)]
    served = [p.take_counters()["bytes_served"] for p in pair.producers]
    assert served[0] == served[1] > 0  # each rank its half of the same blocks
    pulled = pair.consumers[0].take_counters()
    assert pulled["bytes_read"] == sum(served)


def test_a_tp2_decode_rank_takes_its_prefill_ranks_blocks_whole(tp_pairs):
    pair = tp_pairs(2, replicated=False)
    pair.run(10, CHUNKS, PREFILL_BLOCKS, DECODE_BLOCKS)
    for t in range(2):
        for name in LAYERS:
            assert torch.equal(
                pair.decode[t][name][list(DECODE_BLOCKS)], pair.full[name][list(PREFILL_BLOCKS), t : t + 1]
            )
    base = pair.consumers[0].settings.control_port
    assert [c.settings.control_port for c in pair.consumers] == [base, base + 1]
    params = [b["kv_transfer_params"] for b in pair.meta.bodies]
    assert [(p["remote_port"], p["remote_tp_size"]) for p in params] == [(base, 2), (base, 2)]  # rank 0's, each
    for t, consumer in enumerate(pair.consumers):
        assert consumer.take_counters()["bytes_read"] == pair.producers[t].take_counters()["bytes_served"] > 0


def test_copies_cross_once_each_prefill_rank_serving_its_share_of_the_blocks(tp_pairs):
    pair = tp_pairs(1, replicated=True)
    blocks = (1, 2, 3, 4, 5)
    pair.run(18, ((0, 8), (8, 18)), blocks, (5, 7, 6, 2, 4))
    for name in LAYERS:
        assert torch.equal(pair.decode[0][name][[5, 7, 6, 2, 4]], pair.full[name][list(blocks)])
    served = [p.take_counters()["blocks_served"] for p in pair.producers]
    # step 1 (rows 0-8, blocks 0-1): rank 0 block 0, rank 1 block 1; step 2 (rows 8-18, blocks 2-4):
    # rank 0 block 2, rank 1 blocks 3-4; per layer, five blocks in all
    assert served == [2 * len(LAYERS), 3 * len(LAYERS)]


def test_a_layout_a_decode_rank_cannot_take_is_refused_naming_both_sides(tp_pairs):
    pair = tp_pairs(1, replicated=False)
    consumer, meta = pair.consumers[0], pair.producers[0].metadata
    other = type(meta)()
    other.CopyFrom(meta)
    for lay in other.layers:
        lay.main_row_bytes = 32
    assert (
        "rows of 32 bytes (prefill tp rank 0 of 2) fill neither a whole row of 48 bytes (decode tp 1) nor its 1/2"
        in consumer.pull.exchange_layout(other)
    )
    other.CopyFrom(meta)
    other.prefill_tp_rank = 2
    assert "prefill_tp_rank: 2 is outside 0..1" in consumer.pull.exchange_layout(other)


def test_a_head_slice_through_a_transfer_engine_is_refused(tp_pairs):
    pair = tp_pairs(1, replicated=False, backend="mooncake")
    reason = pair.consumers[0].pull.exchange_layout(pair.producers[1].metadata)
    assert "a transfer engine reads whole blocks only: use transfer_backend 'kvoffload'" in reason
