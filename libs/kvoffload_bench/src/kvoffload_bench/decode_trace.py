"""The decode bench's trace mode (``kvoffload bench decode --trace NAME``; ``kvoffload_bench.decode``'s
docstring): a synthetic or recorded top-k trace replayed by three ``SparseDecoder``s (sparse, keep,
sparse with miss prefetch) over installed prompt KV, against Belady's hit rate on the same steps."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from dsamodel.model import DSAModel
from dsamodel.presets import init_weights, tiny_config
from kvcore.pool.local import LocalHostPool
from kvoffload_bench.decode_report import add_stats, device_kv, report
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder, StepStats

TRACE_CONTEXT = 32768
TAIL = 191  # distinct rows per request after the shared prefix


def run_trace(trace, *, batch, context, steps, topk_buffer_size, block_size, dtype, seed, trace_params) -> dict:
    """With a trace: three SparseDecoders (sparse, keep, prefetch) on installed prompt KV replay the trace's top-k."""
    from kvoffload_engine.trace_topk import TraceTopK

    t0 = time.perf_counter()
    base = tiny_config(dtype="float32")
    tr = _trace(trace, base, batch=batch, context=context, steps=steps, seed=seed, trace_params=trace_params)
    pairs = sorted(set(zip(tr.requests.tolist(), tr.groups.tolist())))
    batch = len(pairs) if batch is None else batch
    steps = min(steps, tr.steps - 1)
    if steps < 1:
        raise ValueError(
            f"trace {tr.name!r} has {tr.steps} step(s); the bench needs 2 or more (a warm-up step, then timed steps)"
        )
    ids = [f"r{i}" for i in range(batch)]
    override = TraceTopK(tr, ids, num_layers=tr.num_layers)
    prompt_lens = [override.prompt_len(r) for r in ids]
    if min(prompt_lens) < 1:
        raise ValueError(f"trace {tr.name!r} starts at context {min(prompt_lens) + 1}: a prompt needs >= 1 token")
    max_len = max(prompt_lens) + 1 + steps + 1  # tokens after the warm-up and the timed steps
    model = _model(base, tr, max_len, seed, dtype)
    if topk_buffer_size is None:
        topk_buffer_size = -(-2 * tr.k // block_size) * block_size  # 2k, whole blocks
    blocks = batch * (-(-max_len // block_size) + 1) + 4  # every request's blocks, some spare
    pool_bytes = blocks * build.decode_geometry(model, block_size, 1 << 40).block_bytes
    decoders: dict[str, SparseDecoder] = {}
    pools: list[LocalHostPool] = []
    try:
        _build_decoders(decoders, pools, model, block_size, pool_bytes, topk_buffer_size, batch, max_len, override)
        _install(decoders.values(), model, ids, prompt_lens, seed)
        setup_s = time.perf_counter() - t0
        times, total, pf_total, equal, pf_equal = _replay(decoders, ids, steps, seed)
        dev = {name: device_kv(dec.allocator) for name, dec in decoders.items()}
    finally:
        # the "prefetch" decoder was built with miss_prefetch=True: it has a prefetcher
        if "prefetch" in decoders and (prefetcher := decoders["prefetch"].prefetcher) is not None:
            prefetcher.close()
        for p in pools:
            p.close()
    belady = _belady_hit_rate(tr, override.streams().flatten(), steps + 1, topk_buffer_size)
    return report(
        trace=tr.name,
        model=model,
        batch=batch,
        context=max(prompt_lens) + 1,
        steps=steps,
        dtype=dtype,
        topk_buffer_size=topk_buffer_size,
        times=times,
        dev=dev,
        total=total,
        equal=bool(equal),
        prefetch_equal=bool(pf_equal),
        extra={
            "kv_source": "installed",
            "setup_s": setup_s,
            "belady_hit_rate": belady,
            "prefetch": _prefetch_report(times, total, pf_total, steps, pf_equal),
        },
    )


def _model(base, tr, max_len: int, seed: int, dtype: str) -> DSAModel:
    """The tiny preset's shape with the trace's k and layers, no MTP layer, room for ``max_len`` tokens."""
    cfg = dataclasses.replace(
        base,
        index_topk=tr.k,
        num_hidden_layers=tr.num_layers,
        num_nextn_predict_layers=0,
        max_position_embeddings=max(base.max_position_embeddings, max_len),
    )
    return init_weights(DSAModel(cfg, dtype=torch.float32), seed=seed).to(getattr(torch, dtype))


def _build_decoders(
    decoders: dict[str, SparseDecoder],
    pools: list[LocalHostPool],
    model: DSAModel,
    block_size: int,
    pool_bytes: int,
    topk_buffer_size: int,
    batch: int,
    max_len: int,
    override,
) -> None:
    """The three decoders (sparse, keep, sparse with miss prefetch), each on a pool of its own, into
    ``decoders``, their pools into ``pools`` as they are opened (the caller closes what was built)."""
    for name, keep, pf in (("sparse", False, False), ("keep", True, False), ("prefetch", False, True)):
        pools.append(build.decode_pool(model, block_size, pool_bytes))
        decoders[name] = SparseDecoder(
            model,
            pools[-1],
            topk_buffer_size=topk_buffer_size,
            max_num_seqs=batch,
            max_model_len=max_len,
            keep_device_kv_cache=keep,
            topk_override=override,
            miss_prefetch=pf,
        )


def _trace(trace, base, *, batch, context, steps, seed, trace_params):
    """The ``Trace`` to replay: ``trace`` itself, a synthetic preset generated at the bench's sizes, or
    a recorded one by name (as recorded: no ``context`` or ``trace_params``)."""
    from kvcore.traces import PRESETS, Trace, named

    synthetic = not isinstance(trace, Trace) and trace in PRESETS
    if not synthetic and (context is not None or trace_params):
        raise ValueError(
            f"trace {getattr(trace, 'name', trace)!r} is not generated here: it has its own contexts "
            f"and parameters (no context= or trace_params=)"
        )
    if isinstance(trace, Trace):
        return trace
    if synthetic:
        params = {
            "requests": 8 if batch is None else batch,
            "layers": base.num_hidden_layers,
            "context0": TRACE_CONTEXT if context is None else context,
            "steps": steps + 1,
            "seed": seed,
            **trace_params,
        }
        return named(trace, **params)
    return named(trace)  # FileNotFoundError: not recorded yet (its message says how to record it)


def _replay(decoders: dict[str, SparseDecoder], ids: list[str], steps: int, seed: int):
    """A warm-up step (trace step 0, cold cache), then ``steps`` timed steps of every decoder in turn,
    greedy tokens of the sparse one fed to all: (step times by decoder, the sparse and the prefetch
    decoders' summed ``StepStats``, whether sparse == keep logits and sparse == prefetch logits at every
    step)."""
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, 256, (len(ids),), generator=gen)
    lg = {name: dec.step(ids, tokens) for name, dec in decoders.items()}  # warm-up: trace step 0, cold cache
    equal = torch.equal(lg["sparse"], lg["keep"])
    pf_equal = torch.equal(lg["sparse"], lg["prefetch"])
    tokens = lg["sparse"].argmax(-1)
    times: dict[str, list[float]] = {name: [] for name in decoders}
    total, pf_total = StepStats(), StepStats()
    for _ in range(steps):
        for name, dec in decoders.items():
            t = time.perf_counter()
            lg[name] = dec.step(ids, tokens)
            times[name].append(time.perf_counter() - t)
        equal &= torch.equal(lg["sparse"], lg["keep"])
        pf_equal &= torch.equal(lg["sparse"], lg["prefetch"])
        add_stats(total, decoders["sparse"].last_step)
        add_stats(pf_total, decoders["prefetch"].last_step)
        tokens = lg["sparse"].argmax(-1)  # greedy, the same tokens into all
    return times, total, pf_total, equal, pf_equal


def _prefetch_report(
    times: dict[str, list[float]], total: StepStats, pf_total: StepStats, steps: int, pf_equal: bool
) -> dict:
    """Miss prefetch on (the prefetch decoder) against off (the sparse one): the report's ``prefetch``."""
    return {
        "misses_loaded_early": pf_total.prefetch_hits / max(pf_total.misses, 1),
        "rows_loaded_per_miss": pf_total.prefetched / max(pf_total.misses, 1),
        "load_s_per_step_off": total.load_s / steps,
        "load_s_per_step_on": pf_total.load_s / steps,
        "load_time_moved_off": 1.0 - pf_total.load_s / total.load_s if total.load_s else 0.0,
        "step_time_ratio_vs_off": statistics.median(times["prefetch"]) / statistics.median(times["sparse"]),
        "same_misses": (pf_total.hits, pf_total.misses) == (total.hits, total.misses),
        "logits_equal": bool(pf_equal),
    }


def _install(decoders, model: DSAModel, ids: list[str], prompt_lens: list[int], seed: int) -> None:
    """Every request's prompt KV into every decoder: seeded rows, a shared prefix plus a distinct tail."""
    cfg = model.config
    for dec in decoders:
        for rid, n in zip(ids, prompt_lens):
            dec.admit(rid, n + 1)
    gen = torch.Generator().manual_seed(seed)
    longest = max(prompt_lens)
    for layer in range(len(model.cache_layers)):
        kv = torch.randn(longest, cfg.kv_row_width, generator=gen).to(model.dtype)  # [P, W]
        index_k = torch.randn(longest, cfg.index_head_dim, generator=gen).to(model.dtype)  # [P, Di]
        for rid, n in zip(ids, prompt_lens):
            tail = min(TAIL, n)
            kv_r, idx_r = kv[:n].clone(), index_k[:n].clone()
            kv_r[n - tail :] = torch.randn(tail, cfg.kv_row_width, generator=gen).to(model.dtype)
            idx_r[n - tail :] = torch.randn(tail, cfg.index_head_dim, generator=gen).to(model.dtype)
            for dec in decoders:
                dec.write_prompt_layer(rid, layer, kv_r, idx_r)
    for dec in decoders:
        for rid, n in zip(ids, prompt_lens):
            dec.set_prompt_done(rid, n)


def _belady_hit_rate(tr, streams: torch.Tensor, num_steps: int, capacity: int) -> float:
    """Belady's hit rate on ``streams`` over steps 1..num_steps-1 (step 0, the cold warm-up, left out)."""
    from kvoffload_bench.belady import stream_hits

    topk = tr.topk[streams, :num_steps].numpy()  # [S, T, k]
    hits = misses = 0
    for s in range(topk.shape[0]):
        h, m = stream_hits(topk[s], capacity)
        first = topk[s, 0]
        hits, misses = hits + h, misses + m - len(set(first[first >= 0].tolist()))  # step 0: all misses
    return hits / (hits + misses) if hits + misses else 0.0
