"""The remote D2H bookkeeping: what a prefill step sends, and which copy of a block a decode keeps."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload_vllm.d2h_plan import Coverage, Peer, SendPlanner, blocks_of, peer_of
from openai_api.transfer_params import parse_transfer_params

PEER = Peer("cmpl-1", ("127.0.0.1:20050",))


def test_peer_of_reads_the_metaserver_params_and_refuses_half_of_them():
    assert peer_of(parse_transfer_params({"do_remote_decode": False})) is None
    assert peer_of(None) is None
    assert peer_of(parse_transfer_params({"remote_host": "10.0.0.2", "remote_port": 20050, "request_id": "r"})) == Peer(
        "r", ("10.0.0.2:20050",)
    )
    with pytest.raises(ValueError, match="remote_port"):
        peer_of(parse_transfer_params({"remote_host": "10.0.0.2", "request_id": "r"}))
    with pytest.raises(ValueError, match="remote_port"):
        peer_of(parse_transfer_params({"remote_host": "h", "remote_port": True, "request_id": "r"}))


def test_chunked_prompt_is_sent_chunk_by_chunk_and_only_the_prompt():
    p = SendPlanner()
    p.allocated("a", PEER, prompt_len=300)
    s1 = p.step("a", ([7, 8],), computed=0, scheduled=200)
    assert (s1.start, s1.end, s1.block_ids) == (0, 200, ((7, 8),))
    s2 = p.step("a", ([7, 8, 9],), computed=200, scheduled=100)
    assert (s2.start, s2.end, s2.block_ids) == (200, 300, ((7, 8, 9),))
    assert p.step("a", ([7, 8, 9],), computed=300, scheduled=1) is None  # a decode step: nothing to send
    assert p.finished("a") is True and p.finished("a") is False


def test_a_local_prefix_hit_is_sent_too_and_unknown_requests_send_nothing():
    p = SendPlanner()
    p.allocated("a", PEER, prompt_len=300)
    s = p.step("a", ([1, 2, 3],), computed=256, scheduled=44)  # 256 tokens from vLLM's prefix cache
    assert (s.start, s.end) == (0, 300)
    assert p.sends("a") and not p.sends("b")
    assert p.step("b", ([4],), computed=0, scheduled=10) is None
    assert p.finished("b") is False


def test_each_send_carries_every_groups_blocks_as_the_scheduler_holds_them_in_that_step():
    # hybrid-facts run c: a sliding-window group's block out of the window becomes the null block in place
    p = SendPlanner()
    p.allocated("a", PEER, prompt_len=500)
    assert p.step("a", ([1, 3], [2, 4]), computed=128, scheduled=128).block_ids == ((1, 3), (2, 4))
    s = p.step("a", ([1, 3, 2], [0, 4, 5]), computed=256, scheduled=128)
    assert (s.start, s.end, s.block_ids) == (256, 384, ((1, 3, 2), (0, 4, 5)))


def test_blocks_of_covers_partial_blocks():
    assert list(blocks_of(0, 1, 128)) == [0]
    assert list(blocks_of(200, 300, 128)) == [1, 2]
    assert list(blocks_of(256, 256, 128)) == []


def test_an_older_shorter_copy_never_overwrites_a_newer_one():
    c = Coverage(num_layers=1, num_tokens=300, block_size=128)
    newer = c.to_write(0, 200, 300)  # blocks 1, 2 with 128 and 44 valid tokens
    assert newer.tolist() == [0, 1]
    c.landed(0, 200, 300, newer)
    older = c.to_write(0, 0, 200)  # blocks 0 and 1 (block 1 only 72 valid): only block 0 is better
    assert older.tolist() == [0]
    c.landed(0, 0, 200, older)
    assert c.complete and c.layers_done() == 1


def test_the_decodes_own_prefix_blocks_are_never_written():
    c = Coverage(num_layers=2, num_tokens=300, block_size=128, first_block=2)
    assert c.to_write(0, 0, 300).tolist() == [2]
    assert not c.complete
    for layer in (0, 1):
        c.landed(layer, 0, 300, c.to_write(layer, 0, 300))
    assert c.complete


def test_two_groups_of_different_block_sizes_need_only_their_non_null_blocks():
    # group 0: full attention, 4-token blocks; group 1: a sliding window, 8-token blocks, its leading
    # blocks outside the window the decode's null block
    full = Coverage(num_layers=2, num_tokens=20, block_size=4, block_ids=[5, 6, 7, 8, 9])
    window = Coverage(num_layers=1, num_tokens=20, block_size=8, block_ids=[0, 0, 11])
    assert window.needed.tolist() == [0, 0, 4]
    assert window.to_write(0, 0, 12).tolist() == []  # blocks 0, 1: null, never written
    assert window.to_write(0, 12, 20).tolist() == [1]  # of blocks_of(12, 20, 8) = blocks 1 (null) and 2: block 2
    assert full.to_write(0, 0, 12).tolist() == [0, 1, 2]
    window.landed(0, 12, 20, window.to_write(0, 12, 20))
    assert window.complete and not full.complete
    for layer in (0, 1):
        full.landed(layer, 0, 20, full.to_write(layer, 0, 20))
    assert full.complete and full.layers_done() == 2


def test_after_null_blocks_and_a_prefix_hit_only_the_rest_is_written():
    c = Coverage(num_layers=1, num_tokens=300, block_size=128, first_block=2, block_ids=[0, 4, 6])
    assert c.to_write(0, 0, 300).tolist() == [2]
    c.landed(0, 0, 300, c.to_write(0, 0, 300))
    assert c.complete


@settings(max_examples=200, deadline=None)
@given(num_tokens=st.integers(1, 700), block_size=st.sampled_from([4, 16, 128]), seed=st.integers(0, 2**31))
def test_any_chunking_landing_in_any_order_leaves_every_block_from_its_fullest_copy(num_tokens, block_size, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, num_tokens), min(num_tokens - 1, rng.randint(0, 5))))
    bounds = [0, *cuts, num_tokens]
    ranges = [(0 if i == 0 else bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    order = ranges[:]
    rng.shuffle(order)
    c = Coverage(1, num_tokens, block_size)
    nblocks = -(-num_tokens // block_size)
    written_by = torch.full((nblocks,), -1)  # the end of the range whose copy each block holds
    for start, end in order:
        idx = c.to_write(0, start, end)
        written_by[blocks_of(start, end, block_size).start + idx] = end
        c.landed(0, start, end, idx)
    assert c.complete
    for b in range(nblocks):  # each block holds the copy of the first range that covers its last token
        last = min((b + 1) * block_size, num_tokens) - 1
        want = min(end for start, end in ranges if end > last)
        assert written_by[b] == want
