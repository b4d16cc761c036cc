"""Tensor-parallel sparse decode over gloo rank processes: rank 0 leads (``LeadDecoder``), the other
ranks repeat every state change and step on their own shard, over rank 0's pool (attached:
``kvcore.pool.attached``; one pool per DP rank) (``kvoffload_engine.tp_decode``).

Rank 0 runs the single-process engine with its decoder swapped for the leader over a sharded copy
of the model; the prompt's rows it installs go to the followers along. Against the one-rank engine
in float32 (another TP size sums its partials in another order: equal to rounding, not bits): the
same tokens, greedy and sampled, with MTP drafting off and on, over a batch that changes while it
runs and a hot buffer small enough to miss; logits to 1e-4. Every follower ran every step and ends
with nothing held, having used rank 0's pool."""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from engine_support import seeded_prompt, tiny

from dsamodel.tp import DistGroup, shard_model
from kvcore.pool.attached import AttachedPool
from kvoffload_engine.decode import SparseDecoder
from kvoffload_engine.engine import Engine, EngineConfig
from kvoffload_engine.tp_channel import DistChannel
from kvoffload_engine.tp_decode import LeadDecoder, follow_decode
from openai_api.sampling_params import SamplingParams

BS = 16
DECODER = dict(topk_buffer_size=64, max_num_seqs=3, max_model_len=1024)  # 64 == index_topk: it misses
REQUESTS = [
    ("a", 300, SamplingParams(max_tokens=24)),
    ("b", 45, SamplingParams(max_tokens=8)),
    ("c", 130, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=5)),
]
LATE = ("d", 200, SamplingParams(max_tokens=12))  # joins at step 5; a, b, c hold all 3 slots, so it waits


def _run(eng: Engine) -> tuple[dict, list]:
    """The schedule on ``eng``: output tokens per request and the logits of every step."""
    steps = []
    real_forward = eng.decoder.forward

    def recording_forward(ids, tokens):
        out = real_forward(ids, tokens)
        steps.append((list(ids), out[0].clone()))
        return out

    eng.decoder.forward = recording_forward
    seqs = [eng.add_request(rid, seeded_prompt(n, i + 1), p) for i, (rid, n, p) in enumerate(REQUESTS)]
    for i in range(200):
        if i == 5:
            seqs.append(eng.add_request(LATE[0], seeded_prompt(LATE[1], 9), LATE[2]))
        eng.step()
        if not (eng.waiting or eng.running):
            break
    assert not eng.decoder.seqs and eng.decode_pool.stats().used_blocks == 0
    return {s.request_id: s.output_ids for s in seqs}, steps


def _config(mtp: bool) -> EngineConfig:
    return EngineConfig(
        block_size=BS,
        max_model_len=DECODER["max_model_len"],
        max_num_seqs=DECODER["max_num_seqs"],
        chunk_size=128,
        buffers=2,
        topk_buffer_size=DECODER["topk_buffer_size"],
        prefill_pool_bytes=16 << 20,
        decode_pool_bytes=16 << 20,
        num_speculative_tokens=int(mtp),
    )


def _lead_engine(model, sharded, channel, size: int, mtp: bool) -> Engine:
    """The one-rank engine (its prefill on the whole model) with the decoder led over ``sharded``."""
    eng = Engine(model, _config(mtp))
    eng.decoder = LeadDecoder(sharded, eng.decode_pool, channel=channel, size=size, **DECODER)
    return eng


def _share_pool(name: str | None = None) -> str:
    """Rank 0's decode pool segment, sent to every follower (they attach it: one pool per DP rank)."""
    import torch.distributed as dist

    names = [name]
    dist.broadcast_object_list(names, src=0)
    assert names[0] is not None
    return names[0]


