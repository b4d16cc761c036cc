"""``kvoffload bench vllm``'s P/D part (the module docstring of ``kvoffload_bench.vllm_connectors``
defines its figures): one P/D pair per transfer backend (``kvoffload_bench.vllm_backends``) started
beside the plain vLLM server, which stays up. The rounds take turns (round r on the plain server,
then through each pair, then round r + 1), so each P/D round is timed next to the plain one it is
compared with; then the shared-buffer figures and the equality matrix, the plain server's side of
each right before the P/D side; then, the pairs stopped, the chunked shared-buffer comparison on a
prefill and a plain server of its own."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from kvoffload_bench import pd_matrix
from kvoffload_bench.pd_memcpy import MemcpySampler
from kvoffload_bench.vllm_backends import BACKENDS, CONSUMER, REQUESTS, Pair, backend_round, pairs
from kvoffload_bench.vllm_backends import figures as backend_figures
from kvoffload_bench.vllm_shared import baseline, chunked_figures, configured_plan, not_chunked, shared_figures
from kvoffload_bench.vllm_stream import pd_prompt, settled, stream, timed_round, tpot_sources_differ

BLOCK_SIZE = 128  # vLLM's CPU default block size: P/D moves whole blocks


@dataclass(frozen=True)
class Sizes:
    """The P/D part's work: ``rounds`` rounds of a fresh ``prompt_tokens`` prompt (``max_tokens`` out),
    the shared-buffer figures' ``shared_tokens`` prompt, the equality matrix's prompt lengths."""

    rounds: int
    prompt_tokens: int
    max_tokens: int
    shared_tokens: int
    matrix: tuple[int, ...]
    shared_chunked: bool = True  # the chunked shared-buffer comparison (two servers more)

    @property
    def max_len(self) -> int:
        """The servers' max_model_len: every prompt of the part fits."""
        return max_len(self.prompt_tokens, self.max_tokens, max(self.shared_tokens, *self.matrix))


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


def check_backends(backends: tuple[str, ...]) -> None:
    """ValueError unless ``backends`` holds the gRPC stream's (the ``pd_*`` figures') and only known ones."""
    if "grpc_stream" not in backends or not set(backends) <= set(BACKENDS):
        raise ValueError(f"backends: expected grpc_stream and any of {', '.join(BACKENDS)}, got {backends!r}")


def _rounds(plain, running: dict[str, Pair], name: str, sizes: Sizes, sampler: MemcpySampler):
    """The rounds, taking turns: round r on the plain server, then through each pair in turn; (the
    plain server's ``timed_round``s, each backend's ``backend_round``s)."""
    plain_rounds: list[dict] = []
    by_backend: dict[str, list[dict]] = {backend: [] for backend in running}
    for r in range(sizes.rounds):
        plain_rounds.append(timed_round(plain.url, name, r, sizes.prompt_tokens, sizes.max_tokens, plain.url))
        for backend, pair in running.items():
            by_backend[backend].append(backend_round(pair, name, r, sizes.prompt_tokens, sizes.max_tokens, sampler))
    return plain_rounds, by_backend


