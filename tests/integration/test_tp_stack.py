"""Tensor-parallel prefill in the P/D stack: a prefill with ``--tensor-parallel-size 2`` (rank 0 the
service, rank 1 a process it started, gloo between them) and a TP 1 decode with MTP drafting, on a
float32 tiny model (a TP size sums its partial results in another order: in float32 the greedy
tokens equal the one-rank engine's; in bf16 they may not). I3 through the proxy; the decode accepted
one layout from each prefill rank and pulled each rank's share of every layer out of that rank's
own buffers, one copy of the prompt in all; and when rank 1 dies the prefill says so (not ready, naming the
rank) and fails requests at once instead of waiting on it."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.error
import urllib.request

import pytest

from dsamodel.presets import write_tiny
from dsamodel.tokenizer import ByteTokenizer
from kvoffload_testing.oracle import greedy_reference
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import post_json, stack_stats, stream_token_ids

pytestmark = [pytest.mark.stack, pytest.mark.slow]

BS = 16
TOK = ByteTokenizer()
LONG_TEXT = "".join(chr(32 + (i * 7919) % 90) for i in range(3000))
ARGS = {
    "prefill-0": ["--tensor-parallel-size", "2"],
    "decode-0": ["--speculative-config", json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 1})],
}


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("model32") / "tiny", dtype="float32")


@pytest.fixture(scope="module")
def stack(model32, tmp_path_factory):
    cfg = StackConfig(
        model=model32,
        log_dir=tmp_path_factory.mktemp("tp") / "logs",
        **free_stack_ports(1, 1),
        max_model_len=4096,
        block_size=BS,
        service_args=ARGS,
    )
    with Stack(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def reference(model32):
    return greedy_reference(model32, block_size=BS, max_model_len=4096)


@pytest.mark.parametrize("prompt", [[65], "long"], ids=["1", "3000"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_i3_with_a_tp2_prefill(stack, reference, prompt, stream):
    ids = TOK.encode(LONG_TEXT, add_bos=True) if prompt == "long" else prompt
    body = {"prompt": ids, "max_tokens": 10, "temperature": 0}
    url = f"{stack.url}/v1/completions"
    got = stream_token_ids(url, body) if stream else post_json(url, body)["choices"][0]["token_ids"]
    assert got == reference(ids, 10)


def test_the_decode_accepted_a_prefill_tp2_layout(stack):
    [joined] = stack.events("prefill-0", "tp_ranks_joined")
    assert joined["size"] == 2 and len(joined["pids"]) == 1
    accepted = [e for e in stack.events("decode-0", "layout_exchange") if e["accepted"]]
    assert accepted and all(
        (e["prefill_tp_size"], e["decode_tp_rank"], e["decode_tp_size"]) == (2, 0, 1) for e in accepted
    ), accepted
    assert sorted(e["prefill_tp_rank"] for e in accepted) == [0, 1]  # one layout per prefill rank


def test_each_prefill_rank_sends_its_share_and_the_shares_make_one_copy(stack, model32, reference):
    """The decode pulled a request's KV from both prefill ranks (its contributor group), each rank's
    half out of that rank's own buffers, and the halves sum to one copy of the prompt's KV."""
    from dsamodel.weights import load_model
    from kvoffload_engine.model_layout import kv_layout

    model = load_model(str(model32))
    one_row = sum(s.main.row_bytes + s.indexer.row_bytes for s in kv_layout(model.config, BS, model.dtype).layers)
    ids = TOK.encode(LONG_TEXT[::-1][:2000], add_bos=True)  # a prompt no earlier test sent: no prefix hit
    before = stack_stats(stack.cfg)["decode-0"]
    got = post_json(f"{stack.url}/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0})
    after = stack_stats(stack.cfg)["decode-0"]
    assert got["choices"][0]["token_ids"] == reference(ids, 4)
    delta = {
        k: after[k] - before.get(k, 0)
        for k in ("bytes_read", "bytes_read_prefill_tp_rank_0", "bytes_read_prefill_tp_rank_1")
    }
    assert delta["bytes_read"] == len(ids) * one_row
    assert delta["bytes_read_prefill_tp_rank_0"] + delta["bytes_read_prefill_tp_rank_1"] == delta["bytes_read"]
    for rank in (0, 1):
        assert 0.4 < delta[f"bytes_read_prefill_tp_rank_{rank}"] / delta["bytes_read"] < 0.6, delta
    accepted = {e["prefill_tp_rank"] for e in stack.events("decode-0", "layout_exchange") if e["accepted"]}
    assert accepted == {0, 1}


def test_a_dead_rank_makes_the_prefill_not_ready_and_requests_fail_fast(stack):
    """Last (it kills rank 1)."""
    [joined] = stack.events("prefill-0", "tp_ranks_joined")
    import os

    os.kill(joined["pids"][0], signal.SIGKILL)
    health = f"http://{stack.cfg.host}:{stack.cfg.prefill_ports[0]}/health"
    deadline, status, text = time.monotonic() + 10, 200, ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(health, timeout=5) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
        if status != 200:
            break
        time.sleep(0.2)
    assert status == 503 and re.search(r"TP rank 1 \(pid \d+\) exited", text), (status, text)
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as info:
        post_json(f"{stack.url}/v1/completions", {"prompt": [65, 66], "max_tokens": 2, "temperature": 0})
    assert info.value.code >= 500 and time.monotonic() - t0 < 30
