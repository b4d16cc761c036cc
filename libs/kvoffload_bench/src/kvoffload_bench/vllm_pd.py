"""``kvoffload bench vllm``'s P/D part (the module docstring of ``kvoffload_bench.vllm_connectors``
defines its figures): the plain vLLM server's rounds, then the P/D stack's on the same prompts, one
P/D pair per transfer backend side by side (``kvoffload_bench.vllm_backends``)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from kvoffload_bench import pd_matrix
from kvoffload_bench.pd_memcpy import MemcpySampler
from kvoffload_bench.vllm_backends import BACKENDS, CONSUMER, backend_round, pairs
from kvoffload_bench.vllm_backends import figures as backend_figures
from kvoffload_bench.vllm_shared import baseline, shared_figures
from kvoffload_bench.vllm_stream import pd_prompt, settled, stream, timed_rounds

BLOCK_SIZE = 128  # vLLM's CPU default block size: P/D moves whole blocks


def kv_bytes_per_token(model_dir: Path, layers: int | None = None) -> int:
    """K and V of every layer (or of ``layers`` of them), float32 (the bench serves with --dtype float32)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    n = cfg["num_hidden_layers"] if layers is None else layers
    return 2 * n * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head * 4


def cores() -> tuple[dict[str, str], dict[str, str]]:
    """The prefill's and the decode's environment: each on one half of the cores (the plain server the
    P/D stack is compared with runs on the decode's half)."""
    from kvoffload_testing.vllm_stack import split_cores

    halves = split_cores()
    return (
        {"VLLM_CPU_OMP_THREADS_BIND": halves[0]} if halves else {},
        {"VLLM_CPU_OMP_THREADS_BIND": halves[1]} if halves else {},
    )


def plain_server(model_dir: Path, work: Path, max_len: int):
    from kvoffload_testing.vllm_server import VllmServer

    return VllmServer(
        model_dir,
        max_model_len=max_len,
        env=cores()[1],
        log_path=work / "plain.log",
        start_timeout_s=300,
    )


def plain(plain, name: str, rounds: int, prompt_tokens: int, max_tokens: int, shared_tokens: int, matrix, say):
    """The P/D part's baseline: the same prompts on the plain server (nothing else runs meanwhile),
    then the shared-buffer figures' (``vllm_shared.baseline``), then the equality matrix's answers
    (``pd_matrix``, prompts of ``matrix`` tokens)."""
    say(f"plain server up on cores {cores()[1].get('VLLM_CPU_OMP_THREADS_BIND', 'all')}")
    stream(plain.url, name, pd_prompt(-1, prompt_tokens), max_tokens)  # warm-up
    plain_rounds = timed_rounds(plain.url, name, rounds, prompt_tokens, max_tokens, plain.url)
    say(f"plain: {[{k: v for k, v in p.items() if k != 'tokens'} for p in plain_rounds]}")
    long_baseline = baseline(stream, plain.url, name, shared_tokens)
    return plain_rounds, long_baseline, pd_matrix.answers(plain.url, name, matrix)


def pd_pair(p: dict, d: dict) -> dict:
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


def pd(
    model_dir: Path,
    work: Path,
    rounds: int,
    prompt_tokens: int,
    max_tokens: int,
    say,
    plain: tuple,
    backends: tuple[str, ...] = tuple(BACKENDS),
) -> dict:
    """The P/D stack on the prompts the plain server answered (``plain``: ``plain``'s rounds,
    long-prompt baseline and matrix answers): one P/D pair per transfer backend of ``backends`` (the
    gRPC stream's always) side by side (``vllm_backends.pairs``), the rounds taking turns; the
    ``pd_*`` fields and the prefill's shared-buffer figures from the gRPC stream's pair,
    ``pull_by_backend`` from each."""
    if "grpc_stream" not in backends or not set(backends) <= set(BACKENDS):
        raise ValueError(f"backends: expected grpc_stream and any of {', '.join(BACKENDS)}, got {backends!r}")
    plain_rounds, long_baseline, matrix_want = plain
    prefill_env, decode_env = cores()
    lengths = tuple(sorted({int(k.split("-")[1]) for k in matrix_want if k.startswith("completion-")}))
    name, model_len = str(model_dir), max_len(prompt_tokens, max_tokens, max(long_baseline["prompt_tokens"], *lengths))
    sampler = MemcpySampler(math.ceil(prompt_tokens / BLOCK_SIZE) * BLOCK_SIZE * kv_bytes_per_token(model_dir, 1))
    counters = [CONSUMER.format(c) for c in ("bytes_read", "requests_pulled", "requests_failed")]
    by_backend: dict[str, list[dict]] = {backend: [] for backend in backends}
    with pairs(model_dir, work, model_len, prefill_env, decode_env, backends) as running:
        main = running["grpc_stream"]  # the pd_* figures, the shared buffers' and the matrix
        say(f"P/D pairs up (metastore, prefill, decode, proxy each): {', '.join(running)}")
        for pair in running.values():
            stream(pair.proxy.url, name, pd_prompt(-1, prompt_tokens), max_tokens)  # warm-up
        before = settled(main.decode.url, counters)
        for r in range(rounds):
            for backend, pair in running.items():
                by_backend[backend].append(backend_round(pair, name, r, prompt_tokens, max_tokens, sampler))
        after = settled(main.decode.url, counters)
        shared = shared_figures(stream, main.prefill, name, long_baseline["prompt_tokens"], long_baseline)
        say(f"shared buffers: {shared}")
        matrix_off = pd_matrix.mismatches(pd_matrix.answers(main.proxy.url, name, lengths), matrix_want)
        say(f"P/D matrix: {len(matrix_want)} cases, {len(matrix_off)} differ {matrix_off}")
    pd_rounds = [r["timed"] for r in by_backend["grpc_stream"]]
    pulled, requests, failed = (after[c] - before[c] for c in counters)
    per_round = [pd_pair(p, d) for p, d in zip(plain_rounds, pd_rounds, strict=True)]
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
        "pd_prompt_kv_bytes": math.ceil(prompt_tokens / BLOCK_SIZE) * BLOCK_SIZE * kv_bytes_per_token(model_dir),
        "pd_cores": {
            "plain": decode_env.get("VLLM_CPU_OMP_THREADS_BIND"),
            "prefill": prefill_env.get("VLLM_CPU_OMP_THREADS_BIND"),
            "decode": decode_env.get("VLLM_CPU_OMP_THREADS_BIND"),
        },
        **shared,
        **backend_figures(by_backend, plain_rounds),
    }


def max_len(prompt_tokens: int, max_tokens: int, shared_tokens: int) -> int:
    """The P/D part's servers' max_model_len: its prompts and the long shared-buffer prompt fit."""
    return max(prompt_tokens + max_tokens + 512, shared_tokens + 64)  # 8000 + 64 fits SmolLM2's 8192
