"""The layout builders: the messages they build are the ones a decode accepts, whole (engine fields
included, nothing patched after), and a message a decode would refuse is refused here, naming the
field."""

from __future__ import annotations

import pytest

from kvoffload_proto.v1 import transfer_pb2
from pdlink.layout_messages import EngineShare, Region, layer_layout, layout_metadata


def _layers(n: int = 3) -> list[transfer_pb2.LayerLayout]:
    return [
        layer_layout(
            i,
            slot=min(i, 1),
            main_row_bytes=1152,
            main_dtype="bfloat16",
            main_row_kind="mla_latent",
            indexer_row_bytes=128,
            indexer_dtype="float8_e4m3fn",
            main_buffer=Region("seg", 4096 * i, 1152, 256),
            indexer_buffer=Region("seg", 4096 * i + 2048, 128, 256),
        )
        for i in range(n)
    ]


def _meta(**kw) -> transfer_pb2.LayoutMetadata:
    args = dict(
        model_id="m", layers=_layers(), block_size=16, tp_rank=0, tp_size=1, data_endpoint="h:1", host_id="x", version=7
    )
    return layout_metadata(**{**args, **kw})


def test_every_field_lands_where_the_proto_says():
    meta = _meta(engine=EngineShare("mooncake", "10.0.0.1:1234", segment_address=0x7F00))
    assert (meta.num_layers, meta.block_size, meta.layout_version, meta.data_endpoint) == (3, 16, 7, "h:1")
    assert (meta.transfer_engine, meta.engine_session, meta.engine_segment_address) == (
        "mooncake",
        "10.0.0.1:1234",
        0x7F00,
    )
    lay = meta.layers[2]
    assert (lay.layer, lay.slot, lay.main_row_bytes, lay.main_row_kind) == (2, 1, 1152, "mla_latent")
    assert (lay.indexer_row_bytes, lay.indexer_dtype) == (128, "float8_e4m3fn")
    assert (lay.main_buffer.segment_name, lay.main_buffer.offset_bytes, lay.main_buffer.capacity_tokens) == (
        "seg",
        8192,
        256,
    )
    assert (lay.indexer_buffer.offset_bytes, lay.indexer_buffer.row_stride_bytes) == (8192 + 2048, 128)


def test_without_an_engine_no_engine_field_is_set():
    meta = _meta()
    assert (meta.transfer_engine, meta.engine_session, meta.engine_segment_address) == ("", "", 0)


def test_a_paged_layer_on_an_engine_carries_its_block_addresses_and_no_region():
    lay = layer_layout(0, slot=0, main_row_bytes=256, main_dtype="float32", block_size=128, engine_block=(4096, 32768))
    assert (lay.engine_block_address, lay.engine_block_stride_bytes, lay.block_size) == (4096, 32768, 128)
    assert not lay.HasField("main_buffer") and not lay.HasField("indexer_buffer")


@pytest.mark.parametrize(
    "kw, named",
    [
        ({"main_row_bytes": 0}, "main_row_bytes"),
        ({"main_dtype": ""}, "main_dtype"),
        ({"indexer_row_bytes": 128}, "indexer_dtype"),
        ({"indexer_dtype": "bfloat16"}, "indexer_dtype"),
        ({"indexer_buffer": Region("s", 0, 1, 1)}, "indexer_buffer"),
    ],
)
def test_a_layer_a_decode_would_refuse_is_refused_naming_the_field(kw, named):
    args = dict(slot=0, main_row_bytes=64, main_dtype="float32")
    with pytest.raises(ValueError, match=named):
        layer_layout(0, **{**args, **kw})


@pytest.mark.parametrize(
    "kw, named",
    [
        ({"layers": _layers()[1:]}, "numbered 0..1"),
        ({"layers": list(reversed(_layers()))}, "numbered"),
        ({"tp_rank": 2, "tp_size": 2}, "prefill_tp_rank"),
        ({"version": 0}, "layout_version"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_a_layout_a_decode_would_refuse_is_refused_naming_the_field(kw, named):
    with pytest.raises(ValueError, match=named):
        _meta(**kw)
