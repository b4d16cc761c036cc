"""``kvoffload bench vllm``'s shared-buffer figures: the P/D part's vLLM prefill, which keeps the
seed's few shared layer buffers, against the plain vLLM server, both with the same KV memory budget
(``VLLM_CPU_KVCACHE_SPACE``), each on its half of the cores, the plain server's side measured right
before the prefill's with every server of the P/D part up.

- ``prefill_capacity_ratio``: tokens the prefill's KV cache holds over the plain server's (vLLM's own
  ``num_gpu_blocks`` x ``block_size``, from ``vllm:cache_config_info``); goal >= 0.95 x N / P, with
  N the layers and P = I + min(B, N - I) the buffers, both from what the bench configured
  (``configured_plan``: the prefill's ``--kv-transfer-config`` as sent, its independent layers I and
  ``layerwise_num_shared_buffers`` B, and ``num_hidden_layers`` of the model's ``config.json``), never
  from what the prefill reports of itself;
- ``prefill_kv_bytes_ratio``: KV bytes per token, shared over plain: the budget over each capacity;
  goal <= P / N (within 1 %: vLLM rounds both to whole blocks);
- ``prefill_buffers_logged`` / ``prefill_layers_logged``: the plan the prefill logged
  (its ``kvoffload_shared_buffers`` start-up line; None without one), a diagnostic judged against
  the configured one: goal ``prefill_buffers_logged`` = P, met when the line says P buffers for N
  layers;
- ``prefill_time_ratio_shared``: the TTFT of one fresh ``shared_prompt_tokens``-token prompt sent to
  the prefill itself over the plain server's (goal <= 1.10), in vLLM's default chunks (few, large);
- ``prefill_time_ratio_shared_chunk512``: the same prompt in chunks of ``CHUNK_TOKENS`` (512:
  ``--max-num-batched-tokens``, 16 chunks of 8,000 tokens), each chunk reloading every earlier one
  into the shared buffers layer by layer: a prefill and a plain server of their own, both with
  that setting, started once the P/D pairs stopped (the bench's full run; ``run(shared_chunked=False)``
  leaves them out and the figure is not measured); goal <= 1.10;
- ``ttft_ratio_prefix_hit_shared``: on the prefill, a fresh prompt and then the same prompt again:
  hit TTFT over miss TTFT (vLLM's device prefix cache is off there: the hit comes from the host
  pool, loaded layer by layer into the shared buffers; goal <= 0.3);
- ``shared_tokens_equal``: the long prompt's tokens on the prefill equal the plain server's, and the
  hit's equal the miss's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvoffload_testing.prom import scrape

GOAL_TIME_RATIO = 1.10  # both prefill_time_ratio_shared figures
CHUNK_TOKENS = 512  # --max-num-batched-tokens of the chunked comparison
CHUNKED = "prefill_time_ratio_shared_chunk512"
GOAL_HIT_RATIO = 0.3
GOAL_CAPACITY_SHARE = 0.95
KV_BYTES_SLACK = 1.01
STORE = "AscendStoreConnector"
# ``layerwise_independent_layers`` when a store config leaves it out (docs/configuration.md: ``[0]``)
DEFAULT_INDEPENDENT_LAYERS = (0,)


def capacity_tokens(url: str) -> int:
    """Tokens vLLM's KV cache on ``url`` holds: ``num_gpu_blocks`` x ``block_size`` of its cache config."""
    (info,) = scrape(url).label_sets("vllm:cache_config_info")
    return int(info["num_gpu_blocks"]) * int(info["block_size"])


def _store_extra(config: dict) -> dict:
    """The ``kv_connector_extra_config`` of the AscendStoreConnector in ``config`` (alone or inside a
    MultiConnector)."""
    if config.get("kv_connector") == STORE:
        return config.get("kv_connector_extra_config") or {}
    for inner in (config.get("kv_connector_extra_config") or {}).get("connectors") or ():
        if inner.get("kv_connector") == STORE:
            return inner.get("kv_connector_extra_config") or {}
    raise ValueError(f"the prefill's --kv-transfer-config has no {STORE}: {json.dumps(config)}")


