"""P/D under vLLM with its hybrid KV cache manager on: ``SfaRemoteD2HConnector`` on a hybrid model.

A tiny Llama whose odd layers are sliding-window attention of 64 tokens (two KV cache groups of
128-token blocks, each with its own block table; the groups' layers alias one storage, a block id
belonging to one group at a time). The prefill runs the D2H producer next to the store (no shared
layer buffers: they take one group only), the decode the D2H consumer, behind the kvoffload proxy;
both keep the hybrid KV cache manager on (no log says it was turned off).

- Greedy tokens through the proxy equal a plain vLLM server's (no connector) for prompts of 1, 127,
  700 and 2,100 tokens, one streamed, and a chat; log-probabilities within 1e-3 (the decode computes
  the last prompt token itself over the pulled KV). A pull that moved a layer through the other
  group's blocks, or wrote the decode's null block, would change both.
- Every layer of every pulled request landed (the decode logs each layer's blocks): the
  full-attention layers every block of the prompt, the sliding-window layers only the few blocks
  their window reaches into (vLLM gives the others the null block on the decode: never pulled).
"""

from __future__ import annotations

import re

import pytest
from vllm_support import chat, completion, stream_choices, tiny_llama_dir

from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.vllm_server import Metastore, Proxy, VllmServer, running
from kvoffload_testing.vllm_stack import split_cores, vllm_decode_transfer_config, vllm_prefill_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128  # vLLM's CPU default block size, both groups'
LAYERS, WINDOW = 4, 64  # layers 1 and 3 sliding-window attention
TOLERANCE = 1e-3
PROMPTS = {
    "one": [1000],
    "block-1": list(range(2000, 2000 + BLOCK - 1)),
    "700": [(i * 6133) % 40000 + 1000 for i in range(700)],
    "2100": [(i * 7919) % 40000 + 1000 for i in range(2100)],
}
CHAT = [{"role": "user", "content": "Name three colours of the rainbow, one per line."}]
HALVES = split_cores() or ("", "")  # the prefill on one half of the cores, the decode and the plain server on the other
PREFILL_ENV = {"VLLM_CPU_OMP_THREADS_BIND": HALVES[0]} if HALVES[0] else {}
DECODE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": HALVES[1]} if HALVES[1] else {}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """A metastore, the P/D pair behind the proxy and a plain server, the vLLM servers started side by side."""
    logs = tmp_path_factory.mktemp("pd-hybrid")
    model = tiny_llama_dir(logs / "hybrid", num_layers=LAYERS, sliding_window=WINDOW)
    ports = free_stack_ports(1, 1)

    def server(name: str, env: dict, port: int | None = None, kv_config: str | None = None) -> VllmServer:
        kv = ["--kv-transfer-config", kv_config] if kv_config else []
        return VllmServer(model, port=port, max_model_len=4096, log_path=logs / f"{name}.log", env=env, extra_args=kv)

    with Metastore(logs / "metastore.log") as ms:
        prefill_kv = vllm_prefill_transfer_config(ms.address, shared_buffers=None)
        prefill = server("prefill", PREFILL_ENV, ports["prefill_ports"][0], prefill_kv)
        decode = server("decode", DECODE_ENV, ports["decode_ports"][0], vllm_decode_transfer_config(ports["kv_port"]))
        with running(prefill, decode, server("plain", DECODE_ENV)) as (_, _, plain):
            proxy = Proxy(ports["proxy_port"], prefill.port, decode.port, logs / "proxy.log")
            try:
                yield {"proxy": proxy, "prefill": prefill, "decode": decode, "plain": plain}
            finally:
                proxy.close()


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


def test_pd_on_the_hybrid_manager_answers_as_one_plain_server_and_pulls_every_layer(pd):
    for name in ("prefill", "decode"):
        assert "Turning off hybrid kv cache manager" not in pd[name].log_text(), name
    want = answers(pd["plain"].url)
    pd["plain"].stop()  # its cores to the decode
    got = answers(pd["proxy"].url)
    assert got.keys() == want.keys()
    for key, (want_tokens, want_logprobs) in want.items():
        tokens, logprobs = got[key]
        assert tokens == want_tokens, key
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < TOLERANCE, key
    decode_log, prefill_log = pd["decode"].log_text(), pd["prefill"].log_text()
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
