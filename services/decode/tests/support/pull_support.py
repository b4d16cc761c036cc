"""The decode pull tests' shared harness: ``Rank`` (a decode rank's real ``DecodeLoop`` and
``SparseDecoder`` with pending requests, ``pdlink``'s ``PullConsumer`` over ``DecodeRows`` and the
prefill's ``LayoutMetadata``), ``FakeSources`` (stand-in row sources in memory), the ``rank``
fixture (a rank whose layout is accepted), ``counts`` (a subset of the puller's counters) and the
constants they share (prompt length ``N``, ``VERSION``, the decode's ``HOST``)."""

from __future__ import annotations

import threading

import pytest
import torch

from dsamodel.presets import tiny_model
from kvcore.layout import dtype_name
from kvoffload_decode.loop import DecodeLoop
from kvoffload_decode.pull import DecodeRows
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder
from kvoffload_engine.model_layout import kv_layout
from kvoffload_proto.v1 import transfer_pb2 as pb
from openai_api.sampling_params import SamplingParams
from pdlink.pull_consumer import PullConsumer, ReadOutcome

N = 20  # prompt tokens of each request
VERSION = 3
HOST = "decode-host"


class FakeSources:
    """``RowSources``' contract over rows in memory; raises the queued ``failures`` first (one per plane read)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.failures: list[Exception] = []
        self.calls = 0
        self.closed = False
        self.on_read = lambda: None
        self._lock = threading.Lock()

    def streamed_rows(self, endpoint, request, kind, row_bytes):
        with self._lock:
            self.calls += 1
            failure = self.failures.pop(0) if self.failures else None
        self.on_read()
        if failure is not None:
            raise failure
        kv, idx = self.rows[(request.request_id, request.layer)]
        plane = kv if kind == pb.PLANE_KIND_MAIN else idx
        out = plane[request.src_start : request.src_end].contiguous().view(torch.uint8)
        assert out.shape[1] == row_bytes
        return out

    def shared_rows(self, region, start, end, row_bytes):
        raise AssertionError("the stand-in prefill is on another host")

    def close(self) -> None:
        self.closed = True


class Rank:
    """A decode rank's loop with ``requests`` pending requests (``r0``, ``r1``, ...) and a puller."""

    def __init__(
        self,
        requests: int = 1,
        read_retries: int = 2,
        sources=None,
        host_id: str = "prefill-host",
        max_num_seqs: int = 2,
    ) -> None:
        self.model = tiny_model(dtype="float32")
        c = self.model.config
        self.layout = kv_layout(c, 16, self.model.dtype)
        self.pool = build.decode_pool(self.model, 16, 16 << 20)
        self.loop = DecodeLoop(
            SparseDecoder(self.model, self.pool, topk_buffer_size=64, max_num_seqs=max_num_seqs, max_model_len=256),
            c.eos_token_id,
        )
        self.sources = sources if sources is not None else FakeSources()
        self.puller = PullConsumer(
            DecodeRows(self.loop, self.layout), self.sources, model_id="tiny", host_id=HOST, read_retries=read_retries
        )
        self.meta = pb.LayoutMetadata(
            model_id="tiny",
            num_layers=self.layout.num_layers,
            block_size=16,
            prefill_tp_rank=0,
            prefill_tp_size=1,
            data_endpoint="prefill:1",
            host_id=host_id,
            layout_version=VERSION,
            layers=[
                pb.LayerLayout(
                    layer=s.index,
                    slot=s.index,
                    main_row_bytes=s.main.row_bytes,
                    main_dtype=dtype_name(s.main.dtype),
                    indexer_row_bytes=s.indexer.row_bytes,
                    indexer_dtype=dtype_name(s.indexer.dtype),
                )
                for s in self.layout.layers
            ],
        )
        gen = torch.Generator().manual_seed(0)
        for i in range(requests):
            self.loop.expect_remote(f"r{i}", list(range(N)), SamplingParams(max_tokens=3), lambda *e: None)
            for layer in range(self.layout.num_layers):
                if isinstance(self.sources, FakeSources):
                    self.sources.rows[(f"r{i}", layer)] = (
                        torch.randn(N, c.kv_row_width, generator=gen),
                        torch.randn(N, c.index_head_dim, generator=gen),
                    )

    def accept(self) -> None:
        assert self.puller.exchange_layout(self.meta) == ""

    def read(self, **kw) -> ReadOutcome:
        fields = dict(
            request_id="r0", layer=0, generation=1, src_start=0, src_end=N, dst_start=0, layout_version=VERSION
        )
        return self.puller.read_ready(pb.ReadReadyRequest(**{**fields, **kw}))

    def rows(self, request_id: str, layer: int) -> int:
        with self.loop.lock:
            return self.loop.pending[request_id].rows[layer]

    def host_rows(self, request_id: str, layer: int) -> torch.Tensor:
        """The request's main-KV rows [0, N) of ``layer`` as the host pool holds them (as the model dtype)."""
        dec = self.loop.decoder
        seq = dec.seqs[request_id]
        plane = self.pool.plane(dec._planes[layer])  # [num_blocks, block_size, row_bytes]
        ids = dec.block_table[seq.seq_slot, : seq.num_blocks].to(torch.long)
        return plane[ids].reshape(-1, plane.shape[-1])[:N].clone().view(self.model.dtype)

    def close(self) -> None:
        self.loop.close()
        self.puller.close()
        self.pool.close()


@pytest.fixture
def rank():
    r = Rank()
    r.accept()
    yield r
    r.close()


def counts(rank: Rank, *names: str) -> dict:
    snap = rank.puller.counters.snapshot()
    return {k: snap[k] for k in names}
