"""Both kvoffload connectors inside real vLLM servers on a hybrid model, vLLM's hybrid KV cache manager on.

The model: a tiny Llama whose odd layers are sliding-window attention of 64 tokens (two KV cache
groups of 128-token blocks, each with its own block table; the groups' layers alias one storage, a
block id belonging to one group at a time; blocks out of a window become vLLM's null block). One
metastore; server A is the P/D prefill (the D2H producer next to the store, no shared layer
buffers: they take one group), B a second store server, D the P/D decode, and a plain server
without any connector: all started side by side, the proxy in front of A and D. No log says the
hybrid manager was turned off. B names no metastore in its config: it reads the guide's
mmc-local.conf through ``$MMC_LOCAL_CONFIG_PATH`` (its ``ock.mmc.meta_service_url``); D, given the same
variable, says its connector reads no mmc file.

- Store, prefix reuse across instances: A serves a ~2K-token prompt and saves every group's full
  blocks to the pools it contributes, one per group (alive as long as A is); B, fresh, given the
  prompt plus a new suffix, loads them (vLLM's ``external_prefix_cache_hits`` counts the tokens; the
  full-attention group loads all 16 blocks, the sliding-window group only the last one) and answers
  with the plain server's tokens, log-probabilities within 1e-3. A load that reported the hit but
  skipped the copy, or wrote a group's blocks into the other group's, would change both. While the
  forward goes on, the layers already computed are saved (layerwise).
- P/D: greedy tokens through the proxy equal the plain server's for prompts of 1, 127, 700 and 2,100
  tokens (the 2,100-token one begins with the prefix A computed before: A's own prefix-cache hit is
  sent on too), one streamed, and a chat; log-probabilities within 1e-3. Every layer of every pulled request landed
  (the decode logs each layer's blocks): the full-attention layers every block of the prompt, the
  sliding-window layers only the few blocks their window reaches into (the decode's null blocks are
  never pulled). The decode reads the blocks through Mooncake Transfer Engine (``transfer_backend:
  "mooncake"`` on both, one host): each worker registers the storage its groups' layers alias once,
  and every read lands straight in the request's blocks of the layer's own group (none streamed).
- The MetaStore gone: requests are still served (no prefix cache), with a log line saying why.
- Configs vLLM must refuse at start-up: ``test_vllm_refusals.py``.
"""

from __future__ import annotations

import re

import pytest
from vllm_support import chat, completion, store_config, stream_choices, tiny_llama_dir

from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.prom import metric
from kvoffload_testing.vllm_server import Metastore, Proxy, VllmServer, running
from kvoffload_testing.vllm_stack import split_cores, vllm_decode_transfer_config, vllm_prefill_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128  # vLLM's CPU default block size, both groups'
LAYERS, WINDOW = 4, 64  # layers 1 and 3 sliding-window attention
TOLERANCE = 1e-3
TRANSFER = "mooncake"  # the P→D pull's transfer_backend on A and D
PREFIX = [(i * 7919) % 40000 + 1000 for i in range(16 * BLOCK + 40)]  # 16 full blocks + a partial one
PROMPTS = {
    "one": [1000],
    "block-1": list(range(2000, 2000 + BLOCK - 1)),
    "700": [(i * 6133) % 40000 + 1000 for i in range(700)],
    "2100": [(i * 7919) % 40000 + 1000 for i in range(2100)],  # PREFIX and more
}
CHAT = [{"role": "user", "content": "Name three colours of the rainbow, one per line."}]
HALVES = split_cores() or ("", "")  # the prefill on one half of the cores, the decode and the plain server on the other
PREFILL_ENV = {"VLLM_CPU_OMP_THREADS_BIND": HALVES[0]} if HALVES[0] else {}
DECODE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": HALVES[1]} if HALVES[1] else {}


def greedy(url: str, prompt: list[int], n: int = 12) -> tuple[list[str], list[float]]:
    out = completion(url, prompt, n, logprobs=1)["choices"][0]["logprobs"]
    return out["tokens"], out["token_logprobs"]


def by_group(log: str, event: str, field: str) -> list[tuple[int, int]]:
    """(group, ``field``) of every ``event`` line of a connector's log."""
    lines = [line for line in log.splitlines() if re.search(rf"\b{event}\b", line)]
    return [(int(re.search(r"\bgroup=(\d+)", x)[1]), int(re.search(rf"\b{field}=(\d+)", x)[1])) for x in lines]


def answers(url: str) -> dict[str, tuple[list[str], list[float]]]:
    """(tokens, logprobs) of every request of the comparison, against ``url``."""
    out = {}
    for name, prompt in PROMPTS.items():
        lp = completion(url, prompt, 8, logprobs=1, timeout_s=180)["choices"][0]["logprobs"]
        out[name] = (lp["tokens"], lp["token_logprobs"])
    body = {"prompt": PROMPTS["700"][::-1], "max_tokens": 8, "temperature": 0, "logprobs": 1}
    streamed = [c["logprobs"] for c in stream_choices(url, "/v1/completions", body) if c.get("logprobs")]
    out["stream"] = ([t for lp in streamed for t in lp["tokens"]], [x for lp in streamed for x in lp["token_logprobs"]])
    content = chat(url, CHAT, 12, logprobs=True, timeout_s=180)["choices"][0]["logprobs"]["content"]
    out["chat"] = ([c["token"] for c in content], [c["logprob"] for c in content])
    return out