def pd(model_dir: Path, work: Path, plain, sizes: Sizes, say, backends: tuple[str, ...] = tuple(BACKENDS)) -> dict:
    """The P/D pairs of ``backends`` (the gRPC stream's always; ``vllm_backends.pairs``) started beside
    the running plain server ``plain``, the rounds taking turns (``_rounds``), then the shared-buffer
    figures (the gRPC stream's prefill) and the equality matrix (through the gRPC stream's proxy),
    the plain server's side of each first."""
    check_backends(backends)
    prefill_env, decode_env = cores()
    name, prompt_tokens = str(model_dir), sizes.prompt_tokens
    sampler = MemcpySampler(math.ceil(prompt_tokens / BLOCK_SIZE) * BLOCK_SIZE * kv_bytes_per_token(model_dir, 1))
    counters = [CONSUMER.format(c) for c in REQUESTS]
    with pairs(model_dir, work, sizes.max_len, prefill_env, decode_env, backends) as running:
        main = running["grpc_stream"]  # the pd_* figures, the shared buffers' and the matrix
        say(f"P/D pairs up beside the plain server (metastore, prefill, decode, proxy each): {', '.join(running)}")
        for url in (plain.url, *(pair.proxy.url for pair in running.values())):
            stream(url, name, pd_prompt(-1, prompt_tokens), sizes.max_tokens)  # warm-up
        before = {backend: settled(pair.decode.url, counters) for backend, pair in running.items()}
        plain_rounds, by_backend = _rounds(plain, running, name, sizes, sampler)
        after = {backend: settled(pair.decode.url, counters) for backend, pair in running.items()}
        say(f"plain: {[{k: v for k, v in p.items() if k != 'tokens'} for p in plain_rounds]}")
        long_baseline = baseline(stream, plain.url, name, sizes.shared_tokens)
        plan = configured_plan(main.prefill_config, model_dir)  # the buffers it was configured with
        shared = shared_figures(stream, main.prefill, name, long_baseline, plan)
        say(f"shared buffers: {shared}")
        matrix_want = pd_matrix.answers(plain.url, name, sizes.matrix)
        matrix_off = pd_matrix.mismatches(pd_matrix.answers(main.proxy.url, name, sizes.matrix), matrix_want)
        say(f"P/D matrix: {len(matrix_want)} cases, {len(matrix_off)} differ {matrix_off}")
    requests = {
        backend: {c: after[backend][n] - before[backend][n] for c, n in zip(REQUESTS, counters, strict=True)}
        for backend in running
    }
    if sizes.shared_chunked:  # its own prefill and plain server, the pairs stopped
        shared |= chunked_figures(
            stream, model_dir, work, sizes.max_len, sizes.shared_tokens, (prefill_env, decode_env)
        )
        say(f"shared buffers in chunks: {shared}")
    else:
        shared |= not_chunked()
    out = _pd_figures(model_dir, sizes, plain_rounds, [r["timed"] for r in by_backend["grpc_stream"]], say)
    return {
        **out,
        "pd_matrix_cases": sorted(matrix_want),
        "pd_matrix_mismatches": matrix_off,
        "pd_matrix_tokens_equal": not matrix_off,
        **_pulled(requests["grpc_stream"]),
        "pd_cores": {
            "plain": decode_env.get("VLLM_CPU_OMP_THREADS_BIND"),
            "prefill": prefill_env.get("VLLM_CPU_OMP_THREADS_BIND"),
            "decode": decode_env.get("VLLM_CPU_OMP_THREADS_BIND"),
        },
        **shared,
        **backend_figures(by_backend, plain_rounds, requests),
    }


def _pd_figures(model_dir: Path, sizes: Sizes, plain_rounds: list[dict], pd_rounds: list[dict], say) -> dict:
    """The ``pd_*`` timing figures of the plain server's rounds and the gRPC stream's pair's."""
    per_round = [pd_pair(p, d) for p, d in zip(plain_rounds, pd_rounds, strict=True)]
    say(f"P/D: {per_round}")
    med = {
        k: statistics.median(p[k] for p in per_round)
        for k in ("plain_ttft_s", "pd_ttft_s", "plain_tpot_s", "pd_tpot_s")
    }
    why = tpot_sources_differ({"plain": plain_rounds, "P/D": pd_rounds})
    if why is None and not med["plain_tpot_s"]:
        why = "the plain server's median TPOT is 0"
    return {
        "pd_prompt_tokens": sizes.prompt_tokens,
        "pd_max_tokens": sizes.max_tokens,
        "pd_per_round": per_round,
        **med,
        "pd_ttft_ratio": med["pd_ttft_s"] / med["plain_ttft_s"],
        "pd_tpot_ratio": None if why else med["pd_tpot_s"] / med["plain_tpot_s"],
        "pd_tpot_ratio_not_measured": why,
        "pd_tokens_equal": all(p["tokens_equal"] for p in per_round),
        "pd_prompt_kv_bytes": math.ceil(sizes.prompt_tokens / BLOCK_SIZE) * BLOCK_SIZE * kv_bytes_per_token(model_dir),
    }


def _pulled(delta: dict) -> dict:
    """The gRPC stream's decode's pulls over the rounds (``REQUESTS`` deltas) as the ``pd_*`` figures."""
    requests = delta["requests_pulled"]
    return {
        "pd_requests_pulled": int(requests),
        "pd_requests_failed": int(delta["requests_failed"]),
        "pd_bytes_pulled_per_request": int(delta["bytes_read"] / requests) if requests else None,
    }


def max_len(prompt_tokens: int, max_tokens: int, shared_tokens: int) -> int:
    """The P/D part's servers' max_model_len: its prompts and the long shared-buffer prompt fit."""
    return max(prompt_tokens + max_tokens + 512, shared_tokens + 64)  # 8000 + 64 fits SmolLM2's 8192
