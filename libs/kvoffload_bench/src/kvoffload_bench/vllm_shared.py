"""``kvoffload bench vllm``'s shared-buffer figures: the P/D part's vLLM prefill, which keeps the
seed's few shared layer buffers, against the plain vLLM server, both with the same KV memory budget
(``VLLM_CPU_KVCACHE_SPACE``), each on its half of the cores.

- ``prefill_capacity_ratio``: tokens the prefill's KV cache holds over the plain server's (vLLM's own
  ``num_gpu_blocks`` x ``block_size``, from ``vllm:cache_config_info``); goal >= 0.95 x N / P, with
  N the layers and P = I + min(B, R) the buffers (the prefill's ``kvoffload_shared_buffers`` line);
- ``prefill_kv_bytes_ratio``: KV bytes per token, shared over plain: the budget over each capacity;
  goal <= P / N (within 1 %: vLLM rounds both to whole blocks);
- ``prefill_time_ratio_shared``: the TTFT of one fresh ``shared_prompt_tokens``-token prompt sent to
  the prefill itself over the plain server's (goal <= 1.25);
- ``ttft_ratio_prefix_hit_shared``: on the prefill, a fresh prompt and then the same prompt again:
  hit TTFT over miss TTFT (vLLM's device prefix cache is off there: the hit comes from the host
  pool, loaded layer by layer into the shared buffers; goal <= 0.3);
- ``shared_tokens_equal``: the long prompt's tokens on the prefill equal the plain server's, and the
  hit's equal the miss's.
"""

from __future__ import annotations

import re

from kvoffload_testing.prom import scrape

GOAL_TIME_RATIO = 1.25
GOAL_HIT_RATIO = 0.3
GOAL_CAPACITY_SHARE = 0.95
KV_BYTES_SLACK = 1.01


def capacity_tokens(url: str) -> int:
    """Tokens vLLM's KV cache on ``url`` holds: ``num_gpu_blocks`` x ``block_size`` of its cache config."""
    (info,) = scrape(url).label_sets("vllm:cache_config_info")
    return int(info["num_gpu_blocks"]) * int(info["block_size"])


def buffer_plan(log_text: str) -> tuple[int, int]:
    """(buffers, layers) from a prefill's ``kvoffload_shared_buffers`` start-up line."""
    line = re.search(r"kvoffload_shared_buffers\s.*", log_text)
    if line is None:
        raise RuntimeError("the prefill logged no kvoffload_shared_buffers line: it runs without shared buffers")
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


def shared_figures(stream, prefill, name: str, tokens: int, plain: dict) -> dict:
    """The prefill's side against ``plain`` (``baseline``'s): the ``prefill_*`` and ``*_shared`` figures."""
    buffers, layers = buffer_plan(prefill.log_text())
    capacity = capacity_tokens(prefill.url)
    ttft, out, _ = stream(prefill.url, name, long_prompt(tokens, 1), 4)
    hit_prompt = long_prompt(tokens, 2)
    miss_ttft, miss_tokens, _ = stream(prefill.url, name, hit_prompt, 4)
    hit_ttft, hit_tokens, _ = stream(prefill.url, name, hit_prompt, 4)
    return {
        "shared_prompt_tokens": tokens,
        "prefill_buffers": buffers,
        "prefill_layers": layers,
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


def shared_goals(out: dict) -> tuple[dict, dict]:
    """(goals, met) of the shared-buffer figures."""
    share = out["prefill_buffers"] / out["prefill_layers"]
    goals = {
        "prefill_kv_bytes_ratio": share,
        "prefill_capacity_ratio": GOAL_CAPACITY_SHARE / share,
        "prefill_time_ratio_shared": GOAL_TIME_RATIO,
        "ttft_ratio_prefix_hit_shared": GOAL_HIT_RATIO,
        "shared_tokens_equal": True,
    }
    met = {
        "prefill_kv_bytes_ratio": out["prefill_kv_bytes_ratio"] <= share * KV_BYTES_SLACK,
        "prefill_capacity_ratio": out["prefill_capacity_ratio"] >= GOAL_CAPACITY_SHARE / share,
        "prefill_time_ratio_shared": out["prefill_time_ratio_shared"] <= GOAL_TIME_RATIO,
        "ttft_ratio_prefix_hit_shared": out["ttft_ratio_prefix_hit_shared"] <= GOAL_HIT_RATIO,
        "shared_tokens_equal": out["shared_tokens_equal"],
    }
    return goals, met
