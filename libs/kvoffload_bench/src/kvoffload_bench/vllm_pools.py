"""``bench vllm``'s store part on each pool backend the vLLM store takes (``kvcore.pool.registry.VLLM_POOLS``):
``ttft_ratio_prefix_hit_by_backend.<kvoffload|mooncake>``.

One store server per backend (``store_server``: the ``AscendStoreConnector``, ``kv_both``, on that
backend; vLLM's own prefix cache off, so the pool is the only place a prefix can come from), each
over an index server of its own (``index_servers``: a ``kvoffload-metastore``; a real
``mooncake_master``), all started side by side. Per round (``store_round``), each server in turn gets
a fresh prompt of ``prefix_tokens`` tokens plus a short suffix twice: a miss (computed, its full blocks
saved), then a hit (the scheduler finds the blocks in the backend's index, the worker loads them).
A hit is read from the server's own pool on both backends (on Mooncake: found through the master,
its bytes in this server's segment); hits across hosts are what tests/integration/
test_vllm_mooncake_store.py checks.

``figures``: per backend its rounds, the median TTFT ratio hit / miss, the median hit tokens and
whether every hit's tokens equal its miss's. ``pool_goals``: each backend's ratio <= ``GOAL`` (a
backend the run left out meets none, and ``not_measured`` says so).
"""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path

from kvcore.pool.registry import EMBEDDED, VLLM_POOLS
from kvoffload_bench.vllm_stream import stream
from kvoffload_testing.prom import metric

GOAL = 0.3  # a hit's TTFT over a miss's, on every backend
BY_BACKEND = "ttft_ratio_prefix_hit_by_backend"
HITS = "vllm:external_prefix_cache_hits_total"
SUFFIX = 40  # the tokens after the prefix: computed on the hit too


def check_pools(pools: tuple[str, ...]) -> None:
    """ValueError unless ``pools`` are backends the vLLM store takes, the embedded one first (its
    rounds are the store part's top-level figures)."""
    if not pools or pools[0] != EMBEDDED or set(pools) - set(VLLM_POOLS) or len(set(pools)) != len(pools):
        raise ValueError(f"pools: expected {EMBEDDED!r} first, then any of {VLLM_POOLS[1:]}, got {pools!r}")


def index_servers(pools: tuple[str, ...], work: Path, stack: contextlib.ExitStack) -> dict[str, dict]:
    """Each backend's index server, started (and stopped by ``stack``): backend -> the store config's
    keys naming it."""
    from kvoffload_testing.vllm_server import Metastore

    out: dict[str, dict] = {}
    for pool in pools:
        if pool == EMBEDDED:
            out[pool] = {"metastore": stack.enter_context(Metastore(work / "metastore.log")).address}
        else:  # mooncake: the only other backend the vLLM store takes (check_pools)
            out[pool] = {"mooncake_master": stack.enter_context(start_master()).address}
    return out


def start_master():
    """A real ``mooncake_master`` on loopback (its lease TTL the pool's default)."""
    from poolbackends.mooncake_master import MasterConfig, MooncakeMaster

    return MooncakeMaster.start(MasterConfig())


def store_server(model_dir: Path, work: Path, pool: str, keys: dict, prefix_tokens: int):
    """The store server of ``pool`` (not started), its index server named by ``keys``; the embedded
    backend's logs to ``vllm.log``, another's to ``vllm-<pool>.log``."""
    from kvoffload_testing.vllm_server import VllmServer

    kv = {
        "kv_connector": "AscendStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "kvoffload_vllm",
        "kv_connector_extra_config": {"backend": pool, **keys, "host_pool_gb": 1},
    }
    args = ["--kv-transfer-config", json.dumps(kv), "--no-enable-prefix-caching"]
    return VllmServer(
        model_dir,
        max_model_len=prefix_tokens + 512,
        extra_args=args,
        kv_cache_space_gib=2,
        log_path=work / ("vllm.log" if pool == EMBEDDED else f"vllm-{pool}.log"),
        start_timeout_s=300,
    )


def store_round(url: str, name: str, seed: int, prefix_tokens: int, max_tokens: int) -> dict:
    """One round on one store server: its fresh prompt (``seed``) sent twice (a miss, then a hit), the
    TTFTs, tokens and hits."""
    prompt = [(i * 7919 + seed * 104729) % 40000 + 1000 for i in range(prefix_tokens)] + [
        (i * 31 + seed) % 5000 + 200 for i in range(SUFFIX)
    ]
    hits_before = metric(url, HITS)
    miss_ttft, miss_tokens, _ = stream(url, name, prompt, max_tokens)
    hits_mid = metric(url, HITS)
    hit_ttft, hit_tokens, _ = stream(url, name, prompt, max_tokens)
    hits_after = metric(url, HITS)
    return {
        "miss_ttft_s": miss_ttft,
        "hit_ttft_s": hit_ttft,
        "ttft_ratio": hit_ttft / miss_ttft,
        "tokens_equal": hit_tokens == miss_tokens,
        "miss_hit_tokens": hits_mid - hits_before,
        "hit_tokens": hits_after - hits_mid,
    }


def measure(stores: dict, name: str, sizes, prefix_tokens: int, max_tokens: int, say) -> dict[str, list[dict]]:
    """Every round on every running store server (``stores``: backend -> server, each warmed up
    first; ``sizes.rounds`` rounds), each server a prompt of its own; the servers stopped after.
    Backend -> its rounds (``store_round``)."""
    for server in stores.values():
        stream(server.url, name, [100 + i for i in range(64)], 2)  # warm-up
    by_pool: dict[str, list[dict]] = {pool: [] for pool in stores}
    for r in range(sizes.rounds):
        for i, (pool, server) in enumerate(stores.items()):
            by_pool[pool].append(store_round(server.url, name, r + 1000 * i, prefix_tokens, max_tokens))
            say(f"round {r + 1}/{sizes.rounds} on {pool}: {by_pool[pool][-1]}")
    for server in stores.values():
        server.stop()
    return by_pool


def figures(by_pool: dict[str, list[dict]]) -> dict:
    """``ttft_ratio_prefix_hit_by_backend`` (backend -> median ratio) and ``prefix_hit_by_backend``
    (backend -> its rounds and medians) from each backend's rounds."""
    detail = {
        pool: {
            "ttft_ratio": statistics.median(r["ttft_ratio"] for r in rounds),
            "miss_ttft_s": statistics.median(r["miss_ttft_s"] for r in rounds),
            "hit_ttft_s": statistics.median(r["hit_ttft_s"] for r in rounds),
            "hit_tokens_per_request": statistics.median(r["hit_tokens"] for r in rounds),
            "tokens_equal": all(r["tokens_equal"] for r in rounds),
            "per_round": rounds,
        }
        for pool, rounds in by_pool.items()
    }
    return {BY_BACKEND: {pool: d["ttft_ratio"] for pool, d in detail.items()}, "prefix_hit_by_backend": detail}


def pool_goals(out: dict) -> tuple[dict, dict, dict]:
    """(goals, met, not_measured) of ``ttft_ratio_prefix_hit_by_backend``: every backend's ratio <=
    ``GOAL``; a backend the run left out meets none (its hits' tokens: the bench's ``tokens_equal``)."""
    goals, met, not_measured = {}, {}, {}
    for pool in VLLM_POOLS:
        key = f"{BY_BACKEND}.{pool}"
        goals[key] = GOAL
        ratio = out[BY_BACKEND].get(pool)
        met[key] = ratio is not None and ratio <= GOAL
        if ratio is None:
            not_measured[key] = f"the {pool} store server was not run (pools without {pool})"
    return goals, met, not_measured
