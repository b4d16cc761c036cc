"""Buffer plan: the reference examples, descriptor merge, log line and accounting."""

import pytest
import torch

from kvcore.layout import CacheSpec, KVLayout, LayerSpec
from kvcore.plan import BufferPlan


def mla(n, mtp=0, indexer=True, bs=16):
    return KVLayout.for_mla(
        num_hidden_layers=n,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        block_size=bs,
        dtype="bfloat16",
        num_mtp_layers=mtp,
        index_head_dim=16 if indexer else None,
    )


def test_reference_example_27_layers_b6():
    plan = BufferPlan.build(mla(27), 6, [0])
    assert plan.slots[:3] == ((0,), (1, 7, 13, 19, 25), (2, 8, 14, 20, 26))
    assert plan.slots[3:] == ((3, 9, 15, 21), (4, 10, 16, 22), (5, 11, 17, 23), (6, 12, 18, 24))
    assert plan.num_buffers == 1 + 6
    assert plan.previous_occupant(7) == 1
    assert plan.previous_occupant(1) is None
    assert plan.previous_occupant(0) is None


def test_reference_example_mtp_4_base_b2():
    plan = BufferPlan.build(mla(4, mtp=1), 2, [0])
    assert plan.slots == ((0,), (1, 3), (2, 4))
    assert plan.slot_of(4) == 2 and plan.previous_occupant(4) == 2


def test_no_reuse_default_and_all_independent():
    layout = mla(5, mtp=1)
    assert BufferPlan.build(layout, None, [0]).slots == tuple((i,) for i in range(6))
    assert BufferPlan.build(layout, 2, range(6)).slots == tuple((i,) for i in range(6))
    assert not BufferPlan.build(layout, None, [0]).reuses


def test_buckets_by_main_spec():
    a, b = CacheSpec(40, torch.bfloat16), CacheSpec(24, torch.bfloat16)
    specs = [a, a, b, a, b, a, b]
    layout = KVLayout(tuple(LayerSpec(i, f"layers.{i}", s) for i, s in enumerate(specs)), 7, 16)
    plan = BufferPlan.build(layout, 2, [0])
    # bucket a = 1, 3, 5 -> (1, 5), (3,); bucket b = 2, 4, 6 -> (2, 6), (4,)
    assert plan.slots == ((0,), (1, 5), (2, 6), (3,), (4,))
    assert all(len({layout.layers[i].main for i in s}) == 1 for s in plan.slots)


def test_descriptor_merge_and_log_line():
    plan = BufferPlan.build(mla(27), 6, [0])
    assert plan.num_descriptors_before == 54
    assert plan.num_descriptors_after == 14
    assert plan.log_line() == (
        "Layerwise KV cache reuse merged 54 descriptors into 14 descriptors using 7 buffer assignments."
    )
    no_indexer = BufferPlan.build(mla(27, indexer=False), 6, [0])
    assert no_indexer.log_line().startswith("Layerwise KV cache reuse merged 27 descriptors into 7 descriptors")


def test_indexer_descriptor_only_where_a_layer_has_one():
    main = CacheSpec(40, torch.bfloat16)
    idx = CacheSpec(16, torch.bfloat16)
    layers = (
        LayerSpec(0, "layers.0", main, idx),
        LayerSpec(1, "layers.1", main, None),
        LayerSpec(2, "layers.2", main, None),
        LayerSpec(3, "layers.3", main, idx),
    )
    plan = BufferPlan.build(KVLayout(layers, 4, 16), 2, [0])
    assert plan.slots == ((0,), (1, 3), (2,))
    kinds = [(d.slot, d.kind) for d in plan.descriptors]
    assert kinds == [(0, "main"), (0, "indexer"), (1, "main"), (1, "indexer"), (2, "main")]


def test_log_emits_the_line():
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        BufferPlan.build(mla(4, mtp=1), 2, [0]).log()
    assert logs[0]["event"] == (
        "Layerwise KV cache reuse merged 10 descriptors into 6 descriptors using 3 buffer assignments."
    )
    assert logs[0]["slots"] == [[0], [1, 3], [2, 4]]


def test_accounting_ratio_is_i_plus_b_over_n():
    layout = mla(27)
    acc = BufferPlan.build(layout, 3, [0]).accounting(num_blocks=10)
    per_layer = 10 * 16 * layout.layers[0].row_bytes
    assert acc.device_bytes_no_reuse == 27 * per_layer
    assert acc.device_bytes == 4 * per_layer
    assert acc.device_ratio == pytest.approx(4 / 27)
    assert acc.scale_factor == pytest.approx(27 / 4)


def test_host_bytes_round_up_to_blocks():
    layout = mla(4, mtp=1, bs=16)
    plan = BufferPlan.build(layout, 2, [0])
    assert plan.host_bytes_needed(17) == 32 * layout.bytes_per_token
    assert plan.host_bytes_needed(0) == 0


@pytest.mark.parametrize("b", [0, -1, True, 2.0, "3"])
def test_bad_num_shared_buffers(b):
    with pytest.raises(ValueError, match="num_shared_buffers"):
        BufferPlan.build(mla(4), b, [0])


def test_bad_independent_layers_and_unknown_layer():
    with pytest.raises(ValueError, match="outside"):
        BufferPlan.build(mla(4), 2, [4])
    with pytest.raises(ValueError, match="not in the plan"):
        BufferPlan.build(mla(4), 2, [0]).slot_of(9)
