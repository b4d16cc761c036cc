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
+ hot buffers vs indexer cache + full KV, from the counting allocator by tag; goal <= 0.2);
``hit_rate`` and ``h2d_bytes_per_step`` (``StepStats.h2d_bytes``: the bytes of the rows the
sparse decoder's copies into its hot buffers moved, counted at the copy) of the sparse engine over
the timed steps; ``h2d_floor_bytes_per_step`` = (1 - hit_rate) x k x row_bytes x layers x batch,
the bytes a step must move at that hit rate, and ``h2d_floor_ratio`` = measured / floor (goal
<= 1.02: nothing moved beyond the misses; below 1, some miss was not loaded, also not met);
``belady_hit_rate`` (trace mode): the offline optimum for the same buffer and steps
(``kvoffload_bench.belady``), the ceiling for any policy; ``logits_equal``: the sparse and the keep
engines' logits bit-identical at every step (I2). Goals (``goals``, ``goals_met``): those three
ratios and ``logits_equal`` (every decoder's logits equal at every step: in trace mode the prefetch
decoder's too). A ratio whose figures were not recorded (no hot-cache stats, or device bytes
missing under a KV tag) is not met and named in ``not_measured`` with why
(``kvoffload_bench.decode_report``).

Miss prefetch (trace mode): a third decoder, the sparse one with ``miss_prefetch`` on
(``kvoffload_engine.prefetch``), steps in the same rotation. ``prefetch`` reports the share of the
misses that were already loaded when their layer needed them (``misses_loaded_early``), the rows
it loaded per miss (``rows_loaded_per_miss``: the extra traffic of wrong predictions), the seconds
per step spent loading misses on the critical path with and without it and the share of that time
moved off (``load_time_moved_off``), its median step time against the sparse decoder without it
(``step_time_ratio_vs_off``) and whether its logits equal the others' at every step.

The trace mode is ``kvoffload_bench.decode_trace``; the report and its goals, ``kvoffload_bench.decode_report``.
"""

from __future__ import annotations

import time

import torch

from dsamodel.presets import tiny_model
from kvoffload_bench.decode_report import add_stats, device_kv, report
from kvoffload_bench.decode_trace import run_trace
from kvoffload_engine.decode import StepStats
from kvoffload_engine.engine import Engine, EngineConfig
from openai_api.sampling_params import SamplingParams
from svcruntime.logs import quiet_logs


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
    return run_trace(
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
    engines = _prefilled_engines(model, prompts, context, steps, topk_buffer_size, block_size)
    setup_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {"sparse": [], "keep": []}
    logits: dict[str, torch.Tensor] = {}
    total = StepStats()
    equal = True
    try:
        _record_logits(engines, logits)
        for _ in range(steps):
            for name, eng in engines.items():
                t = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - t)
            equal &= bool(torch.equal(logits["sparse"], logits["keep"]))
            add_stats(total, engines["sparse"].decoder.last_step)
        dev = {name: device_kv(e.allocator) for name, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()
    return report(
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


def _prefilled_engines(
    model, prompts: list[torch.Tensor], context: int, steps: int, topk_buffer_size: int, block_size: int
) -> dict[str, Engine]:
    """The sparse and the keep Engine, each holding every prompt, prefilled and one decode step in."""
    engines = {}
    for name, keep in (("sparse", False), ("keep", True)):
        cfg = EngineConfig(
            block_size=block_size,
            max_model_len=context + steps + 8,
            max_num_seqs=len(prompts),
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
    return engines


def _record_logits(engines: dict[str, Engine], logits: dict[str, torch.Tensor]) -> None:
    """Each engine's decoder forward wrapped so that every step's logits land in ``logits[name]``."""
    for name, eng in engines.items():
        real = eng.decoder.forward

        def recorded(ids, tokens, _real=real, _name=name):
            out = _real(ids, tokens)
            logits[_name] = out[0]
            return out

        eng.decoder.forward = recorded  # type: ignore[method-assign]  # this instance's forward, wrapped to record