def configured_plan(kv_transfer_config: str, model_dir: Path) -> tuple[int, int]:
    """(buffers, layers) a prefill's KV cache holds by its configuration alone: ``kv_transfer_config``
    (the ``--kv-transfer-config`` it was started with) and the model's ``num_hidden_layers`` (N). With
    ``use_layerwise`` and ``layerwise_num_shared_buffers`` B: its I independent layers one buffer each
    and min(B, N - I) shared by the rest (docs/configuration.md); else a buffer per layer."""
    layers = int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])
    store = _store_extra(json.loads(kv_transfer_config))
    shared = store.get("layerwise_num_shared_buffers")
    if not store.get("use_layerwise") or shared is None:
        return layers, layers
    spec = store.get("layerwise_independent_layers", DEFAULT_INDEPENDENT_LAYERS)
    independent = layers if spec == "all" else len({int(i) % layers for i in spec})
    return independent + min(int(shared), layers - independent), layers


def logged_plan(log_text: str) -> tuple[int, int] | None:
    """(buffers, layers) of a prefill's ``kvoffload_shared_buffers`` start-up line; None without one."""
    line = re.search(r"kvoffload_shared_buffers\s.*", log_text)
    if line is None:
        return None
    buffers, layers = (re.search(rf"\b{k}=(\d+)", line.group(0)) for k in ("buffers", "layers"))
    if buffers is None or layers is None:
        raise RuntimeError(f"unreadable kvoffload_shared_buffers line: {line.group(0)!r}")
    return int(buffers.group(1)), int(layers.group(1))


def long_prompt(tokens: int, salt: int) -> list[int]:
    return [(i * 7727 + salt * 15485863) % 40000 + 1000 for i in range(tokens)]


def baseline(stream, url: str, name: str, tokens: int) -> dict:
    """The plain server's side: its capacity, and the long prompt's TTFT and tokens."""
    ttft, out, _ = stream(url, name, long_prompt(tokens, 1), 4)
    return {"prompt_tokens": tokens, "capacity_tokens": capacity_tokens(url), "ttft_s": ttft, "tokens": out}


def shared_figures(stream, prefill, name: str, plain: dict, plan: tuple[int, int]) -> dict:
    """The prefill's side against ``plain`` (``baseline``'s, the same long prompt): the ``prefill_*``
    and ``*_shared`` figures; ``plan``: the (buffers, layers) the prefill was configured with
    (``configured_plan``)."""
    logged = logged_plan(prefill.log_text())
    capacity = capacity_tokens(prefill.url)
    tokens = plain["prompt_tokens"]
    ttft, out, _ = stream(prefill.url, name, long_prompt(tokens, 1), 4)
    hit_prompt = long_prompt(tokens, 2)
    miss_ttft, miss_tokens, _ = stream(prefill.url, name, hit_prompt, 4)
    hit_ttft, hit_tokens, _ = stream(prefill.url, name, hit_prompt, 4)
    return {
        "shared_prompt_tokens": tokens,
        "prefill_buffers": plan[0],
        "prefill_layers": plan[1],
        "prefill_buffers_logged": None if logged is None else logged[0],
        "prefill_layers_logged": None if logged is None else logged[1],
        "prefill_capacity_tokens": capacity,
        "plain_capacity_tokens": plain["capacity_tokens"],
        "prefill_capacity_ratio": capacity / plain["capacity_tokens"],
        "prefill_kv_bytes_ratio": plain["capacity_tokens"] / capacity,
        "prefill_ttft_shared_s": ttft,
        "plain_ttft_long_s": plain["ttft_s"],
        "prefill_time_ratio_shared": ttft / plain["ttft_s"],
        "ttft_ratio_prefix_hit_shared": hit_ttft / miss_ttft,
        "shared_tokens_equal": out == plain["tokens"] and hit_tokens == miss_tokens,
    }


