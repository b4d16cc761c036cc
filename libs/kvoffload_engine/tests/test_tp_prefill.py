"""Tensor-parallel prefill over gloo rank processes: rank 0 runs the engine (pool, buffers, first
token), the other ranks follow it layer by layer (``kvoffload_engine.tp_prefill``). Against the
one-rank engine in float32 (a TP size sums its partials in another order: equal to rounding, not
bits): the same first tokens, MTP drafts, prefix-cache hits and logits to 1e-4, over chunked
prompts, a prefix hit, a request its decode gave up in the middle (the followers drop that chunk
and stay in step) and the request after it."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from engine_support import prefill_engine, prefill_pool, seeded_prompt, tiny

from dsamodel.tp import DistGroup, shard_model
from kvoffload_engine.prefill import PrefillError, PrefillRequest
from kvoffload_engine.tp_channel import DistChannel
from kvoffload_engine.tp_prefill import Followers, follow

BS = 4
CHUNK = 3 * BS + 1
PROMPTS = {"a": seeded_prompt(11 * BS + 2, 1), "b": seeded_prompt(9 * BS, 2), "c": seeded_prompt(5 * BS + 1, 3)}
# chunks the followers run to the end: a (46 tokens) 4, a again (44 cached) 1, b stopped in its
# second chunk 1, c 2
FOLLOWED_CHUNKS = 8


def _scenario(model, followers=None) -> list:
    pool = prefill_pool(model, BS)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=CHUNK, followers=followers)
    out = []
    try:
        for rid in ("a", "a2", "b", "c"):
            prompt = PROMPTS[rid[0]]
            calls = itertools.count()
            gone = (lambda c=calls: "the decode went away" if next(c) >= 6 else "") if rid == "b" else None
            try:
                res = eng.run(PrefillRequest(rid, prompt, cancelled=gone))
            except PrefillError as exc:
                out.append((rid, "stopped", "the decode went away" in str(exc)))
                continue
            out.append(
                (rid, res.first_token, int(torch.argmax(res.draft_logits)), res.num_cached_tokens, res.logits.clone())
            )
            eng.release(res)
        assert pool.stats().live_leases == 0 and eng.gates.stats()["held_slots"] == 0
        return out
    finally:
        eng.close()
        pool.close()


def _rank(rank: int, size: int, init: str, out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=timedelta(seconds=60))
    try:
        model = shard_model(tiny(torch.float32), DistGroup())
        if rank == 0:
            followers = Followers(DistChannel(), size)
            out[0] = _scenario(model, followers)
            followers.close()
        else:
            out[rank] = follow(model, DistChannel())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_followers_keep_step_and_the_engine_answers_as_one_rank_does(tmp_path, size):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(size, f"file://{tmp_path}/rendezvous", out), nprocs=size, join=True)
        got = dict(out)
    assert [got[r] for r in range(1, size)] == [FOLLOWED_CHUNKS] * (size - 1)
    want = _scenario(tiny(torch.float32))
    assert [w[:4] for w in want] == [g[:4] for g in got[0]]  # tokens, drafts, cached, who stopped
    assert want[1][3] == 11 * BS and want[2] == ("b", "stopped", True)
    for w, g in zip(want, got[0], strict=True):
        if len(w) == 5:
            assert torch.allclose(w[4], g[4], rtol=1e-4, atol=1e-5), (w[0], (w[4] - g[4]).abs().max())


def _broken_rank(rank: int, size: int, init: str, out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=timedelta(seconds=3))
    model = shard_model(tiny(torch.float32), DistGroup())
    if rank == 0:
        followers = Followers(DistChannel(), size)
        pool = prefill_pool(model, BS)
        eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=CHUNK, followers=followers)
        layer = model.cache_layers[1]
        real = layer.project
        layer.project = lambda *a: (_ for _ in ()).throw(MemoryError("rank 0 ran out of memory"))
        errors = []
        for rid in ("x", "y"):
            try:
                eng.run(PrefillRequest(rid, PROMPTS["c"]))
            except BaseException as exc:  # noqa: BLE001 - recorded and checked by the test
                errors.append(f"{type(exc).__name__}: {exc}")
        layer.project = real
        out[0] = errors
        eng.close()
        pool.close()
    else:
        try:
            follow(model, DistChannel())
            out[rank] = "returned"
        except RuntimeError as exc:  # its reduction timed out: rank 0 never joined it
            out[rank] = f"timed out: {type(exc).__name__}"
    import os

    os._exit(0)  # the group is broken: no orderly teardown (gloo's destructors may abort on it)


def test_a_failure_inside_a_layer_breaks_the_group_loudly_never_silently(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_broken_rank, args=(2, f"file://{tmp_path}/rendezvous", out), nprocs=2, join=True)
        got = dict(out)
    first, second = got[0]
    assert first.startswith("MemoryError: rank 0 ran out of memory"), first
    assert second.startswith("TPGroupBroken: the 2 TP ranks are out of step"), second
    assert got[1].startswith("timed out"), got[1]


def _dying_rank(rank: int, size: int, init: str, out: dict) -> None:
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=timedelta(seconds=30))
    model = shard_model(tiny(torch.float32), DistGroup())
    channel = DistChannel()
    if rank == 1:  # dies in the middle of the first chunk: rank 0 is about to need it in a reduction
        assert channel.recv()[0] == "chunk" and channel.recv()[0] == "layer"
        os._exit(3)
    pool = prefill_pool(model, BS)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=CHUNK, followers=Followers(channel, size))
    errors = []
    for rid in ("x", "y"):
        try:
            eng.run(PrefillRequest(rid, PROMPTS["c"]))
        except BaseException as exc:  # noqa: BLE001 - recorded and checked by the test
            errors.append(type(exc).__name__)
    out[0] = (errors, eng.gates.stats()["held_slots"], pool.stats().live_leases)
    eng.close()
    pool.close()
    os._exit(0)  # the group is broken: no orderly teardown


def test_a_follower_that_dies_fails_the_request_and_leaves_nothing_held(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        ctx = mp.spawn(_dying_rank, args=(2, f"file://{tmp_path}/rendezvous", out), nprocs=2, join=False)
        for p in ctx.processes:
            p.join(120)
        got = dict(out)
    errors, held_slots, live_leases = got[0]
    assert errors[0] != "TPGroupBroken" and errors[1] == "TPGroupBroken", errors
    assert held_slots == 0 and live_leases == 0


def _contributor_rank(rank: int, size: int, init: str, names: list[str], out: dict) -> None:
    import torch.distributed as dist

    from kvcore.pool.segment import SharedSegment

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=timedelta(seconds=60))
    try:
        model = shard_model(tiny(torch.float32), DistGroup())
        if rank != 0:
            out[rank] = follow(model, DistChannel())
            return
        followers = Followers(DistChannel(), size)
        pool = prefill_pool(model, BS)
        eng = prefill_engine(
            model, pool, buffers=2, independent=[0], chunk_size=CHUNK, followers=followers, buffer_segment=names[0]
        )
        followers.buffers(eng.plan, eng.buffers.num_blocks, names[1:])
        theirs = [SharedSegment.attach(n) for n in names[1:]]
        compared, unequal = [], 0

        def announce(ticket, req, start, end):  # every follower's rows are in place when rank 0 announces
            nonlocal unequal
            for (slot, _kind), p in eng.buffers.plane_of.items():
                if slot != eng.plan.slot_of(ticket.layer):
                    continue
                row_bytes = eng.buffers.segment.plane(p).shape[-1]
                mine = eng.buffers.segment.plane(p).reshape(-1, row_bytes)[start:end]
                unequal += sum(not torch.equal(mine, seg.plane(p).reshape(-1, row_bytes)[start:end]) for seg in theirs)
            compared.append((req.request_id, ticket.layer, start, end))
            for reader in ticket.readers:
                ticket.read_done(reader)

        eng.announce = announce
        try:
            for rid in ("a", "a2", "c"):
                res = eng.run(PrefillRequest(rid, PROMPTS[rid[0]], readers=frozenset({(rid, "decode")})))
                eng.release(res)
            out[0] = (compared, unequal)
            for seg in theirs:
                seg.close()
            followers.close()
        finally:
            eng.close()
            pool.close()
    finally:
        dist.destroy_process_group()


def test_every_follower_holds_rank_0s_rows_when_a_layer_is_announced(tmp_path):
    import uuid

    from kvcore.pool.segment import SharedSegment

    size = 4
    names = [f"kvoffload-test-tp-{uuid.uuid4().hex[:8]}-{r}" for r in range(size)]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_contributor_rank, args=(size, f"file://{tmp_path}/rendezvous", names, out), nprocs=size, join=True)
        got = dict(out)
    compared, unequal = got[0]
    layers = len(tiny(torch.float32).cache_layers)
    # a: 4 chunks; a2: the prefix hit and its last chunk; c: 2 chunks; every layer of each
    assert len(compared) == (4 + 1 + 2) * layers and unequal == 0
    assert ("a2", 0, 0, 11 * BS + 2) in compared  # the prefix loaded from the pool is announced, and held, too
    assert [got[r] for r in range(1, size)] == [7] * (size - 1)
    for name in names:  # each rank removed its segment on the way out
        with pytest.raises(FileNotFoundError):
            SharedSegment.attach(name)
