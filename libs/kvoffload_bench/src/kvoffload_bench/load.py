"""``kvoffload bench load``: the P/D stack under a burst of concurrent clients vs the single-process engine.

For each client count in ``clients`` (default 64 and 256) every client sends one streaming greedy
completion at the same moment, through the proxy of a one-prefill, one-decode stack (the decode's
default ``--max-num-seqs 8`` and default queue limit; the prefill with ``--chunk-size 2048``). A
client that gets 429 waits its ``Retry-After`` and sends again (at most ``max_retries`` times), as
OpenAI's Python client does (``kvoffload_bench.load_polite.retry_delay_s``); any other error, or 429
after its last retry, is a failure. Then the
single-process engine (``dsamodel``'s ``Engine``, same sizes, ``max_num_seqs`` = the decode's) runs
the same requests in this process: all added at once, stepped until done. The halves alternate
(stack, engine, stack, engine, ... ``rounds`` pairs per client count, 3 by default), each on the
same machine and cores, and every round has fresh prompts, so no round reuses another's prefix
cache. The counts are summed over the rounds and every other figure is their median (these
machines are shared and noisy: one round's ratio varies by +-0.1 from run to run).

The workload is mixed: prompt lengths log-uniform in [``min_prompt``, ``max_prompt``] tokens
(random byte tokens), ``max_tokens`` uniform in [1, ``max_tokens``]. Defaults keep a run to a few
minutes on a 2-core machine (prompts 10-1500 tokens, about 300 on average; 1-32 output tokens).

Per client count:

- ``ok``, ``failed``, ``rejected_429`` (429 answers, retried or not), ``retries``;
- ``ttft_p50_s`` / ``ttft_p99_s`` (client send -> first token, the last try of a retried client),
  ``tpot_p50_s`` / ``tpot_p99_s`` (mean gap between a request's output tokens after the first);
- ``output_tokens``, ``wall_s`` (first send to last token), ``output_tokens_per_s``;
- ``single_*``: the same for the single-process engine, and ``throughput_ratio`` = stack output
  tokens/s over the engine's; ``tokens_equal``: every stack success returned the engine's greedy
  tokens (I3); ``tokens_unequal`` counts the requests that did not, ``unequal_examples`` names up
  to 5 (their sizes, their 429s, the first position where the tokens differ).

Then the burst case on the same stack (``burst``: ``kvoffload_bench.load_burst``): 96 mixed requests
(10-6,000-token prompts, half streamed) at once, no retry; each one answered, refused with 429, or
timed out with no byte. Then the polite burst (``burst_polite``: ``kvoffload_bench.load_polite``):
as many fresh requests of the same mix at once, each client retrying a 429 after its
``Retry-After`` as OpenAI's Python client does; its retries per request, answered and failed.

``goals`` (``kvoffload_bench.load_report``): no failures, ``throughput_ratio`` >= 0.9 at every client
count, every request's tokens equal the single-process engine's (``tokens_equal``); in the burst no
request timed out without an answer or failed, and one at least was answered; in the polite burst
at most 3 retries a request, every request answered, none failed. ``goals_met`` says which held.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import random
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TypedDict

from kvoffload_bench import load_burst, load_polite, load_report
from kvoffload_testing.sse import sse_events, token_ids

CHUNK_SIZE = 2048
MAX_NUM_SEQS = 8  # the decode's default --max-num-seqs


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


class _ClientRecord(TypedDict):
    """One client's request: served or not, its 429s, its error, its tokens and their timing."""

    ok: bool
    rejected: int
    error: str
    ids: list[int]
    ttft: float | None
    tpot: float | None
    end: float | None