def pulled_layer_blocks(decode_log: str) -> dict[int, list[list[int]]]:
    """Prompt tokens -> the blocks each layer wrote (wire order: full layers 0, 2, then sliding 1, 3), per
    ``kvoffload_d2h_pulled`` line of the decode."""
    out: dict[int, list[list[int]]] = {}
    for line in decode_log.splitlines():
        if re.search(r"\bkvoffload_d2h_pulled\b", line):
            blocks = [int(n) for n in re.search(r"layer_blocks=\[([\d, ]*)\]", line)[1].split(",")]
            out.setdefault(int(re.search(r"\btokens=(\d+)", line)[1]), []).append(blocks)
    return out


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The metastore, A (the P/D prefill), B, D (the P/D decode) and the plain server, the vLLM servers
    started side by side, and the proxy. The prefix-reuse test runs first (B gets no request until A
    saved, so B starts fresh); the P/D test then stops the plain server; the metastore-gone test kills
    this metastore, so it comes last."""
    logs = tmp_path_factory.mktemp("hybrid")
    model = tiny_llama_dir(logs / "hybrid", num_layers=LAYERS, sliding_window=WINDOW)
    ports = free_stack_ports(1, 1)

    def server(name: str, env: dict, port: int | None = None, kv_config: str | None = None) -> VllmServer:
        kv = ["--kv-transfer-config", kv_config] if kv_config else []
        return VllmServer(model, port=port, max_model_len=4096, log_path=logs / f"{name}.log", env=env, extra_args=kv)

    with Metastore(logs / "metastore.log") as ms:
        a = server(
            "a", PREFILL_ENV, ports["prefill_ports"][0], vllm_prefill_transfer_config(ms.address, None, TRANSFER)
        )
        mmc = logs / "mmc-local.conf"  # B's metastore: the guide's file, through the guide's variable
        mmc.write_text(f"ock.mmc.meta_service_url = tcp://{ms.address}\nock.mmc.local_service.dram.size = 256MB\n")
        mmc_env = {"MMC_LOCAL_CONFIG_PATH": str(mmc)}
        b = server("b", {**PREFILL_ENV, **mmc_env}, kv_config=store_config(None))
        d_config = vllm_decode_transfer_config(ports["kv_port"], TRANSFER)
        d = server("d", {**DECODE_ENV, **mmc_env}, ports["decode_ports"][0], d_config)
        with running(a, b, d, server("plain", DECODE_ENV)) as (_, _, _, plain):
            proxy = Proxy(ports["proxy_port"], a.port, d.port, logs / "proxy.log")
            try:
                yield {"metastore": ms, "a": a, "b": b, "d": d, "plain": plain, "proxy": proxy}
            finally:
                proxy.close()


def test_a_fresh_server_loads_the_prefix_another_saved_and_answers_as_without_the_pool(servers):
    a, b, plain = servers["a"], servers["b"], servers["plain"]
    for name in ("a", "b", "d", "plain"):  # the hybrid KV cache manager stays on with both connectors
        assert "Turning off hybrid kv cache manager" not in servers[name].log_text(), name
    assert sorted(g for g, _ in by_group(a.log_text(), "kvoffload_pool_registered", "objects")) == [0, 1]
    # B names no metastore: it took the one its mmc-local.conf names (and its pool size); the decode's
    # D2H connector keeps no pool and says it reads neither file
    # (each side of a connector, scheduler and worker, reads its config once)
    taken = [x for x in b.log_text().splitlines() if "kvoffload_metastore_from_mmc_conf" in x]
    assert taken and all(f"metastore={servers['metastore'].address}" in x for x in taken), taken
    assert all("mmc-local.conf:1" in x for x in taken), taken  # where it came from
    unread = [x for x in servers["d"].log_text().splitlines() if "$MMC_LOCAL_CONFIG_PATH=" in x]
    assert unread and all("kvoffload_config_ignored" in x for x in unread), unread
    prefix = PREFIX
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


def test_pd_on_the_hybrid_manager_answers_as_one_plain_server_and_pulls_every_layer(servers):
    want = answers(servers["plain"].url)
    servers["plain"].stop()  # its cores to the decode
    got = answers(servers["proxy"].url)
    assert got.keys() == want.keys()
    for key, (want_tokens, want_logprobs) in want.items():
        tokens, logprobs = got[key]
        assert tokens == want_tokens, key
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < TOLERANCE, key
    decode_log, prefill_log = servers["d"].log_text(), servers["a"].log_text()
    assert "kvoffload_d2h_load_failed" not in decode_log, decode_log[-3000:]
    assert "kvoffload_d2h_sent" in prefill_log and "kvoffload_d2h_reads_failed" not in prefill_log
    pulled = pulled_layer_blocks(decode_log)
    for tokens in (len(p) for p in PROMPTS.values()):
        for full_0, full_2, sliding_1, sliding_3 in pulled[tokens]:
            nblocks = -(-tokens // BLOCK)
            assert full_0 >= nblocks and full_2 >= nblocks, (tokens, pulled[tokens])
            # the window (64 tokens) reaches into at most two blocks, the decode nulls the rest (each block
            # written at most twice: partly by one prefill chunk, whole by the next)
            assert 1 <= sliding_1 <= 4 and 1 <= sliding_3 <= 4, (tokens, pulled[tokens])
    reads = {
        n: metric(servers["d"].url, f"vllm:kvoffload_d2h_consumer_{n}_total")
        for n in ("reads_engine", "reads_streamed")
    }
    assert reads["reads_engine"] >= LAYERS * len(PROMPTS) and reads["reads_streamed"] == 0, reads
    assert metric(servers["a"].url, "vllm:kvoffload_d2h_producer_bytes_served_total") == 0  # nothing streamed


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
