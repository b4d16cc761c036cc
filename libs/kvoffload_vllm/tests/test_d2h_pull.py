"""The remote D2H worker sides, without vLLM: a ``Producer`` and a ``Consumer`` in one process, over
real gRPC on loopback and a real HTTP metaserver stand-in that answers the registration.

Blocks move byte for byte into the decode's blocks, whatever the block ids on either side; a
request ends exactly once (landed, failed, cancelled); a silent prefill fails the request after
``peer_timeout_s``; a layout from another model is refused with both sides named. With two KV cache
groups (vLLM's hybrid KV cache manager) whose layers alias one storage, each layer moves through its
own group's blocks and block size, and null blocks are neither pulled nor served. Each of these runs
on both transfer backends a vLLM pair takes: the LayerSource's gRPC stream ("kvoffload") and Mooncake
Transfer Engine ("mooncake": a real engine per side, over TCP on loopback, reading straight into the
decode's blocks).
"""

from __future__ import annotations

import time

import pytest
import torch
from d2h_support import Metaserver, ended, free_port, settings, until
from structlog.testing import capture_logs

from kvoffload_vllm.d2h_consumer import COUNTERS, Consumer
from kvoffload_vllm.d2h_layers import D2HLayers
from kvoffload_vllm.d2h_plan import Peer, Send
from kvoffload_vllm.d2h_step import D2HStepMetadata, Recv
from kvoffload_vllm.kv_digest import pages_digest
from kvoffload_vllm.kv_groups import KVGroup
from kvoffload_vllm.producer import Producer
from pdlink.refusals import Refused

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
GROUPS = (KVGroup(0, LAYERS, 4, ()),)


BACKENDS = ("kvoffload", "mooncake")


def two_layers(seed: int) -> tuple[D2HLayers, D2HLayers]:
    """A prefill's ``LAYERS`` (random KV, seeded) and a decode's (zeros): 8 blocks of 4 rows each."""
    torch.manual_seed(seed)
    prefill_caches = {name: torch.randn((8, 2, 8, 3)) for name in LAYERS}
    decode_caches = {name: torch.zeros((8, 2, 8, 3)) for name in LAYERS}
    return D2HLayers.of(GROUPS, prefill_caches, 8), D2HLayers.of(GROUPS, decode_caches, 8)


@pytest.fixture(params=BACKENDS)
def pair(request):
    prefill, decode = two_layers(seed=0)
    yield from running_pair(prefill, decode, backend=request.param)


def running_pair(prefill_layers: D2HLayers, decode_layers: D2HLayers, *, backend: str, kv_digests: bool = False):
    consumer = Consumer(
        settings("kv_consumer", backend, free_port(), dp_rank=1, kv_digests=kv_digests), "model-a", decode_layers
    )
    producer = Producer(settings("kv_producer", backend), "model-a", prefill_layers)
    meta = Metaserver()
    yield producer, consumer, meta, prefill_layers, decode_layers
    producer.close()
    consumer.close()
    meta.close()


def recv(meta: Metaserver, num_tokens: int, *block_ids: tuple[int, ...]) -> Recv:
    return Recv("vllm-d", "cmpl-1", meta.url, None, num_tokens, 0, block_ids)


def test_a_chunked_prompt_lands_block_for_block_and_ends_once(pair):
    producer, consumer, meta, prefill, decode = pair
    pc, dc = dict(zip(LAYERS, prefill.pages, strict=True)), dict(zip(LAYERS, decode.pages, strict=True))
    consumer.begin_step(D2HStepMetadata(recvs=[recv(meta, 10, (5, 7, 6))]))
    until(lambda: meta.bodies)
    params = meta.bodies[0]["kv_transfer_params"]
    assert (params["request_id"], params["remote_port"]) == ("cmpl-1", consumer.settings.control_port)
    assert params["remote_dp_rank"] == 1  # its true DP rank
    peer = Peer("cmpl-1", (consumer.endpoint,))
    for start, end, blocks in ((0, 6, (1, 2)), (6, 10, (1, 2, 3))):  # two chunks; block 2 written by both
        step = D2HStepMetadata(sends=[Send("vllm-p", peer, start, end, 10, (blocks,))])
        for name in LAYERS:
            producer.layer_saved(name, step)
        producer.end_step()
    assert ended(consumer) == ({"vllm-d"}, set())
    for name in LAYERS:
        assert torch.equal(dc[name][[5, 7, 6]], pc[name][[1, 2, 3]])
        assert not dc[name][[0, 1, 2, 3, 4]].any()  # nothing else written
    assert until(lambda: producer.finished({"vllm-p"})) == {"vllm-p"}
    assert consumer.finished() == (set(), set())  # reported once
    counters = consumer.take_counters()
    assert counters["requests_pulled"] == 1 and counters["read_done"] == 4 and counters["bytes_read"] > 0
    engine = consumer.settings.transfer_backend == "mooncake"  # every read through it, none streamed
    assert (counters["reads_engine"], counters["reads_streamed"]) == ((4, 0) if engine else (0, 4))
    assert producer.take_counters()["blocks_served"] == (0 if engine else 2 * 4)  # per layer: blocks 0, 1, then 1, 2
    assert set(counters) >= set(COUNTERS) and consumer.take_counters()["read_done"] == 0  # the sums since the last


