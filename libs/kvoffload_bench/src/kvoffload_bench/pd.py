"""``kvoffload bench pd``: the P/D stack through the proxy vs the single-process engine.

Both serve the same ``requests`` concurrent greedy requests of ``prompt_tokens``-token prompts with
the same engine sizes, in ``rounds`` interleaved pairs (P/D round, single-process round, P/D round,
...; every pair has fresh prompts, so no round reuses another's prefix), so slow drifts of a shared
machine hit both halves alike; the figures are medians over the rounds. Greedy tokens must be
identical in every pair (I3, ``tokens_equal``).

- ``ttft_ratio``, ``tpot_ratio``: per pair, the median over the requests of P/D over single
  process; the median over the pairs (goal for TPOT <= 1.3). A request's TPOT is timed over the
  second half of its tokens; when those arrived at once (one chunk, or fewer than two tokens) its
  TPOT was not measured, and neither is its round's ``tpot_ratio`` nor the bench's: None, the goal
  not met, and ``not_measured`` says why.
- ``pull_gbps_in_stack``: the decode's own pull rate during a P/D round (its ``bytes_read`` over
  ``read_ms_total``: reading a layer's rows out of the prefill's shared memory and installing them
  in the decode's host pool and indexer cache, summed over the round's pulls).
- ``memcpy_gbps_in_stack``: its reference under the same load. While each round's prefills and
  pulls run (from the round's start until every request has its second token, which needs all of
  its layers pulled), a thread of the bench process repeatedly copies ``memcpy_bytes`` between
  cold buffers (``dst.copy_(src)``; the bytes of one pull: a layer's rows of one prefill chunk of
  ``CHUNK_SIZE`` tokens, or of the whole prompt if shorter; ``pull_bytes_per_pull`` is the
  decode's measured mean), sleeping 4x each copy's time (at least 1 ms: at most ~20% of one
  core), and sums bytes over seconds like the decode's counters do. The same sampler also runs
  during the single-process rounds, so both halves carry the same extra load.
- ``pull_gbps_in_stack_ratio_to_memcpy``: per P/D round pull / memcpy; the median over rounds
  (goal >= 0.5). None (not measured, the goal not met) when a round's decode timed no pull or the
  sampler no copy.
- ``tokens_equal``: greedy tokens equal in every pair (goal; ``tp_2_1_tokens_equal`` too with ``tp``).
- ``goals`` / ``goals_met``: each goal and whether it held; ``not_measured``: goal -> why its figure
  is None (a goal is never judged on a figure that was not measured).
- ``tp_2_1`` (with ``tp``): the same pairs with a tensor-parallel prefill, (prefill TP, decode TP)
  = (2, 1): the prefill starts a second rank process (``--tensor-parallel-size 2``). On a float32
  tiny model, against the one-rank engine on it: a TP size sums its partial results in another
  order, so in bfloat16 the greedy tokens of TP 2 may differ from TP 1's, in float32 they agree.
  Its ``ttft_ratio`` / ``tpot_ratio`` / ``tokens_equal`` / ``pulls`` / ``pull_bytes`` as above; each
  prefill rank sends its share of every layer (two pulls a layer), and
  ``pull_bytes_by_prefill_tp_rank`` says how many bytes each rank's shares carried (about half each,
  one copy of the prompts in all).
- ``pull_by_backend`` / ``tokens_equal_by_backend`` (with ``backends``): the decode's in-stack pull
  rate on each P→D data path (shared memory, the gRPC stream, Mooncake Transfer Engine) against a
  memcpy under the same load, ``pull_by_backend.<path>.gbps_in_stack`` / ``.ratio_to_memcpy``
  (``kvoffload_bench.pd_backends``); goal: mooncake >= 0.5 of the memcpy.
- ``pull_across_namespaces`` / ``tokens_equal_across_namespaces`` (with ``across``): the two paths
  across hosts (Mooncake Transfer Engine, the gRPC stream) with the decode in a network namespace of
  its own behind a veth pair, the same rounds: ``pull_across_namespaces.<path>.gbps_in_stack`` /
  ``.ratio_to_memcpy`` and ``pull_across_namespaces.mooncake_to_grpc_stream`` (goal >= 2). Needs root.
- ``idle_*`` (with ``idle_pull``): the old out-of-stack figure, kept as a diagnostic: the same
  pull code path (``SparseDecoder.write_prompt_layer``, the whole prompt of one layer) against a
  memcpy of the same bytes, side by side in the bench process after the stack is down (other
  processes on the machine still count). A low in-stack ratio next to a high idle ratio points
  at the load (scheduling), not at the copy code. With it, ``idle_mooncake_*``: Mooncake Transfer
  Engine's own rate on this host out of any stack against a memcpy (``kvoffload_bench.engine_ceiling``):
  the ceiling of the mooncake path's ``ratio_to_memcpy`` here.

The memcpy references (the sampler, the idle diagnostic) are ``kvoffload_bench.pd_memcpy``'s.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import tempfile
import threading
import time
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

from kvoffload_bench.engine_ceiling import mooncake_ceiling
from kvoffload_bench.pd_backends import CHUNK_SIZE, across_namespaces, bench_stack_config, by_backend
from kvoffload_bench.pd_memcpy import MemcpySampler, pull_vs_memcpy
from kvoffload_bench.pd_report import figures, goals, pull_figures, round_figures, tp_figures
from kvoffload_testing.sse import sse_events, token_ids


class _Countdown:
    """Sets ``event`` once ``n`` requests reported (each request reports once)."""

    def __init__(self, n: int, event: threading.Event) -> None:
        self._left, self._event, self._lock = n, event, threading.Lock()
        if n <= 0:
            event.set()

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._event.set()


def _stream_timed(
    url: str, prompt: list[int], max_tokens: int, second: _Countdown
) -> tuple[list[int], float, float | None]:
    """(tokens, time to first token, time per output token after the first: ``_tpot``) of one
    streaming request; ``second.done()`` once it has two tokens (or ended)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ids: list[int] = []
    stamps: list[float] = []
    try:
        with urllib.request.urlopen(req, timeout=1800) as resp:
            for event in sse_events(resp):
                if "error" in event:
                    raise RuntimeError(f"request failed: {event['error']}")
                new = token_ids(event)
                had = len(ids)
                ids += new
                stamps += [time.perf_counter()] * len(new)
                if had < 2 <= len(ids):
                    second.done()
    finally:
        if len(ids) < 2:
            second.done()
    return ids, stamps[0] - t0, _tpot(stamps)