def _client(url: str, prompt: list[int], max_tokens: int, start: threading.Event, max_retries: int) -> _ClientRecord:
    """One client: waits for ``start``, sends, retries a 429 after its Retry-After as OpenAI's Python
    client does (``load_polite.retry_delay_s``)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    rng = random.Random(len(prompt) * 1000 + max_tokens)  # its backoff's jitter, were a 429 without a hint
    start.wait()
    rec: _ClientRecord = {"ok": False, "rejected": 0, "error": "", "ids": [], "ttft": None, "tpot": None, "end": None}
    for attempt in range(max_retries + 1):
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        stamps: list[float] = []
        ids: list[int] = []
        try:
            with urllib.request.urlopen(req, timeout=1800) as resp:
                for event in sse_events(resp):
                    if "error" in event:
                        raise RuntimeError(f"stream error: {event['error']}")
                    new = token_ids(event)
                    ids += new
                    stamps += [time.perf_counter()] * len(new)
        except urllib.error.HTTPError as e:
            text = e.read()[:300].decode(errors="replace")
            if e.code == 429:
                rec["rejected"] += 1
                delay = load_polite.retry_delay_s(e.headers.get("Retry-After"), attempt, rng)
                if attempt < max_retries and delay is not None:
                    time.sleep(delay)
                    continue
            rec["error"] = f"HTTP {e.code}: {text}"
            return rec
        except Exception as e:  # noqa: BLE001 - a failure is what the bench counts
            rec["error"] = f"{type(e).__name__}: {e}"
            return rec
        if not stamps:
            rec["error"] = "no tokens"
            return rec
        rec.update(
            {
                "ok": True,
                "ids": ids,
                "ttft": stamps[0] - t0,
                "end": stamps[-1],
                "tpot": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None,
            }
        )
        return rec
    return rec


def _stack_round(url: str, work: list[tuple[list[int], int]], max_retries: int) -> dict:
    start = threading.Event()
    with cf.ThreadPoolExecutor(len(work)) as pool:
        futures = [pool.submit(_client, url, p, m, start, max_retries) for p, m in work]
        time.sleep(0.5)  # every client thread is up and waiting
        t0 = time.perf_counter()
        start.set()
        recs = [f.result() for f in futures]
    ok = [r for r in recs if r["ok"]]
    out_tokens = sum(len(r["ids"]) for r in ok)
    # a served record has its times (ok, ttft and end are set together)
    wall = (max(r["end"] for r in ok if r["end"] is not None) - t0) if ok else 0.0
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    return {
        "ok": len(ok),
        "failed": len(recs) - len(ok),
        "rejected_429": sum(r["rejected"] for r in recs),
        "retries": sum(r["rejected"] for r in ok),
        "errors": sorted({r["error"][:200] for r in recs if not r["ok"]})[:5],
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "tpot_p50_s": _pct(tpot, 0.5),
        "tpot_p99_s": _pct(tpot, 0.99),
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall if wall else 0.0,
        "_ids": [r["ids"] if r["ok"] else None for r in recs],
        "_rejected": [r["rejected"] for r in recs],
    }


class _Single:
    """The single-process engine with the stack's sizes (``max_num_seqs`` = the decode's)."""

    def __init__(self, model_dir: Path, block_size: int, max_model_len: int) -> None:
        from kvoffload_testing.oracle import TimedEngine

        self.engine = TimedEngine(
            model_dir,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=MAX_NUM_SEQS,
            chunk_size=CHUNK_SIZE,
        )

    def round(self, tag: str, work: list[tuple[list[int], int]]) -> dict:
        t0, ids, stamps = self.engine.run(tag, work)
        wall = time.perf_counter() - t0
        ttft = [st[0] - t0 for st in stamps]
        tpot = [(st[-1] - st[0]) / (len(st) - 1) for st in stamps if len(st) > 1]
        out_tokens = sum(len(i) for i in ids)
        return {
            "ttft_p50_s": _pct(ttft, 0.5),
            "ttft_p99_s": _pct(ttft, 0.99),
            "tpot_p50_s": _pct(tpot, 0.5),
            "tpot_p99_s": _pct(tpot, 0.99),
            "output_tokens": out_tokens,
            "wall_s": wall,
            "output_tokens_per_s": out_tokens / wall,
            "_ids": ids,
        }

    def close(self) -> None:
        self.engine.close()


def _workload(
    gen: random.Random, n: int, min_prompt: int, max_prompt: int, max_tokens: int
) -> list[tuple[list[int], int]]:
    lo, hi = math.log(min_prompt), math.log(max_prompt)
    return [
        ([gen.randrange(256) for _ in range(int(math.exp(gen.uniform(lo, hi))))], gen.randint(1, max_tokens))
        for _ in range(n)
    ]


def run(
    *,
    clients: tuple[int, ...] = (64, 256),
    min_prompt: int = 10,
    max_prompt: int = 1500,
    max_tokens: int = 32,
    block_size: int = 16,
    max_retries: int = 20,
    seed: int = 0,
    rounds: int = 3,
    decode_args: tuple[str, ...] = (),
    prefill_args: tuple[str, ...] = (),
    service_env: dict[str, dict[str, str]] | None = None,
    burst_requests: int = 96,
    burst_max_prompt: int = 6000,
    burst_max_tokens: int = 128,
    burst_client_timeout_s: float | None = None,
) -> dict:
    """One stack round and one single-process round per client count, then the burst case and the
    polite burst on the same stack (``load_burst``, ``load_polite``); returns the JSON-ready result."""
    from kvoffload_testing.ports import free_stack_ports
    from kvoffload_testing.stack import Stack, StackConfig
    from kvoffload_testing.stack_client import stack_stats
    from kvoffload_testing.stack_config import ensure_tiny_model
    from svcruntime.logs import quiet_logs

    quiet_logs()
    work_dir = Path(tempfile.mkdtemp(prefix="kvoffload-bench-load-"))
    model_dir = ensure_tiny_model(work_dir / "tiny")
    gen = random.Random(seed)
    max_model_len = 8192
    cfg = StackConfig(
        model=model_dir,
        log_dir=work_dir / "logs",
        **free_stack_ports(),
        max_model_len=max_model_len,
        block_size=block_size,
        service_args={"prefill-0": ["--chunk-size", str(CHUNK_SIZE), *prefill_args], "decode-0": list(decode_args)},
        service_env=service_env or {},
    )
    levels = []
    single = _Single(model_dir, block_size, max_model_len)
    try:
        with Stack(cfg) as stack:
            for n in clients:
                per_round = []
                for rnd in range(rounds):
                    work = _workload(gen, n, min_prompt, max_prompt, max_tokens)
                    per_round.append(_pair(f"{stack.url}/v1/completions", single, work, n, rnd, max_retries))
                levels.append(load_report.level(n, rounds, per_round, stack_stats(cfg)["decode-0"]))
            bursts = {}
            for case, case_seed in (("burst", seed), ("burst_polite", seed + 1)):  # fresh prompts: no cache hits
                burst_work = _workload(random.Random(case_seed), burst_requests, 10, burst_max_prompt, burst_max_tokens)
                bursts[case] = _burst(cfg, stack.url, burst_work, burst_client_timeout_s, polite=case != "burst")
                bursts[case] |= {"max_prompt": burst_max_prompt, "max_tokens": burst_max_tokens}
    finally:
        single.close()
    sizes = {"clients": list(clients), "rounds": rounds, "min_prompt": min_prompt, "max_prompt": max_prompt}
    sizes |= {"max_tokens": max_tokens, "decode_max_num_seqs": MAX_NUM_SEQS, "chunk_size": CHUNK_SIZE}
    return load_report.result(levels, sizes, bursts["burst"], bursts["burst_polite"])


def _burst(cfg, url: str, work: list[tuple[list[int], int]], client_timeout_s: float | None, *, polite: bool) -> dict:
    """The burst case on the running stack (its clients polite or not: ``load_polite``,
    ``load_burst``), with what the decode's and the prefill's bounds did."""
    from kvoffload_testing.stack_client import stack_stats

    before = stack_stats(cfg)
    bounds = before["decode-0"]["max_queue_wait_s"], before["prefill-0"]["max_queue_wait_s"]
    if polite:
        out = load_polite.polite_burst(
            f"{url}/v1/completions", work, load_burst.client_timeout(bounds, client_timeout_s)
        )
        out |= {"max_queue_wait_s": bounds[0], "prefill_max_queue_wait_s": bounds[1]}
    else:
        out = load_burst.burst(f"{url}/v1/completions", work, bounds, client_timeout_s)
    after = stack_stats(cfg)
    for service, prefix, keys in (
        ("decode-0", "", ("queue_timeouts", "rejected_by_estimate")),
        ("prefill-0", "prefill_", ("queue_timeouts", "rejected_by_estimate", "rejected_queue_full")),
    ):
        out |= {prefix + k: int(after[service][k] - before[service][k]) for k in keys}
    out["start_interval_s"] = after["decode-0"]["start_interval_s"]
    out["prefill_rate_tokens_per_s"] = after["prefill-0"]["rate_tokens_per_s"]
    out["prefill_run_fixed_s"] = after["prefill-0"]["run_fixed_s"]
    out["prefill_run_4k_s"] = after["prefill-0"]["run_4k_s"]
    return out


def _pair(url: str, single: _Single, work: list[tuple[list[int], int]], n: int, rnd: int, max_retries: int) -> dict:
    """Round ``rnd`` of ``work`` at ``n`` clients: the stack's clients at ``url``, then the single-process
    engine; the two halves' figures side by side (the engine's as ``single_*``), their throughput ratio
    and whether every stack answer equals the engine's."""
    pd = _stack_round(url, work, max_retries)
    one = single.round(f"c{n}r{rnd}", work)
    pd_ids, one_ids, rejected = pd.pop("_ids"), one.pop("_ids"), pd.pop("_rejected")
    if len(pd_ids) != len(one_ids):
        raise RuntimeError(
            f"round {rnd}: {len(pd_ids)} stack answers for {len(one_ids)} engine "
            f"answers of the same {len(work)} requests"
        )
    # a failed request (None) is not equal
    unequal = [i for i, (a, b) in enumerate(zip(pd_ids, one_ids, strict=True)) if a != b]
    ratio = pd["output_tokens_per_s"] / one["output_tokens_per_s"] if one["output_tokens_per_s"] else 0.0
    return {
        "prompt_tokens": sum(len(p) for p, _ in work),
        **pd,
        **{f"single_{k}": v for k, v in one.items()},
        "throughput_ratio": ratio,
        "tokens_equal": not unequal,
        "tokens_unequal": len(unequal),
        "unequal_examples": [_unequal(work[i], pd_ids[i], one_ids[i], rejected[i]) for i in unequal[:3]],
    }


def _unequal(job: tuple[list[int], int], got: list[int] | None, want: list[int], rejected: int) -> dict:
    """One request whose stack answer differs from the engine's: its sizes, its 429s, where it differs."""
    first = next((k for k, (a, b) in enumerate(zip(got or [], want)) if a != b), min(len(got or []), len(want)))
    return {
        "prompt_tokens": len(job[0]),
        "max_tokens": job[1],
        "rejected_429": rejected,
        "stack_tokens": None if got is None else len(got),
        "engine_tokens": len(want),
        "first_difference": first,
    }