@pytest.fixture
def digest_pair():
    prefill, decode = two_layers(seed=1)
    yield from running_pair(prefill, decode, backend="kvoffload", kv_digests=True)


def test_with_kv_digests_the_pulled_line_carries_each_layers_digest_of_the_full_prompt_blocks(digest_pair):
    producer, consumer, meta, prefill, _ = digest_pair
    consumer.begin_step(D2HStepMetadata(recvs=[recv(meta, 10, (5, 7, 6))]))
    until(lambda: meta.bodies)
    step = D2HStepMetadata(sends=[Send("vllm-p", Peer("cmpl-1", (consumer.endpoint,)), 0, 10, 10, ((1, 2, 3),))])
    for name in LAYERS:
        producer.layer_saved(name, step)
    producer.end_step()
    with capture_logs() as logs:
        assert ended(consumer) == ({"vllm-d"}, set())
    (line,) = [e for e in logs if e["event"] == "kvoffload_d2h_pulled"]
    # 10 tokens in blocks of 4: two full blocks, the prefill's 1 and 2; the partial third is left out
    assert line["kv_digests"] == [pages_digest(page[[1, 2]]) for page in prefill.pages]
    assert line["kv_digest_blocks"] == [(0, 2)]
    assert len(set(line["kv_digests"])) == len(LAYERS)  # the layers' bytes differ: so do their digests
    assert line["kv_digests"][0] != pages_digest(prefill.pages[0][[1, 3]])


def test_a_prefill_that_goes_silent_fails_the_request_after_the_peer_timeout(pair):
    producer, consumer, meta, _, _ = pair
    consumer.begin_step(D2HStepMetadata(recvs=[recv(meta, 10, (5, 6, 7))]))
    until(lambda: meta.bodies)  # registered: the prefill answered, its reads are due now
    t = time.monotonic()
    assert ended(consumer) == (set(), {"vllm-d"})
    assert 0.9 < time.monotonic() - t < 5


def test_a_request_vllm_finished_while_loading_is_released_as_received(pair):
    _, consumer, meta, _, _ = pair
    consumer.begin_step(D2HStepMetadata(recvs=[recv(meta, 10, (5, 6, 7))]))
    consumer.begin_step(D2HStepMetadata(cancelled=["vllm-d"]))
    assert consumer.finished() == ({"vllm-d"}, set())


def test_a_layout_of_another_model_is_refused_with_both_sides_named(pair):
    producer, consumer, _, _, _ = pair
    other = type(producer.metadata)()
    other.CopyFrom(producer.metadata)
    other.model_id = "model-b"
    reason = consumer.pull.exchange_layout(other)
    assert "model_id: prefill 'model-b', decode 'model-a'" in reason
    assert consumer.pull.exchange_layout(producer.metadata) == ""


