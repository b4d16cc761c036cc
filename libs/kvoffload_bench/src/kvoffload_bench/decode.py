"""Decode bench: sparse offload vs keep_device_kv_cache, stepping alternately, logits compared (I2).

**Without a trace** (the default): the tiny model, batch 8, context 8192, ``index_topk`` 64,
``topk_buffer_size`` 128. Two engines hold the same 8 requests (an 8000-token shared prefix plus
distinct suffixes, so the prefix cache keeps set-up short); their decode steps alternate.

**With a trace** (``trace=NAME``, ``kvoffload bench decode --trace NAME``): the same real
``SparseDecoder`` steps, but every layer's indexer top-k (the indexer still runs) is replaced by
the trace's (``kvoffload_engine.trace_topk``), at the sizes the trace was made for:

- a synthetic preset (``overlap80/90/95``) is generated for this run: ``requests`` = batch (8),
  ``layers`` = the model's cache layers (4), ``context0`` = context (32768), ``steps`` = steps + 1,
  ``k`` 2048 (``trace_params`` overrides any generator parameter);
- a recorded trace (``kvcore.traces.named``; FileNotFoundError says how to record a missing one)
  is replayed as recorded: one engine request per (request, group) stream pair, one cache layer
  per trace layer, each prompt ``context0 - 1`` tokens long, at most ``trace.steps - 1`` timed
  steps.

The model is the tiny preset's shape (narrow: 128 hidden, 208-wide KV rows) with ``index_topk`` =
the trace's k, as many layers as the trace and no MTP layer; ``topk_buffer_size`` defaults to 2k.
Prefilling 8 prompts of 32K tokens at k = 2048 costs minutes on two CPU cores (a 4K-token prompt
took 73 s), so in trace mode the prompt KV is **installed** instead: seeded random rows (a shared
prefix plus a distinct 191-row tail per request) written into both decoders with
``write_prompt_layer``, the hand-over path a pulled prompt takes. The selections come from the
trace, so what the rows hold only matters for the logits, which both engines compute from the
same rows. The first decode step (trace step 0, a cold hot cache) is a warm-up; then ``steps``
timed steps, greedy tokens from the sparse engine fed to both.

Report: ``step_time_ratio`` = median sparse step / median keep step (goal <= 1.25 without a
trace, <= 1.10 with one, on CPU at batch 8); ``device_kv_ratio`` = device KV bytes (indexer cache
+ hot buffers vs indexer cache + full KV, from the counting allocator; goal <= 0.2);
``hit_rate`` and ``h2d_bytes_per_step`` (misses x row bytes, from ``StepStats``) of the sparse
engine over the timed steps; ``h2d_floor_bytes_per_step`` = (1 - hit_rate) x k x row_bytes x
layers x batch, the bytes a step must move at that hit rate, and ``h2d_floor_ratio`` = measured /
floor (goal <= 1.02: nothing moved beyond the misses); ``belady_hit_rate`` (trace mode): the
offline optimum for the same buffer and steps (``kvoffload_bench.belady``), the ceiling for any policy;
``logits_equal``: both engines' logits bit-identical at every step (I2).

Miss prefetch (trace mode): a third decoder, the sparse one with ``miss_prefetch`` on
(``kvoffload_engine.prefetch``), steps in the same rotation. ``prefetch`` reports the share of the
misses that were already loaded when their layer needed them (``misses_loaded_early``), the rows
it loaded per miss (``rows_loaded_per_miss``: the extra traffic of wrong predictions), the seconds
per step spent loading misses on the critical path with and without it and the share of that time
moved off (``load_time_moved_off``), its median step time against the sparse decoder without it
(``step_time_ratio_vs_off``) and whether its logits equal the others' at every step.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from dsamodel.model import DSAModel
from dsamodel.presets import init_weights, tiny_config, tiny_model
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder, StepStats
from kvoffload_engine.engine import Engine, EngineConfig
from openai_api.sampling_params import SamplingParams
from svcruntime.logs import quiet_logs

GOAL_STEP_TIME_RATIO = 1.25
GOAL_STEP_TIME_RATIO_TRACE = 1.10
GOAL_DEVICE_KV_RATIO = 0.2
GOAL_H2D_FLOOR_RATIO = 1.02
TRACE_CONTEXT = 32768
TAIL = 191  # distinct rows per request after the shared prefix


def run(
    *,
    batch: int | None = None,
    context: int | None = None,
    steps: int = 32,
    topk_buffer_size: int | None = None,
    block_size: int = 64,
    dtype: str = "bfloat16",
    seed: int = 0,
    trace=None,
    trace_params: dict | None = None,
) -> dict:
    """The decode bench (module docstring). ``trace``: None, a trace name or a ``Trace``."""
    quiet_logs()
    if trace is None:
        if trace_params:
            raise ValueError("trace_params needs a synthetic trace (trace='overlap90', ...)")
        return _run_prompts(
            batch=8 if batch is None else batch,
            context=8192 if context is None else context,
            steps=steps,
            topk_buffer_size=128 if topk_buffer_size is None else topk_buffer_size,
            block_size=block_size,
            dtype=dtype,
            seed=seed,
        )
    return _run_trace(
        trace,
        batch=batch,
        context=context,
        steps=steps,
        topk_buffer_size=topk_buffer_size,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        trace_params=trace_params or {},
    )


def _run_prompts(*, batch, context, steps, topk_buffer_size, block_size, dtype, seed) -> dict:
    """Without a trace: two Engines prefill the same prompts, then decode with their indexers."""
    t0 = time.perf_counter()
    model = tiny_model(seed=seed, dtype="float32").to(getattr(torch, dtype))
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (context - 192,), generator=gen)
    prompts = [torch.cat((shared, torch.randint(0, 256, (191,), generator=gen))) for _ in range(batch)]
    engines = {}
    for name, keep in (("sparse", False), ("keep", True)):
        cfg = EngineConfig(
            block_size=block_size,
            max_model_len=context + steps + 8,
            max_num_seqs=batch,
            chunk_size=2048,
            buffers=3,
            topk_buffer_size=topk_buffer_size,
            keep_device_kv_cache=keep,
            prefill_pool_bytes=1 << 30,
            decode_pool_bytes=1 << 30,
        )
        eng = Engine(model, cfg)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
        eng.step()  # prefill all (the prefix cache makes requests 2..8 cheap) + the first decode step
        engines[name] = eng
    setup_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {"sparse": [], "keep": []}
    logits: dict[str, torch.Tensor] = {}
    total = StepStats()
    equal = True
    try:
        for name, eng in engines.items():  # capture each step's logits
            real = eng.decoder.forward

            def recorded(ids, tokens, _real=real, _name=name):
                out = _real(ids, tokens)
                logits[_name] = out[0]
                return out

            eng.decoder.forward = recorded  # type: ignore[method-assign]  # this instance's forward, wrapped to record
        for _ in range(steps):
            for name, eng in engines.items():
                t = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - t)
            equal &= bool(torch.equal(logits["sparse"], logits["keep"]))
            _add(total, engines["sparse"].decoder.last_step)
        dev = {name: _device_kv(e.allocator) for name, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()
    return _report(
        trace=None,
        model=model,
        batch=batch,
        context=context,
        steps=steps,
        dtype=dtype,
        topk_buffer_size=topk_buffer_size,
        times=times,
        dev=dev,
        total=total,
        equal=equal,
        extra={"kv_source": "prefill", "setup_s": setup_s},
    )


def _run_trace(trace, *, batch, context, steps, topk_buffer_size, block_size, dtype, seed, trace_params) -> dict:
    """With a trace: two SparseDecoders with installed prompt KV replay the trace's top-k."""
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
    k = tr.k
    max_len = max(prompt_lens) + 1 + steps + 1  # tokens after the warm-up and the timed steps
    cfg = dataclasses.replace(
        base,
        index_topk=k,
        num_hidden_layers=tr.num_layers,
        num_nextn_predict_layers=0,
        max_position_embeddings=max(base.max_position_embeddings, max_len),
    )
    model = init_weights(DSAModel(cfg, dtype=torch.float32), seed=seed).to(getattr(torch, dtype))
    if topk_buffer_size is None:
        topk_buffer_size = -(-2 * k // block_size) * block_size  # 2k, whole blocks
    blocks = batch * (-(-max_len // block_size) + 1) + 4  # every request's blocks, some spare
    pool_bytes = blocks * build.decode_geometry(model, block_size, 1 << 40).block_bytes
    decoders: dict[str, SparseDecoder] = {}
    pools = []
    try:
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
        _install(decoders.values(), model, ids, prompt_lens, seed)
        setup_s = time.perf_counter() - t0
        times, total, pf_total, equal, pf_equal = _replay(decoders, ids, steps, seed)
        dev = {name: _device_kv(dec.allocator) for name, dec in decoders.items()}
    finally:
        # the "prefetch" decoder was built with miss_prefetch=True: it has a prefetcher
        if "prefetch" in decoders and (prefetcher := decoders["prefetch"].prefetcher) is not None:
            prefetcher.close()
        for p in pools:
            p.close()
    belady = _belady_hit_rate(tr, override.streams().flatten(), steps + 1, topk_buffer_size)
    return _report(
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
        extra={
            "kv_source": "installed",
            "setup_s": setup_s,
            "belady_hit_rate": belady,
            "prefetch": _prefetch_report(times, total, pf_total, steps, pf_equal),
        },
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
        _add(total, decoders["sparse"].last_step)
        _add(pf_total, decoders["prefetch"].last_step)
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


def _add(total: StepStats, st: StepStats) -> None:
    total.hits += st.hits
    total.misses += st.misses
    total.h2d_bytes += st.h2d_bytes
    total.prefetched += st.prefetched
    total.prefetch_hits += st.prefetch_hits
    total.load_s += st.load_s


def _device_kv(allocator) -> int:
    return sum(v for k, v in allocator.stats().current_by_tag.items() if k.startswith("decode."))


def _report(
    *, trace, model, batch, context, steps, dtype, topk_buffer_size, times, dev, total: StepStats, equal, extra
) -> dict:
    cfg = model.config
    sparse_s, keep_s = statistics.median(times["sparse"]), statistics.median(times["keep"])
    ratio = sparse_s / keep_s
    device_ratio = dev["sparse"] / dev["keep"]
    hit_rate = total.hit_rate
    layers = len(model.layers)  # the layers a decode step runs (no MTP drafts here)
    row_bytes = cfg.kv_row_width * model.dtype.itemsize
    h2d = total.h2d_bytes / steps
    floor = (1.0 - hit_rate) * cfg.index_topk * row_bytes * layers * batch
    floor_ratio = h2d / floor if floor else (1.0 if h2d == 0 else None)
    goals = {
        "step_time_ratio": GOAL_STEP_TIME_RATIO_TRACE if trace is not None else GOAL_STEP_TIME_RATIO,
        "device_kv_ratio": GOAL_DEVICE_KV_RATIO,
        "h2d_floor_ratio": GOAL_H2D_FLOOR_RATIO,
    }
    values = {"step_time_ratio": ratio, "device_kv_ratio": device_ratio, "h2d_floor_ratio": floor_ratio}
    return {
        "bench": "decode",
        "batch": batch,
        "context": context,
        "steps": steps,
        "dtype": dtype,
        "topk": cfg.index_topk,
        "topk_buffer_size": topk_buffer_size,
        "sparse_step_s": sparse_s,
        "keep_step_s": keep_s,
        "step_time_ratio": ratio,
        "device_kv_bytes": dev["sparse"],
        "device_kv_bytes_keep": dev["keep"],
        "device_kv_ratio": device_ratio,
        "hit_rate": hit_rate,
        "h2d_bytes_per_step": h2d,
        "logits_equal": equal,
        "goals_met": {name: v is not None and v <= goals[name] for name, v in values.items()},
        "trace": trace,
        "layers": layers,
        "row_bytes": row_bytes,
        "h2d_floor_bytes_per_step": floor,
        "h2d_floor_ratio": floor_ratio,
        "goals": goals,
        **extra,
    }