def _tpot(stamps: list[float]) -> float | None:
    """Seconds per token over the second half of a stream (the first tokens can arrive in one burst
    when decoding starts before the client's stream is connected end to end): that half's span over
    its gaps. Not a median of gaps: tokens that arrive in one chunk would make it 0. None (not
    measured) when that half has fewer than two tokens or they all arrived at once."""
    half = stamps[len(stamps) // 2 :]
    if len(half) < 2 or half[-1] == half[0]:
        return None
    return (half[-1] - half[0]) / (len(half) - 1)


class _Single:
    """The single-process engine (same sizes as the stack's), loaded once, serving one round at a time."""

    def __init__(self, model_dir: Path, max_num_seqs: int, block_size: int) -> None:
        from kvoffload_testing.oracle import TimedEngine

        self.engine = TimedEngine(
            model_dir, block_size=block_size, max_model_len=8192, max_num_seqs=max_num_seqs, chunk_size=CHUNK_SIZE
        )

    def round(self, tag: str, prompts: list[list[int]], max_tokens: int, second: threading.Event):
        """(tokens, TTFTs, TPOTs (``_tpot``)) per request; sets ``second`` once every request has two tokens."""

        def check(seqs, stamps) -> None:
            if not second.is_set() and all(len(st) >= 2 or s.finished for s, st in zip(seqs, stamps)):
                second.set()

        t0, ids, stamps = self.engine.run(tag, [(p, max_tokens) for p in prompts], after_step=check)
        second.set()
        return ids, [st[0] - t0 for st in stamps], [_tpot(st) for st in stamps]

    def close(self) -> None:
        self.engine.close()


def _rounds(
    model_dir: Path,
    log_dir: Path,
    prefill_args: list[str],
    *,
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    rounds: int,
    gen: random.Random,
    sampler: MemcpySampler,
) -> tuple[list[dict], bool]:
    """``rounds`` interleaved P/D + single-process pairs on ``model_dir`` (the prefill started with
    ``prefill_args``): (per-round figures, whether greedy tokens were equal in every pair)."""
    from kvoffload_testing.stack import Stack
    from kvoffload_testing.stack_client import stack_stats

    cfg = bench_stack_config(model_dir, log_dir, block_size, prefill_args)
    per_round: list[dict] = []
    tokens_equal = True
    single = _Single(model_dir, requests, block_size)
    try:
        with Stack(cfg) as stack, cf.ThreadPoolExecutor(requests) as pool:
            for rnd in range(rounds):
                prompts = [[gen.randrange(256) for _ in range(prompt_tokens)] for _ in range(requests)]
                # P/D half: the decode's pull counters around the round; memcpy sampled under its load
                before = stack_stats(cfg)["decode-0"]
                second = threading.Event()
                countdown = _Countdown(requests, second)
                memcpy = sampler.start(second)
                pd = list(
                    pool.map(
                        partial(_stream_timed, f"{stack.url}/v1/completions", max_tokens=max_tokens, second=countdown),
                        prompts,
                    )
                )
                memcpy_gbps, copies = memcpy()
                after = stack_stats(cfg)["decode-0"]
                # single-process half: same prompts, same extra load (the sampler) while it prefills
                second = threading.Event()
                memcpy = sampler.start(second)
                single_ids, single_ttft, single_tpot = single.round(f"r{rnd}", prompts, max_tokens, second)
                memcpy()
                tokens_equal &= [r[0] for r in pd] == single_ids
                per_round.append(
                    round_figures(pd, single_ttft, single_tpot, before, after)
                    | pull_figures(before, after, memcpy_gbps, copies)
                )
    finally:
        single.close()
    return per_round, tokens_equal


def _row_bytes(model_dir: Path) -> int:
    from dsamodel.config import ModelConfig

    mc = ModelConfig.from_json(model_dir / "config.json")
    return (mc.kv_row_width + mc.index_head_dim) * mc.dtype.itemsize  # main + indexer row of one token


def run(
    *,
    requests: int = 8,
    prompt_tokens: int = 4096,
    max_tokens: int = 64,
    block_size: int = 16,
    rounds: int = 3,
    idle_pull: bool = True,
    tp: bool = True,
    backends: bool = True,
    across: bool = True,
) -> dict:
    """Runs ``rounds`` interleaved P/D + single-process pairs; returns the JSON-ready result
    (see module docstring). With ``tp``, the same again with a TP 2 prefill (``tp_2_1``); with
    ``backends``, the pull on each P→D data path (``pull_by_backend``); with ``across``, the paths
    across hosts with the decode in a network namespace (``pull_across_namespaces``)."""
    from dsamodel.presets import write_tiny
    from kvoffload_testing.stack_config import ensure_tiny_model
    from svcruntime.logs import quiet_logs

    if rounds < 1:
        raise ValueError(f"rounds = {rounds} must be >= 1")
    quiet_logs()

    work = Path(tempfile.mkdtemp(prefix="kvoffload-bench-pd-"))
    model_dir = ensure_tiny_model(work / "tiny")
    memcpy_bytes = min(prompt_tokens, CHUNK_SIZE) * _row_bytes(model_dir)  # one pull: a layer's rows of one chunk
    gen = random.Random(0)
    sizes: dict[str, Any] = {
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "block_size": block_size,
        "rounds": rounds,
    }

    def sized_rounds(model: Path, logs: Path, prefill_args: list[str], sampler: MemcpySampler):
        return _rounds(model, logs, prefill_args, **sizes, gen=gen, sampler=sampler)

    per_round, tokens_equal = sized_rounds(model_dir, work / "logs", [], MemcpySampler(memcpy_bytes))
    out = figures(per_round, tokens_equal, requests, prompt_tokens, max_tokens, rounds, memcpy_bytes)
    if tp:  # (prefill TP, decode TP) = (2, 1); float32: a TP size's partial sums round differently
        model32 = write_tiny(work / "tiny-float32", dtype="float32")
        tp_sampler = MemcpySampler(min(prompt_tokens, CHUNK_SIZE) * _row_bytes(model32))
        tp_rounds, tp_equal = sized_rounds(model32, work / "logs-tp2", ["--tensor-parallel-size", "2"], tp_sampler)
        out["tp_2_1"] = tp_figures(tp_rounds, tp_equal)
    if backends:  # the pull on each P→D data path: kvoffload_bench.pd_backends
        logs = work / "logs-backends"
        out |= by_backend(model_dir, logs, **sizes, gen=gen, sampler=MemcpySampler(memcpy_bytes))
    if across:  # the paths across hosts, the decode behind a veth pair: kvoffload_bench.pd_backends
        logs = work / "logs-across"
        out |= across_namespaces(model_dir, logs, **sizes, gen=gen, sampler=MemcpySampler(memcpy_bytes))
    out |= goals(out, per_round)
    return out | (_idle_pull(prompt_tokens, block_size) if idle_pull else {})


def _idle_pull(prompt_tokens: int, block_size: int) -> dict:
    """The pull on an idle machine against memcpy, and Mooncake's own ceiling beside it."""
    idle_pull_gbps, idle_memcpy = pull_vs_memcpy(prompt_tokens, block_size)
    return {
        "idle_pull_gbps": idle_pull_gbps,
        "idle_memcpy_gbps": idle_memcpy,
        "idle_pull_ratio_to_memcpy": idle_pull_gbps / idle_memcpy,
        **mooncake_ceiling(),
    }