def test_the_layer_source_serves_only_block_aligned_ranges_of_requests_it_sends(pair):
    import grpc

    from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc

    producer, _, _, _, _ = pair
    stub = transfer_pb2_grpc.LayerSourceStub(grpc.insecure_channel(producer.data_endpoint))
    ask = dict(
        layer=0, kind=transfer_pb2.PLANE_KIND_MAIN, generation=1, layout_version=producer.metadata.layout_version
    )
    with pytest.raises(grpc.RpcError) as e:
        list(stub.ReadLayer(transfer_pb2.ReadLayerRequest(request_id="nobody", src_start=0, src_end=4, **ask)))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        list(stub.ReadLayer(transfer_pb2.ReadLayerRequest(request_id="nobody", src_start=0, src_end=3, **ask)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "block-aligned" in e.value.details()


# vLLM's hybrid KV cache manager (hybrid-facts.md): a full-attention group (layers 0, 2; 4-token
# blocks) and a sliding-window group (layers 1, 3; 8-token blocks, as with DeepSeek-V4's groups of
# different block sizes); layer 0 and layer 1 are views of one storage, layers 2 and 3 of another, so
# block id b is the same bytes in both groups and belongs to one group at a time.
HYBRID = (
    KVGroup(0, ("model.layers.0.attn", "model.layers.2.attn"), 4, ()),
    KVGroup(1, ("model.layers.1.attn", "model.layers.3.attn"), 8, ()),
)


def hybrid_caches(storages: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each storage ``[16, 48]`` float32 (192-byte pages) as a full layer (4 rows of 48 bytes per block) and
    a sliding layer (8 rows of 24 bytes)."""
    full, sliding = HYBRID[0].layer_names, HYBRID[1].layer_names
    return {
        **{name: s.view(16, 4, 12) for name, s in zip(full, storages, strict=True)},
        **{name: s.view(16, 8, 6) for name, s in zip(sliding, storages, strict=True)},
    }


@pytest.fixture(params=BACKENDS)
def hybrid_pair(request):
    torch.manual_seed(1)
    prefill = D2HLayers.of(HYBRID, hybrid_caches([torch.randn(16, 48), torch.randn(16, 48)]), 16)
    decode = D2HLayers.of(HYBRID, hybrid_caches([torch.zeros(16, 48), torch.zeros(16, 48)]), 16)
    yield from running_pair(prefill, decode, backend=request.param)


def test_two_groups_pull_through_their_own_blocks_and_never_touch_null_ones(hybrid_pair):
    producer, consumer, meta, prefill, decode = hybrid_pair
    assert prefill.names == ("model.layers.0.attn", "model.layers.2.attn", "model.layers.1.attn", "model.layers.3.attn")
    assert [lay.block_size for lay in producer.metadata.layers] == [4, 4, 8, 8]
    # the decode's window needs tokens 14..19 of 20: its first sliding block is its null block
    consumer.begin_step(D2HStepMetadata(recvs=[recv(meta, 20, (9, 10, 11, 12, 13), (0, 14, 15))]))
    until(lambda: meta.bodies)
    peer = Peer("cmpl-1", (consumer.endpoint,))
    served: dict[str, float] = {}

    def answered(reads: int) -> bool:  # the producer's counters, summed across takes
        for k, v in producer.take_counters().items():
            served[k] = served.get(k, 0) + v
        return served["reads_done"] >= reads

    # two chunks; between them the prefill's sliding block 8 fell out of the window and went to the full group
    steps = (((0, 12), ((1, 2, 3), (8, 6))), ((12, 20), ((1, 2, 3, 8, 5), (0, 6, 7))))
    for n, ((start, end), blocks) in enumerate(steps, 1):
        step = D2HStepMetadata(sends=[Send("vllm-p", peer, start, end, 20, blocks)])
        for name in ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn", "model.layers.3.attn"):
            producer.layer_saved(name, step)  # model order: the groups interleave
        producer.end_step()
        until(lambda n=n: answered(4 * n))  # in order, so what each step pulls is known
    assert ended(consumer) == ({"vllm-d"}, set())
    for layer in range(4):
        got, want = decode.pages[layer], prefill.pages[layer]
        if decode.group_of[layer] == 0:
            assert torch.equal(got[[9, 10, 11, 12, 13]], want[[1, 2, 3, 8, 5]])
        else:  # the decode's null block 0 stays untouched; its block 14 landed from the prefill's 6, 15 from 7
            assert torch.equal(got[[14, 15]], want[[6, 7]])
            assert not got[0].any()
    untouched = [b for b in range(16) if b not in (9, 10, 11, 12, 13, 14, 15)]
    assert not decode.pages[0][untouched].any() and not decode.pages[1][untouched].any()
    # full layers: 3 + 2 blocks each; sliding: block 1 of the first chunk, then blocks 1 and 2 (never block 0)
    assert consumer.take_counters()["blocks_pulled"] == 2 * 5 + 2 * 3
    assert served["blocks_served"] == (0 if producer.transfer else 2 * 5 + 2 * 3)  # the engine's reads pass it by

    from kvoffload_proto.v1 import transfer_pb2

    ask = dict(request_id="cmpl-1", kind=transfer_pb2.PLANE_KIND_MAIN, generation=1)
    ask["layout_version"] = producer.metadata.layout_version
    with pytest.raises(Refused, match="null block"):  # the prefill's sliding block 0 is no longer its own
        producer.rows(transfer_pb2.ReadLayerRequest(layer=2, src_start=0, src_end=8, **ask))
    with pytest.raises(Refused, match="block-aligned ranges of 8 rows"):
        producer.rows(transfer_pb2.ReadLayerRequest(layer=2, src_start=4, src_end=8, **ask))
    assert until(lambda: producer.finished({"vllm-p"})) == {"vllm-p"}


def test_a_layer_whose_block_size_differs_is_refused_naming_it(hybrid_pair):
    producer, _, _, _, _ = hybrid_pair
    caches = hybrid_caches([torch.zeros(16, 48), torch.zeros(16, 48)])
    caches["model.layers.1.attn"] = caches["model.layers.0.attn"]  # 4-token blocks for the sliding layer too
    groups = (HYBRID[0], KVGroup(1, HYBRID[1].layer_names, 4, ()))
    backend = producer.settings.transfer_backend
    other = Consumer(settings("kv_consumer", backend, free_port()), "model-a", D2HLayers.of(groups, caches, 16))
    try:
        assert other.pull.exchange_layout(producer.metadata) == "layers[2].block_size: prefill 8, decode 4"
    finally:
        other.close()


def test_a_second_decode_on_a_taken_kv_port_fails_to_bind_instead_of_sharing_it(pair):
    """gRPC binds with SO_REUSEPORT unless told not to: two decodes on one kv_port would both start,
    and the kernel would hand each prefill connection to either, announces reaching the wrong one."""
    _, consumer, _, _, decode = pair
    port = consumer.settings.control_port
    with pytest.raises(RuntimeError, match=f"cannot bind the decode control port .*:{port}"):
        Consumer(settings("kv_consumer", "kvoffload", port), "model-a", decode)


def test_a_prefill_of_another_transfer_backend_is_refused_naming_both(pair):
    producer, _, _, prefill, _ = pair
    mine = producer.settings.transfer_backend
    theirs = next(b for b in BACKENDS if b != mine)
    other = Consumer(settings("kv_consumer", theirs, free_port()), "model-a", prefill)
    try:
        reason = other.pull.exchange_layout(producer.metadata)
    finally:
        other.close()
    assert f"the prefill's transfer_backend is {mine!r}" in reason and f"this decode's {theirs!r}" in reason


@pytest.fixture
def engine_pair():
    prefill, decode = two_layers(seed=2)
    yield from running_pair(prefill, decode, backend="mooncake")


def test_on_the_engine_every_layer_names_its_block_addresses_and_reads_fail_on_what_they_cannot_read(engine_pair):
    from kvoffload_proto.v1 import transfer_pb2

    producer, consumer, meta, prefill, decode = engine_pair
    layouts = producer.metadata.layers
    assert producer.metadata.transfer_engine == "mooncake" and producer.metadata.engine_session.startswith("127.0.0.1:")
    assert [(lay.engine_block_address, lay.engine_block_stride_bytes) for lay in layouts] == [
        (page.data_ptr(), page.stride(0)) for page in prefill.pages
    ]
    bare = type(producer.metadata)()
    bare.CopyFrom(producer.metadata)
    bare.layers[1].engine_block_address = 0
    assert "layers[1].engine_block_address: the prefill names no block addresses" in consumer.pull.exchange_layout(bare)
    assert consumer.pull.exchange_layout(producer.metadata) == ""

    two = Recv("vllm-e", "cmpl-2", meta.url, None, 10, 0, ((4, 3, 2),))
    consumer.begin_step(D2HStepMetadata(recvs=[recv(meta, 10, (5, 7, 6)), two]))
    until(lambda: len(meta.bodies) == 2)
    ask = dict(generation=1, layout_version=producer.metadata.layout_version)
    few = consumer.pull.read_ready(
        transfer_pb2.ReadReadyRequest(
            request_id="cmpl-1", layer=0, src_start=0, src_end=10, src_block_ids=[1, 2], **ask
        )
    )
    assert not few.done and "names 2 prefill blocks for rows [0, 10), which are 3 blocks" in few.reason
    null = consumer.pull.read_ready(
        transfer_pb2.ReadReadyRequest(request_id="cmpl-2", layer=1, src_start=0, src_end=8, src_block_ids=[1, 0], **ask)
    )
    assert not null.done and "block 1 of KV cache group 0 is out of its sliding window" in null.reason
    failed: set[str] = set()
    until(lambda: failed.update(consumer.finished()[1]) or len(failed) == 2)
    assert failed == {"vllm-d", "vllm-e"}  # a failed read fails its request (vLLM recomputes it)
    assert not any(page.any() for page in decode.pages)  # nothing was written
