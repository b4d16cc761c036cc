"""Decode on a top-k trace: the override drives the hot cache, I2 still holds, mapping errors are
clear. (The decode bench on a trace: libs/dsamodel/tests/test_bench.py.)"""

from __future__ import annotations

import threading

import pytest
import torch
from engine_support import decode_pool, hand_trace, tiny

from dsamodel.model import DecoderLayer
from kvcore.traces import SyntheticParams, Trace, generate
from kvoffload_engine.decode import SparseDecoder
from kvoffload_engine.trace_topk import TraceTopK

BS = 16
K = 64  # the tiny preset's index_topk


def _decoders(model, keeps, *, override=None, topk_buffer_size=K, max_num_seqs=2, max_model_len=512):
    pools = [decode_pool(model, BS) for _ in keeps]
    decs = [
        SparseDecoder(
            model,
            p,
            topk_buffer_size=topk_buffer_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            keep_device_kv_cache=keep,
            topk_override=override,
        )
        for p, keep in zip(pools, keeps)
    ]
    return decs, pools


def _install(decs, model, ids, prompt_len, seed=0):
    """The same seeded prompt KV into every decoder (no prefill)."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    for dec in decs:
        for rid in ids:
            dec.admit(rid, prompt_len + 1)
    for layer in range(len(model.cache_layers)):
        for rid in ids:
            kv = torch.randn(prompt_len, cfg.kv_row_width, generator=gen).to(model.dtype)
            index_k = torch.randn(prompt_len, cfg.index_head_dim, generator=gen).to(model.dtype)
            for dec in decs:
                dec.write_prompt_layer(rid, layer, kv, index_k)
    for dec in decs:
        for rid in ids:
            dec.set_prompt_done(rid, prompt_len)


def _close(pools):
    for p in pools:
        p.close()


def test_override_drives_the_hot_cache(monkeypatch):
    """The hot cache holds, misses and hits exactly what the trace selects; the indexer still runs."""
    model = tiny(torch.float32, False)
    trace = hand_trace()
    ids = ["a", "b"]
    override = TraceTopK(trace, ids, num_layers=4)
    calls, indexer_calls = [], []
    real_indexer = DecoderLayer.select_batched

    def counting_indexer(*a, **kw):
        indexer_calls.append(1)
        return real_indexer(*a, **kw)

    def recording(layer, row_ids, positions):
        calls.append((layer, list(row_ids), positions.tolist()))
        return override(layer, row_ids, positions)

    monkeypatch.setattr(DecoderLayer, "select_batched", counting_indexer)
    (dec, plain), pools = _decoders(model, [False, False])
    dec.topk_override = recording
    try:
        _install([dec, plain], model, ids, 200)
        tokens = torch.tensor([5, 9])
        for t in range(3):
            dec.step(ids, tokens)
            plain.step(ids, tokens)
            st = dec.last_step
            assert calls[-4:] == [(layer, ids, [200 + t, 200 + t]) for layer in range(4)]
            for layer in range(4):
                assert st.layer_misses[layer] == 2 * (K if t == 0 else 16)  # step 0 cold, then 16 new per step
                assert st.layer_hits[layer] == 2 * (0 if t == 0 else K - 16)
                for r, rid in enumerate(ids):
                    chosen = set(trace.topk[override.streams()[r, layer], t].tolist())
                    assert set(dec.hotcache.residency(rid, layer)) == chosen  # capacity == k: exactly the set
                    # the indexer would have chosen otherwise (the check above means something)
                    assert set(plain.hotcache.residency(rid, layer)) != chosen
            assert st.h2d_bytes == st.misses * model.config.kv_row_width * 4
        assert len(calls) == 12 and len(indexer_calls) == 24  # the indexer ran in every layer of both decoders
    finally:
        _close(pools)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_i2_holds_on_a_trace(dtype):
    """Sparse offload and keep_device_kv_cache replay the same trace bit for bit, drafts included; the
    keep path really uses the override (its logits differ without it)."""
    model = tiny(dtype, True)  # MTP: 5 cache layers
    trace = generate(
        SyntheticParams(
            overlap=0.8, k=K, context0=256, steps=8, layers=5, requests=2, sinks=4, recent=8, heavy=8, seed=3
        ),
        "syn",
    )
    ids = ["a", "b"]
    override = TraceTopK(trace, ids, num_layers=5)
    (sparse, keep, keep_plain), pools = _decoders(model, [False, True, True], override=override)
    keep_plain.topk_override = None
    try:
        _install([sparse, keep, keep_plain], model, ids, 255)
        tokens = torch.tensor([3, 7])
        differs = 0
        for _ in range(5):
            ls, lk, lp = (d.step(ids, tokens) for d in (sparse, keep, keep_plain))
            assert torch.equal(ls, lk)
            differs += not torch.equal(lk, lp)
            tokens = ls.argmax(-1)
        assert differs == 5
        assert sparse.last_step.misses > 0 and sparse.last_step.hits > 0
        # a draft for "a" (written, not committed) then its rewrite: the speculative path on the trace
        drafts = [[int(tokens[0]), 11], [int(tokens[1])]]
        (ls, _), (lk, _) = sparse.forward(ids, drafts), keep.forward(ids, drafts)
        assert torch.equal(ls, lk) and ls.shape[0] == 3
        for d in (sparse, keep):
            for rid in ids:
                d.commit(rid, d.seqs[rid].num_tokens + 1)  # the draft rejected
        assert torch.equal(sparse.step(ids, torch.tensor([1, 2])), keep.step(ids, torch.tensor([1, 2])))
    finally:
        _close(pools)


def test_policies_change_traffic_never_results():
    """I2 across hot-cache policies: LRU and SLRU decoders give bit-identical logits on a trace with
    returning entries and a buffer larger than k, while their misses differ (the choice is real)."""
    model = tiny(torch.float32, False)
    trace = generate(
        SyntheticParams(
            overlap=0.8, k=K, context0=512, steps=12, layers=4, requests=2, sinks=4, recent=8, heavy=8, span=4, seed=5
        ),
        "syn",
    )
    ids = ["a", "b"]
    override = TraceTopK(trace, ids, num_layers=4)
    pools = [decode_pool(model, BS) for _ in range(2)]
    decs = [
        SparseDecoder(
            model,
            p,
            topk_buffer_size=80,
            max_num_seqs=2,
            max_model_len=640,
            topk_override=override,
            hot_cache_policy=policy,
        )
        for p, policy in zip(pools, ("lru", "slru"))
    ]
    try:
        _install(decs, model, ids, 511)
        tokens = torch.tensor([3, 7])
        misses = [0, 0]
        for _ in range(11):
            out = [d.step(ids, tokens) for d in decs]
            assert torch.equal(out[0], out[1])
            misses = [m + d.last_step.misses for m, d in zip(misses, decs)]
            tokens = out[0].argmax(-1)
        assert misses[0] != misses[1]
        assert decs[1].hotcache.policy == "slru" and decs[0].hotcache.policy == "lru"
    finally:
        _close(pools)


def test_miss_prefetch_changes_where_rows_come_from_never_results():
    """I2 with miss prefetch on and off: a trace whose every layer selects what the layer below did
    (so from the second step on each miss of layers 1.. was loaded early, exactly: the first step has
    no miss counts to size a budget from), the indexer's own choice (mostly wrong predictions), and
    a draft step (prefetch off inside it): logits bit-identical to the prefetch-off decoder and to
    keep_device_kv_cache throughout."""
    model = tiny(torch.float32, False)  # 4 cache layers
    trace = hand_trace(requests=2, layers=1, context0=301, steps=6, new=12, seed=1)
    ids = ["a", "b"]
    override = TraceTopK(trace, ids, num_layers=4, layers=[0, 0, 0, 0])  # every layer: the same selection
    pools = [decode_pool(model, BS) for _ in range(3)]
    decs = [
        SparseDecoder(
            model,
            p,
            topk_buffer_size=K,
            max_num_seqs=2,
            max_model_len=512,
            topk_override=override,
            keep_device_kv_cache=keep,
            miss_prefetch=pf,
        )
        for p, (keep, pf) in zip(pools, ((False, True), (False, False), (True, False)))
    ]
    on, off, keep = decs
    assert on.prefetcher is not None and off.prefetcher is None
    on.prefetcher.wait_s = 60.0  # loads are never late here: the counts below are exact
    try:
        _install(decs, model, ids, 300)
        tokens = torch.tensor([3, 7])
        for t in range(5):
            out = [d.step(ids, tokens) for d in decs]
            assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])
            s_on, s_off = on.last_step, off.last_step
            assert (s_on.hits, s_on.misses, s_on.h2d_bytes) == (s_off.hits, s_off.misses, s_off.h2d_bytes)
            if t == 0:
                assert s_on.prefetched == s_on.prefetch_hits == 0 and s_on.misses == 4 * 2 * K
            else:
                assert s_on.prefetch_hits == s_on.prefetched == sum(s_on.layer_misses[i] for i in (1, 2, 3)) == 72
            assert s_on.prefetch_late == 0 and s_off.prefetched == s_off.prefetch_hits == 0
            tokens = out[0].argmax(-1)
        for d in decs:  # the indexer's own choice: predictions mostly wrong, results still equal
            d.topk_override = None
        drafts = [[int(tokens[0]), 11], [int(tokens[1])]]
        outs = [d.forward(ids, drafts)[0] for d in decs]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        assert on.last_step.prefetched == 0  # no prefetch in a step with drafts
        for d in decs:
            for rid in ids:
                d.commit(rid, d.seqs[rid].num_tokens + 1)
        for _ in range(3):
            out = [d.step(ids, tokens) for d in decs]
            assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])
            tokens = out[0].argmax(-1)
        assert on.last_step.prefetched > 0
    finally:
        on.prefetcher.close()
        _close(pools)


def test_a_late_prefetch_is_dropped_never_waited_for():
    """The critical path does not wait (wait_s 0): a load still queued when its layer resolves is
    dropped and counted; the rows then come from the host pool and the logits are unchanged."""
    model = tiny(torch.float32, False)
    trace = hand_trace(requests=1, layers=1, context0=301, steps=4, new=12, seed=2)
    override = TraceTopK(trace, ["a"], num_layers=4, layers=[0, 0, 0, 0])
    pools = [decode_pool(model, BS) for _ in range(2)]
    on, off = (
        SparseDecoder(
            model, p, topk_buffer_size=K, max_num_seqs=1, max_model_len=512, topk_override=override, miss_prefetch=pf
        )
        for p, pf in zip(pools, (True, False))
    )
    gate = threading.Event()
    try:
        _install([on, off], model, ["a"], 300)
        tokens = torch.tensor([5])
        assert torch.equal(on.step(["a"], tokens), off.step(["a"], tokens))
        on.prefetcher._pool.submit(gate.wait)  # the loader thread is busy until the step is over
        assert torch.equal(on.step(["a"], tokens), off.step(["a"], tokens))
        st = on.last_step
        assert st.prefetched > 0 and st.prefetch_late == 3 and st.prefetch_hits == 0 and on.prefetcher.late == 3
        assert (st.hits, st.misses) == (off.last_step.hits, off.last_step.misses)
    finally:
        gate.set()
        on.prefetcher.close()
        _close(pools)


def test_mapping_errors():
    trace = hand_trace(requests=2, groups=2, layers=3, context0=201, steps=2)
    with pytest.raises(ValueError, match=r"4 \(request, group\) stream pairs; the engine needs one per request: 5"):
        TraceTopK(trace, ["a", "b", "c", "d", "e"], num_layers=3)
    with pytest.raises(
        ValueError,
        match=r"has 3 layers \(0\.\.2\); the model's 4 cache layers need "
        r"trace layer\(s\) 3",
    ):
        TraceTopK(trace, ["a"], num_layers=4)
    with pytest.raises(ValueError, match=r"no \(request, group\) pair \(5, 0\)"):
        TraceTopK(trace, {"a": (5, 0)}, num_layers=3)
    ov = TraceTopK(trace, ["a", "b", "c"], num_layers=3)
    assert ov.pairs == [(0, 0), (0, 1), (1, 0)] and ov.prompt_len("c") == 200
    got = ov(2, ["c", "a"], torch.tensor([201, 200]))  # request 1 group 0 at step 1, request 0 group 0 at step 0
    s = ov.streams()
    assert torch.equal(got, torch.stack((trace.topk[s[2, 2], 1], trace.topk[s[0, 2], 0])).long())
    assert got.dtype == torch.long
    with pytest.raises(ValueError, match="needs step 2 of trace 'hand', which has steps 0..1 .*too few steps"):
        ov(0, ["a"], torch.tensor([202]))
    with pytest.raises(ValueError, match="needs step -1 .*shorter than context0 - 1"):
        ov(0, ["a"], torch.tensor([199]))
    with pytest.raises(ValueError, match="request 'zz' has no stream pair"):
        ov(0, ["zz"], torch.tensor([200]))
    with pytest.raises(ValueError, match="cache layer 3 is outside the 3 layers"):
        ov(3, ["a"], torch.tensor([200]))
    ragged = Trace(
        "ragged", trace.topk, trace.context0 + (trace.layers == 1).long(), trace.layers, trace.requests, trace.groups
    )
    with pytest.raises(ValueError, match="start at different contexts"):
        TraceTopK(ragged, ["a"], num_layers=3).prompt_len("a")


def test_decoder_checks_what_the_override_returns():
    model = tiny(torch.float32, False)
    ids = ["a", "b"]
    (dec,), pools = _decoders(model, [False])
    try:
        _install([dec], model, ids, 100)
        bad = {
            "shape": lambda layer, r, p: torch.zeros(len(r), K - 1, dtype=torch.long),
            "float": lambda layer, r, p: torch.zeros(len(r), K),
            "future": lambda layer, r, p: p[:, None].expand(-1, K) + 1,
            "negative": lambda layer, r, p: torch.full((len(r), K), -2),
        }
        msgs = {
            "shape": r"integer \[N, k\] = \[2, 64\] tensor, got torch.int64 \[2, 63\]",
            "float": "got torch.float32",
            "future": r"selects 101, outside \[0, 100\]",
            "negative": r"selects -2, outside \[0, 100\]",
        }
        for name, fn in bad.items():
            dec.topk_override = fn
            with pytest.raises(ValueError, match=msgs[name]):
                dec.forward(ids, [[1], [2]])
        # the end of a trace is an error through the decoder too, not a silent fallback to the indexer
        dec.topk_override = TraceTopK(hand_trace(context0=101, steps=1), ids, num_layers=4)
        dec.step(ids, torch.tensor([1, 2]))
        with pytest.raises(ValueError, match="too few steps"):
            dec.step(ids, torch.tensor([1, 2]))
    finally:
        _close(pools)