def _rank(rank: int, size: int, mtp: bool, init: str, out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=timedelta(seconds=60))
    try:
        sharded = shard_model(copy.deepcopy(tiny(torch.float32)), DistGroup())
        if rank == 0:
            eng = _lead_engine(tiny(torch.float32), sharded, DistChannel(), size, mtp)
            _share_pool(eng.decode_pool.segment.name)
            try:
                tokens, steps = _run(eng)
                out[0] = (tokens, steps, eng.decoder.steps_sent, eng.num_drafts, eng.num_accepted)
                out["pool"] = (eng.decode_pool.segment.name, eng.decode_pool.stats().used_blocks)
                eng.decoder.close_followers()
            finally:
                eng.close()
        else:
            pool = AttachedPool.attach(_share_pool())
            try:
                dec = SparseDecoder(sharded, pool, **DECODER)
                n = follow_decode(dec, DistChannel())
                out[rank] = (n, len(dec.seqs), pool.stats().used_blocks, pool.segment.name)
            finally:
                pool.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("size", "mtp"), [(2, False), (2, True), (4, True)], ids=["tp2", "tp2-mtp", "tp4-mtp"])
def test_followers_repeat_every_step_and_the_tokens_are_one_ranks(tmp_path, size, mtp):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(size, mtp, f"file://{tmp_path}/rendezvous", out), nprocs=size, join=True)
        got = dict(out)
    tokens, steps, sent, drafts, accepted = got[0]
    segment, used = got["pool"]
    # every step, nothing held, rank 0's pool the one every follower used
    assert [got[r] for r in range(1, size)] == [(sent, 0, 0, segment)] * (size - 1)
    assert used == 0
    eng = Engine(tiny(torch.float32), _config(mtp))
    try:
        want_tokens, want_steps = _run(eng)
        want_drafts = (eng.num_drafts, eng.num_accepted)
    finally:
        eng.close()
    assert tokens == want_tokens
    assert (drafts, accepted) == want_drafts and (drafts > 0) == mtp
    assert len(steps) == len(want_steps) == sent > 20
    assert any(len(ids) == 3 for ids, _ in steps)  # a full batch
    assert "d" not in steps[0][0] and any("d" in ids for ids, _ in steps)  # d joined late
    for (ids, lg), (want_ids, want_lg) in zip(steps, want_steps, strict=True):
        assert ids == want_ids
        assert torch.allclose(lg, want_lg, rtol=1e-4, atol=1e-5), (ids, (lg - want_lg).abs().max())


def _dying_rank(rank: int, size: int, init: str, out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=timedelta(seconds=30))
    sharded = shard_model(copy.deepcopy(tiny(torch.float32)), DistGroup())
    if rank == 0:
        eng = _lead_engine(tiny(torch.float32), sharded, DistChannel(), size, mtp=False)
        _share_pool(eng.decode_pool.segment.name)
        errors = []
        for _ in range(2):
            try:
                _run(eng)
            except BaseException as exc:  # noqa: BLE001 - recorded and checked by the test
                errors.append(f"{type(exc).__name__}: {exc}")
        out[0] = (errors, eng.decoder.broken)
    else:
        dec = SparseDecoder(sharded, AttachedPool.attach(_share_pool()), **DECODER)
        real = dec.forward
        calls = iter(range(1000))

        def dying_forward(ids, tokens):
            if next(calls) == 3:
                os._exit(0)  # the rank dies in its fourth step (a code of 0: spawn would kill rank 0 otherwise)
            return real(ids, tokens)

        dec.forward = dying_forward
        follow_decode(dec, DistChannel())
    os._exit(0)  # the group is broken: no orderly teardown (gloo's destructors may abort on it)


def test_a_follower_that_dies_breaks_the_group_loudly_and_never_hangs(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_dying_rank, args=(2, f"file://{tmp_path}/rendezvous", out), nprocs=2, join=True)
        got = dict(out)
    (first, second), broken = got[0]
    assert first and broken, (first, broken)  # the step (or the message before it) failed: the peer is gone
    assert second.startswith("TPGroupBroken: the 2 TP decode ranks are out of step"), second
