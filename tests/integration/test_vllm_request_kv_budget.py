"""The host copies' budget (``layerwise_request_kv_gb``) in a real vLLM server: prompts past it wait,
one after another, and are served; never past the budget, never an OOM.

One metastore and one vLLM prefill on a tiny 4-layer Llama (float32, vLLM's CPU blocks of 128
tokens: 64 KiB a layer's block) whose store keeps shared layer buffers (``layerwise_num_shared_buffers:
1``: layer 0 alone, layers 1-3 on one buffer, so a request's host copy holds 3 layers: 192 KiB a block
position). Its budget, 0.002 GiB (2,147,483 bytes), holds one request of ``max_model_len`` 1,024
(8 blocks: 1.5 MiB) but not ``--max-num-seqs`` 4 of them: start-up warns, naming the key, with the
sizes vLLM's own config gives. Three 600-token prompts asking for 100 tokens each (6 blocks, 1.125 MiB:
two do not fit) sent at once run one at a time: two wait (``kvoffload_request_kv_wait`` names the
key), no step holds two of them, the host copies never pass the budget, and every one is answered
in full, its first tokens those the server gives the same prompt alone (log-probabilities within
1e-3; that pass loads the prompt's full blocks from the pool). The arithmetic and the refusal of a
budget below one request: ``libs/kvoffload_vllm/tests/test_request_kv_budget.py``.
"""

from __future__ import annotations

import ast
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from vllm_support import completion, store_config, tiny_llama_dir

from kvoffload_testing.vllm_server import Metastore, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LAYERS, SHARED_LAYERS = 4, 3
BLOCK, ROW = 128, 128 * 2 * 2 * 32 * 4  # vLLM's CPU block; a layer's block: 2 KV heads of 32, K and V, float32
MAX_LEN, MAX_SEQS = 1024, 4
BUDGET_GIB = 0.002
BUDGET = int(BUDGET_GIB * (1 << 30))
KEY = "kv_connector_extra_config.layerwise_request_kv_gb"
PROMPTS = [[(i * p) % 30000 + 1000 for i in range(600)] for p in (7919, 6133, 3581)]
NEW_TOKENS = 100
FIRST = 8  # the tokens compared with the prompt served alone
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("request-kv-budget")
    model = tiny_llama_dir(logs / "llama", num_layers=LAYERS)
    with Metastore(logs / "metastore.log") as ms:
        kv = store_config(ms.address, "kv_producer", layerwise_num_shared_buffers=1, layerwise_request_kv_gb=BUDGET_GIB)
        args = ["--kv-transfer-config", kv, "--max-num-seqs", str(MAX_SEQS)]
        with VllmServer(model, max_model_len=MAX_LEN, log_path=logs / "prefill.log", extra_args=args) as s:
            yield s


def events(log: str, event: str) -> list[dict[str, str]]:
    """Every ``event`` line of the server's log as its key=value fields (values as written)."""
    out = []
    for line in log.splitlines():
        if re.search(rf"\b{event}\b", line):
            out.append(dict(re.findall(r"(\w+)=(\[[^\]]*\]|\S+)", line)))
    return out


def answer(url: str, prompt: list[int], n: int) -> tuple[list[str], list[float], dict]:
    body = completion(url, prompt, n, logprobs=1, ignore_eos=True, timeout_s=600)
    lp = body["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"], body


def test_start_up_warns_that_max_num_seqs_requests_of_max_model_len_do_not_fit(server):
    log = server.log_text()
    (size,) = events(log, "kvoffload_request_kv_budget")
    one = -(-MAX_LEN // BLOCK) * SHARED_LAYERS * ROW  # 8 blocks × 3 layers × 64 KiB
    assert (int(size["budget_bytes"]), int(size["per_request_bytes"])) == (BUDGET, one)
    assert int(size["worst_case_bytes"]) == MAX_SEQS * one and KEY in size["source"]
    (short,) = events(log, "kvoffload_request_kv_budget_short")
    assert short["key"] == KEY and (short["requests_of_max_model_len"], short["max_num_seqs"]) == ("1", "4")


def test_prompts_past_the_budget_wait_one_after_another_and_are_served_in_full(server):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        queued = list(pool.map(lambda p: answer(server.url, p, NEW_TOKENS), PROMPTS))
    for tokens, _, body in queued:
        assert len(tokens) == NEW_TOKENS and body["choices"][0]["finish_reason"] == "length"
    log = server.log_text()
    waited = events(log, "kvoffload_request_kv_wait")
    assert len(waited) == 2 and {w["key"] for w in waited} == {KEY}  # the two behind the first, once each
    assert all(int(w["need_bytes"]) == 6 * SHARED_LAYERS * ROW for w in waited)
    steps = events(log, "kvoffload_shared_step")
    assert steps and all(len(ast.literal_eval(s["request_ids"])) == 1 for s in steps)  # one of them at a time
    assert max(int(s["host_copy_bytes"]) for s in steps) <= BUDGET
    for prompt, (tokens, logprobs, _) in zip(PROMPTS, queued, strict=True):
        alone, alone_logprobs, _ = answer(server.url, prompt, FIRST)
        assert tokens[:FIRST] == alone
        assert max(abs(a - b) for a, b in zip(logprobs[:FIRST], alone_logprobs, strict=True)) < TOLERANCE
    assert len(events(server.log_text(), "kvoffload_request_kv_wait")) == 2  # one at a time: nobody waited
