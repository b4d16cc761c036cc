"""The remote D2H worker sides, without vLLM: a ``Producer`` and a ``Consumer`` in one process, over
real gRPC on loopback and a real HTTP metaserver stand-in that answers the registration.

Blocks move byte for byte into the decode's blocks, whatever the block ids on either side; a
request ends exactly once (landed, failed, cancelled); a silent prefill fails the request after
``peer_timeout_s``; a layout from another model is refused with both sides named.
"""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest
import torch

from kvoffload_vllm.consumer import COUNTERS, Consumer
from kvoffload_vllm.d2h_plan import Peer, Send
from kvoffload_vllm.d2h_settings import D2HSettings
from kvoffload_vllm.d2h_step import D2HStepMetadata, Recv
from kvoffload_vllm.layout import CacheLayout
from kvoffload_vllm.producer import Producer

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
LAYOUT = CacheLayout(LAYERS, num_blocks=8, block_size=4, block_shape=(2, 8, 3), dtype=torch.float32)


class Metaserver:
    """Answers every registration 200 and keeps the bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"status": "ok"}')

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metaserver"

    def close(self) -> None:
        self.server.shutdown()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pair():
    torch.manual_seed(0)
    prefill_caches = {name: torch.randn((8, 2, 8, 3)) for name in LAYERS}
    decode_caches = {name: torch.zeros((8, 2, 8, 3)) for name in LAYERS}
    consumer = Consumer(
        D2HSettings("kv_consumer", free_port(), "127.0.0.1", 0, 1.0, 10.0, dp_rank=1), "model-a", LAYOUT, decode_caches
    )
    producer = Producer(D2HSettings("kv_producer", None, "127.0.0.1", 0, 1.0, 10.0), "model-a", LAYOUT, prefill_caches)
    meta = Metaserver()
    yield producer, consumer, meta, prefill_caches, decode_caches
    producer.close()
    consumer.close()
    meta.close()


def until(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("timed out")


def recv(meta: Metaserver, num_tokens: int, block_ids: tuple[int, ...], first_block: int = 0) -> Recv:
    return Recv("vllm-d", "cmpl-1", meta.url, None, num_tokens, first_block, block_ids)


def test_a_chunked_prompt_lands_block_for_block_and_ends_once(pair):
    producer, consumer, meta, pc, dc = pair
    consumer.begin_step(D2HStepMetadata(recvs=[recv(meta, 10, (5, 7, 6))]))
    until(lambda: meta.bodies)
    params = meta.bodies[0]["kv_transfer_params"]
    assert (params["request_id"], params["remote_port"]) == ("cmpl-1", consumer.settings.control_port)
    assert params["remote_dp_rank"] == 1  # its true DP rank
    peer = Peer("cmpl-1", consumer.endpoint)
    for start, end, blocks in ((0, 6, (1, 2)), (6, 10, (1, 2, 3))):  # two chunks; block 2 written by both
        step = D2HStepMetadata(sends=[Send("vllm-p", peer, start, end, 10, blocks)])
        for name in LAYERS:
            producer.layer_saved(name, step)
        producer.end_step()
    done, failed = until(lambda: (lambda r: r if r[0] or r[1] else None)(consumer.finished()))
    assert (done, failed) == ({"vllm-d"}, set())
    for name in LAYERS:
        assert torch.equal(dc[name][[5, 7, 6]], pc[name][[1, 2, 3]])
        assert not dc[name][[0, 1, 2, 3, 4]].any()  # nothing else written
    assert until(lambda: producer.finished({"vllm-p"})) == {"vllm-p"}
    assert consumer.finished() == (set(), set())  # reported once
    counters = consumer.take_counters()
    assert counters["requests_pulled"] == 1 and counters["read_done"] == 4 and counters["bytes_read"] > 0
    assert set(counters) >= set(COUNTERS) and consumer.take_counters()["read_done"] == 0  # the sums since the last


def test_a_prefill_that_goes_silent_fails_the_request_after_the_peer_timeout(pair):
    producer, consumer, meta, _, _ = pair
    consumer.begin_step(D2HStepMetadata(recvs=[recv(meta, 10, (5, 6, 7))]))
    until(lambda: meta.bodies)  # registered: the prefill answered, its reads are due now
    t = time.monotonic()
    done, failed = until(lambda: (lambda r: r if r[0] or r[1] else None)(consumer.finished()))
    assert (done, failed) == (set(), {"vllm-d"})
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
