"""A prefill's compute and its settling: the next request computes while the last saves run, a
prompt that shares a prefix with one still saving waits for it, a failed save fails at settle."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_support import prefill_engine, prefill_pool, seeded_prompt, tiny

from kvoffload_engine.prefill import PrefillError, PrefillRequest

BS = 16


class _Seen(list):
    """What happened to the held save, in order; ``held`` is set once it waits."""

    def __init__(self) -> None:
        super().__init__()
        self.held = threading.Event()


def _hold_save(pool, layer: int, until: threading.Event, timeout_s: float = 20.0) -> _Seen:
    """The pool's first save of ``layer`` waits for ``until`` (and fails if it never comes)."""
    plane, put, seen = pool.geometry.plane_index(layer, "main"), pool.put_planes_from, _Seen()

    def held_put(keys, srcs):
        if plane in srcs and not seen:
            seen.append("held")
            seen.held.set()
            if not until.wait(timeout_s):
                seen.append("timed out")
                raise RuntimeError("the save was never let go")
            seen.append("let go")
        return put(keys, srcs)

    pool.put_planes_from = held_put
    return seen


def test_the_next_request_computes_while_the_last_saves_of_one_settle():
    """``compute`` returns with the last layer's save still running; the next request's first layer
    (its own slot) is computed before that save ends, and both settle into the results ``run`` gives."""
    model = tiny(torch.float32, True)
    pool = prefill_pool(model, BS)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=64)
    last = model.cache_layers[-1].cache_index
    b_started = threading.Event()
    seen = _hold_save(pool, last, b_started)

    def announce(ticket, req, start, end):
        for reader in ticket.readers:
            ticket.read_done(reader)
        if req.request_id == "b" and ticket.layer == 0:
            b_started.set()

    eng.announce = announce
    a_prompt, b_prompt = seeded_prompt(3 * BS + 5, seed=31), seeded_prompt(2 * BS + 3, seed=32)
    try:
        a = eng.compute(PrefillRequest("a", a_prompt, readers=frozenset({"decode"})))
        assert seen.held.wait(10) and not a.saved.done()
        b = eng.compute(PrefillRequest("b", b_prompt, readers=frozenset({"decode"})))
        res_a, res_b = a.settle(), b.settle()
        assert seen == ["held", "let go"]
        eng.release(res_a)
        eng.release(res_b)
        assert pool.stats().live_leases == 0 and eng.gates.stats()["held_slots"] == 0
    finally:
        eng.close()
        pool.close()
    assert torch.equal(res_a.logits, _alone(model, a_prompt)) and torch.equal(res_b.logits, _alone(model, b_prompt))


def _alone(model, prompt: torch.Tensor) -> torch.Tensor:
    """The logits of ``prompt`` run alone on an engine of its own (same chunks, no prefix cache)."""
    pool = prefill_pool(model, BS)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=64)
    try:
        res = eng.run(PrefillRequest("alone", prompt))
        eng.release(res)
        return res.logits
    finally:
        eng.close()
        pool.close()


def test_a_prompt_sharing_a_prefix_with_one_still_saving_finds_it_cached():
    """The pool lists a block only once every plane is written, so a prompt that shares a prefix
    with a request still saving waits for those saves, and then finds the prefix cached (one that
    shares nothing does not wait: the test above)."""
    model = tiny(torch.float32, True)
    pool = prefill_pool(model, BS)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=64)
    let_go = threading.Event()
    seen = _hold_save(pool, model.cache_layers[-1].cache_index, let_go)
    shared = seeded_prompt(4 * BS, seed=41)
    try:
        a = eng.compute(PrefillRequest("a", shared))
        assert seen.held.wait(10) and not a.saved.done()
        timer = threading.Timer(0.3, let_go.set)
        timer.start()
        b = eng.compute(PrefillRequest("b", torch.cat((shared, seeded_prompt(BS, seed=43)))))
        assert seen == ["held", "let go"]
        results = [c.settle() for c in (a, b)]
        assert results[1].num_cached_tokens == 4 * BS
        for res in results:
            eng.release(res)
        assert pool.stats().live_leases == 0
    finally:
        let_go.set()
        eng.close()
        pool.close()


def test_a_save_that_fails_after_compute_fails_the_request_at_settle_and_leaves_nothing():
    """A save failing once ``compute`` returned: ``settle`` raises PrefillError naming the request,
    its objects are removed (but complete hash blocks, which stay cached), no lease or slot is held,
    and the engine serves the next request."""
    model = tiny(torch.float32, True)
    pool = prefill_pool(model, BS)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=64)
    never = threading.Event()
    seen = _hold_save(pool, model.cache_layers[-1].cache_index, never, timeout_s=0.2)
    prompt = seeded_prompt(3 * BS + 5, seed=51)
    try:
        computed = eng.compute(PrefillRequest("a", prompt))
        assert seen.held.wait(10)
        with pytest.raises(PrefillError, match="saving request a to the host pool failed.*never let go"):
            computed.settle()
        assert seen == ["held", "timed out"]
        assert pool.stats().live_leases == 0 and eng.gates.stats()["held_slots"] == 0
        assert pool.stats().complete_objects == 0  # the last layer of every block went unwritten
        res = eng.run(PrefillRequest("b", prompt))
        assert res.num_cached_tokens == 0
        eng.release(res)
        assert pool.stats().live_leases == 0
    finally:
        eng.close()
        pool.close()
