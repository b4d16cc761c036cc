"""The decode puller's layouts, heartbeats and PrefillDone without a gRPC server (the harness:
support/pull_support.py): accepted layouts kept by version, the contributor group of a decode TP
rank, the shares of two prefill TP ranks completing one prompt, heartbeats naming unknown requests,
and PrefillDone for a request that is not waiting. (The pulls themselves: test_pull.)
"""

from __future__ import annotations

import pytest
import torch
from pull_support import HOST, VERSION, N, counts, rank  # noqa: F401  (rank: fixture)

from kvoffload_proto.v1 import transfer_pb2 as pb
from pdlink.refusals import NoAcceptedLayout, UnknownRequest


def test_layouts_are_kept_by_version_and_handed_out_as_a_copy(rank):
    assert rank.puller.accepted_layout(VERSION) is rank.meta
    copy = rank.puller.layouts()
    copy.clear()
    assert set(rank.puller.layouts()) == {VERSION}
    bad = pb.LayoutMetadata()
    bad.CopyFrom(rank.meta)
    bad.model_id = "other"
    assert rank.puller.exchange_layout(bad) == "model_id: prefill 'other', decode 'tiny'"
    assert rank.puller.accepted_layout(VERSION) is rank.meta  # a refused layout replaces nothing
    with pytest.raises(NoAcceptedLayout, match="no accepted layout with layout_version 4"):
        rank.puller.accepted_layout(4)
    assert not rank.puller.same_host(rank.meta.host_id) and rank.puller.same_host(HOST)


def test_a_decode_tp_rank_accepts_only_the_layouts_of_its_contributors(rank):
    """Decode TP rank 1 of 2 takes layouts from prefill TP ranks 2 and 3 of 4 (its contributor group)
    and refuses every other rank and any prefill TP that cannot feed decode TP 2, naming both sides."""
    rank.puller.tp_rank, rank.puller.tp_size = 1, 2
    m = pb.LayoutMetadata()
    m.CopyFrom(rank.meta)
    for p_tp, p_rank, want in [
        (4, 2, ""),
        (4, 3, ""),
        (2, 1, ""),
        (4, 1, "tp rank: prefill tp rank 1 of 4 feeds decode tp rank 0 of 2, not decode tp rank 1"),
        (1, 0, "tp: prefill tp 1, decode tp 2; prefill TP must be >= decode TP"),
        (3, 2, "tp: prefill tp 3, decode tp 2; prefill TP must be >= decode TP and divisible"),
    ]:
        m.prefill_tp_size, m.prefill_tp_rank, m.layout_version = p_tp, p_rank, VERSION + 10 + p_tp * 4 + p_rank
        reason = rank.puller.exchange_layout(m)
        assert reason.startswith(want) if want else reason == "", (p_tp, p_rank, reason)


def test_two_contributors_shares_of_every_layer_complete_the_prompt_and_are_counted_by_rank(rank):
    """Prefill TP ranks 0 and 1 of 2 feed this decode rank (TP 1): each sends its share of every layer,
    rank 1's first. The prompt is whole, the host pool holds the prefill's rows, and the bytes each
    rank's share carried sum to one copy of the prompt's KV."""
    m = pb.LayoutMetadata()
    m.CopyFrom(rank.meta)
    rank.meta.prefill_tp_size = 2
    assert rank.puller.exchange_layout(rank.meta) == ""
    m.prefill_tp_size, m.prefill_tp_rank, m.layout_version = 2, 1, VERSION + 1
    assert rank.puller.exchange_layout(m) == ""
    cut = 13
    for layer in range(rank.layout.num_layers):
        assert rank.read(layer=layer, src_start=cut, dst_start=cut, layout_version=VERSION + 1).done
        assert rank.rows("r0", layer) == 0
        assert rank.read(layer=layer, src_end=cut).done
        assert rank.rows("r0", layer) == N
        assert torch.equal(rank.host_rows("r0", layer), rank.sources.rows[("r0", layer)][0])
    snap = rank.puller.counters.snapshot()
    one_copy = sum(
        (kv.numel() + idx.numel()) * 4
        for kv, idx in (rank.sources.rows[("r0", i)] for i in range(rank.layout.num_layers))
    )
    assert snap["bytes_read"] == one_copy
    assert snap["bytes_read_prefill_tp_rank_0"] == one_copy * cut // N
    assert snap["bytes_read_prefill_tp_rank_1"] == one_copy * (N - cut) // N


def test_heartbeat_names_the_unknown_requests_and_is_counted(rank):
    assert rank.puller.heartbeat(VERSION, ["r0", "gone", "r0"]) == ["gone"]
    assert rank.loop.ledger.stage_of("r0") == "pulling"  # the prefill has been heard from
    with pytest.raises(NoAcceptedLayout):
        rank.puller.heartbeat(VERSION + 1, ["r0"])
    assert counts(rank, "heartbeats") == {"heartbeats": 1}


def test_prefill_done_for_an_unknown_request_raises(rank):
    with pytest.raises(UnknownRequest, match="request 'nobody' is not waiting for KV here"):
        rank.puller.prefill_done(
            pb.PrefillDoneRequest(layout_version=VERSION, request_id="nobody", num_prompt_tokens=N, first_token=7)
        )
