"""The P/D stack with the P→D pull on Mooncake Transfer Engine (``transfer_backend: "mooncake"`` on the
prefill and the decode; ``StackConfig.transfer``): the prefill registers its layer-buffer segment with
its engine and advertises the session in its layout, the decode reads every announced layer through
its own engine (TCP, P2P handshake) into a registered staging buffer, never through shared memory or
the LayerSource stream, even on one host.

- I3 through it: greedy tokens equal the single process's, json and SSE, for prompts of 1 token,
  block_size - 1 tokens and 2,600 tokens (several chunks over the shared layer buffers).
- The decode's pull counters say every read went through the engine; the prefill's serving line
  names the engine's session; afterwards nothing is held on either side.
- A prefill whose --host is a wildcard cannot advertise a session: it exits 2 naming the engine and
  the rule, and never falls back to the embedded data path.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dsamodel.tokenizer import ByteTokenizer
from kvoffload_testing.connector_configs import prefill_kv_transfer_config
from kvoffload_testing.oracle import greedy_reference
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import post_json, stack_stats, stream_token_ids

pytestmark = [pytest.mark.stack]

BS = 16
TOK = ByteTokenizer()
LONG_TEXT = "".join(chr(32 + (i * 6133) % 90) for i in range(2600))


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    cfg = StackConfig(
        model=model_dir,
        log_dir=tmp_path_factory.mktemp("mooncake-transfer") / "logs",
        **free_stack_ports(),
        max_model_len=8192,
        block_size=BS,
        transfer="mooncake",
    )
    with Stack(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def reference(model_dir):
    return greedy_reference(model_dir, block_size=BS, max_model_len=8192)


@pytest.mark.parametrize("prompt", [[65], list(range(66, 66 + BS - 1)), "long"], ids=["1", "bs-1", "2600"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_i3_through_the_mooncake_transfer_engine(stack, reference, prompt, stream):
    ids = TOK.encode(LONG_TEXT, add_bos=True) if prompt == "long" else prompt
    body = {"prompt": ids, "max_tokens": 10, "temperature": 0}
    url = f"{stack.url}/v1/completions"
    got = stream_token_ids(url, body) if stream else post_json(url, body)["choices"][0]["token_ids"]
    assert got == reference(ids, 10)


def test_every_read_went_through_the_engine_and_nothing_is_held(stack):
    post_json(f"{stack.url}/v1/completions", {"prompt": "one more", "max_tokens": 3, "temperature": 0})
    stats = stack_stats(stack.cfg)
    decode, prefill = stats["decode-0"], stats["prefill-0"]
    assert decode["reads_engine"] >= 1 and decode["read_done"] == decode["reads_engine"], decode
    assert decode["reads_shared_memory"] == decode["reads_streamed"] == decode["read_failed"] == 0, decode
    assert decode["bytes_read"] > 0
    assert prefill["held_slots"] == 0 and prefill["pool_live_leases"] == 0, prefill
    assert decode["pool_used_bytes"] == 0 and decode["sequences"] == 0, decode
    [serving] = stack.events("prefill-0", "serving")
    assert serving["transfer_backend"] == "mooncake" and serving["engine_session"].startswith("127.0.0.1:"), serving
    [started] = stack.events("decode-0", "mooncake_transfer_started")
    assert started["session"] != serving["engine_session"]  # each side its own engine


def test_a_prefill_on_a_wildcard_host_cannot_advertise_a_session_and_exits_2(model_dir):
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("kvoffload-prefill")),
            "--model",
            str(model_dir),
            "--host",
            "0.0.0.0",
            "--port",
            "1",
            "--kv-transfer-config",
            prefill_kv_transfer_config(20050, transfer="mooncake"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("kvoffload-prefill: "))
    assert line.startswith("kvoffload-prefill: transfer_backend 'mooncake': host must be the IPv4 address"), line
    assert "got '0.0.0.0'" in line, line