def chunked_figures(stream, model_dir: Path, work: Path, max_len: int, tokens: int, envs: tuple[dict, dict]) -> dict:
    """``CHUNKED``: the long prompt on a shared-buffer prefill against a plain server, both with
    ``--max-num-batched-tokens`` ``CHUNK_TOKENS``, started side by side (``envs``: the prefill's
    and the plain server's cores, as in the default-chunk comparison); the plain side first."""
    from kvoffload_testing.vllm_server import Metastore, VllmServer, running
    from kvoffload_testing.vllm_stack import vllm_prefill_transfer_config

    def server(name: str, env: dict, *extra: str) -> VllmServer:
        args = ["--max-num-batched-tokens", str(CHUNK_TOKENS), *extra]
        log = work / f"chunk{CHUNK_TOKENS}-{name}.log"
        return VllmServer(model_dir, max_model_len=max_len, env=env, log_path=log, start_timeout_s=300, extra_args=args)

    with Metastore(work / f"chunk{CHUNK_TOKENS}-metastore.log") as ms:
        prefill = server("prefill", envs[0], "--kv-transfer-config", vllm_prefill_transfer_config(ms.address))
        with running(server("plain", envs[1]), prefill) as (plain, prefill):
            name = str(model_dir)
            for url in (plain.url, prefill.url):
                stream(url, name, [100 + i for i in range(64)], 2)  # warm-up
            plain_ttft, plain_out, _ = stream(plain.url, name, long_prompt(tokens, 1), 4)
            ttft, out, _ = stream(prefill.url, name, long_prompt(tokens, 1), 4)
    return {
        f"prefill_ttft_shared_chunk{CHUNK_TOKENS}_s": ttft,
        f"plain_ttft_long_chunk{CHUNK_TOKENS}_s": plain_ttft,
        CHUNKED: ttft / plain_ttft,
        f"shared_chunk{CHUNK_TOKENS}_tokens_equal": out == plain_out,
    }


def not_chunked() -> dict:
    """The chunked figures of a run that left them out."""
    return {CHUNKED: None, f"{CHUNKED}_not_measured": "the run left the chunked comparison out (shared_chunked)"}


def shared_goals(out: dict) -> tuple[dict, dict, dict]:
    """(goals, met, not_measured) of the shared-buffer figures: the thresholds from the configured
    plan (``prefill_buffers`` / ``prefill_layers``), the logged plan judged against it."""
    buffers, layers = out["prefill_buffers"], out["prefill_layers"]
    share = buffers / layers
    logged = (out["prefill_buffers_logged"], out["prefill_layers_logged"])
    goals = {
        "prefill_kv_bytes_ratio": share,
        "prefill_capacity_ratio": GOAL_CAPACITY_SHARE / share,
        "prefill_buffers_logged": buffers,
        "prefill_time_ratio_shared": GOAL_TIME_RATIO,
        "ttft_ratio_prefix_hit_shared": GOAL_HIT_RATIO,
        "shared_tokens_equal": True,
    }
    met = {
        "prefill_kv_bytes_ratio": out["prefill_kv_bytes_ratio"] <= share * KV_BYTES_SLACK,
        "prefill_capacity_ratio": out["prefill_capacity_ratio"] >= GOAL_CAPACITY_SHARE / share,
        "prefill_buffers_logged": logged == (buffers, layers),
        "prefill_time_ratio_shared": out["prefill_time_ratio_shared"] <= GOAL_TIME_RATIO,
        "ttft_ratio_prefix_hit_shared": out["ttft_ratio_prefix_hit_shared"] <= GOAL_HIT_RATIO,
        "shared_tokens_equal": out["shared_tokens_equal"],
    }
    not_measured = (
        {"prefill_buffers_logged": "the prefill logged no kvoffload_shared_buffers line (no shared buffers set up)"}
        if logged[0] is None
        else {}
    )
    goals[CHUNKED] = GOAL_TIME_RATIO
    chunked = out.get(CHUNKED)
    met[CHUNKED] = chunked is not None and chunked <= GOAL_TIME_RATIO
    if chunked is None:
        not_measured[CHUNKED] = out.get(f"{CHUNKED}_not_measured") or "not measured"
    return goals, met, not_measured
