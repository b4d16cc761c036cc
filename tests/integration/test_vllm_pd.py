"""P/D under vLLM: a vLLM prefill and a vLLM decode (``SfaRemoteD2HConnector``) behind the kvoffload proxy.

The stack is ``kvoffload demo --engine vllm``'s (``VllmStack``, on free loopback ports): the prefill
runs the guide's MultiConnector (remote D2H producer + the store on a real metastore), the decode the
D2H consumer, the proxy is the one the reference stack uses, unchanged. A random 6-layer Llama (fp32)
keeps it fast; its prefill keeps 4 shared layer buffers for the 6 layers.

- The demo's request answers, and the decode took the prompt's KV from the prefill (every number the
  demo prints, checked).

- Greedy tokens through the proxy equal one plain vLLM server's (no connector), for prompts of 1,
  block_size - 1, 2,100 and 8,000 tokens, completions and chat, streaming and not, 8 at once. The
  decode computes the last prompt token itself (vLLM's P/D: it samples the first token), over the
  pulled KV, in a kernel call of its own: log-probabilities are compared within 1e-3. The plain
  server, stopped then, leaves no process behind.
- Layerwise: the decode had pulled early layers before the prefill announced the last one (the
  producer measures it per request), and it moved the prompt's blocks, no more.
- The metastore gone: requests are still served through P/D, without the prefix cache, with a log.
- Faults (a stalled or killed decode, a killed prefill) are ``test_vllm_pd_faults.py``'s, on SmolLM2.
- Configs vLLM must refuse at start-up: ``test_vllm_refusals.py``.
"""

from __future__ import annotations

import json
import math
import re
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm_support import chat, completion, tiny_llama_dir

from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.sse import sse_events
from kvoffload_testing.stack import StackConfig
from kvoffload_testing.vllm_demo import demo
from kvoffload_testing.vllm_server import VllmServer
from kvoffload_testing.vllm_stack import VllmStack, split_cores
from svcruntime.processgroup import group_members

pytestmark = pytest.mark.vllm

BLOCK = 128  # vLLM's CPU default block size
LAYERS = 6
TOLERANCE = 1e-3
PROMPTS = {
    "one": [1000],
    "block-1": list(range(2000, 2000 + BLOCK - 1)),
    "long": [(i * 7919) % 40000 + 1000 for i in range(2100)],
    "8k": [(i * 6133) % 40000 + 1000 for i in range(8000)],  # several prefill chunks over the shared buffers
}
MAX_LEN = 8192 + 64
CHAT = [{"role": "user", "content": "Name three colours of the rainbow, one per line."}]
# the stack puts the prefill on one half of the cores, the decode on the other; the plain server it is
# compared with runs on the decode's
HALVES = split_cores()
DECODE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": HALVES[1]} if HALVES else {}


def stream_text(url: str, path: str, body: dict) -> str:
    """The text of a streamed answer (SSE), pieced together from its deltas."""
    req = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    text = []
    with urllib.request.urlopen(req, timeout=180) as resp:
        for event in sse_events(resp):
            choice = event["choices"][0]
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def answers(url: str) -> dict[str, object]:
    """Every request of the comparison, against ``url``: (tokens, logprobs) or text per case."""
    out: dict[str, object] = {}
    for name, prompt in PROMPTS.items():
        lp = completion(url, prompt, 12, logprobs=1, timeout_s=180)["choices"][0]["logprobs"]
        out[f"completion-{name}"] = (lp["tokens"], lp["token_logprobs"])
        out[f"stream-{name}"] = stream_text(
            url, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        )
    content = chat(url, CHAT, 16, logprobs=True, timeout_s=180)["choices"][0]["logprobs"]["content"]
    out["chat"] = ([c["token"] for c in content], [c["logprob"] for c in content])
    out["chat-stream"] = stream_text(
        url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 16, "temperature": 0}
    )
    burst = [[3000 + 17 * i + j for j in range(150 + 100 * i)] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        texts = pool.map(lambda p: completion(url, p, 8, timeout_s=300)["choices"][0]["text"], burst)
    out["burst"] = list(texts)
    return out


def same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        if isinstance(want[key], tuple):
            (tokens, logprobs), (want_tokens, want_logprobs) = got[key], want[key]
            assert tokens == want_tokens, key
            worst = max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True))
            assert worst < TOLERANCE, (key, worst)
        else:
            assert got[key] == want[key], key


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "llama6", num_layers=LAYERS, max_positions=MAX_LEN)


@pytest.fixture(scope="module")
def pd(model, tmp_path_factory):
    """The demo's stack (``kvoffload demo --engine vllm``: metastore, the P/D pair, the proxy) and a
    plain vLLM server without any connector (on the decode's cores), started side by side."""
    logs = tmp_path_factory.mktemp("pd")
    stack = VllmStack(StackConfig(model=model, log_dir=logs, max_model_len=MAX_LEN, **free_stack_ports()))
    plain = VllmServer(model, max_model_len=MAX_LEN, log_path=logs / "plain.log", env=DECODE_ENV)
    try:
        with ThreadPoolExecutor(1) as pool:
            plain_up = pool.submit(plain.start)
            stack.start(progress=False)
            plain_up.result()
        yield PD(stack, plain)
    finally:
        plain.stop()
        stack.stop()


class PD:
    """The running stack's parts, by what the tests ask of them."""

    def __init__(self, stack: VllmStack, plain: VllmServer) -> None:
        self.stack, self.plain = stack, plain
        self.proxy_url = stack.url
        self.prefill_url = f"http://{stack.cfg.host}:{stack.cfg.prefill_ports[0]}"

    def log(self, name: str) -> str:
        """The log of the stack's service ``name`` ("prefill-0", "decode-0", "proxy")."""
        return (self.stack.cfg.log_dir / f"{name}.log").read_text(errors="replace")


def test_the_demo_answers_and_the_decode_pulls_the_prompt_kv(pd):
    """``kvoffload demo --engine vllm``'s request on this stack (first: nothing else has run): one chat
    through the proxy comes back with tokens, and the decode took the prompt's KV from the prefill
    instead of computing it — vLLM's counters say its prompt tokens came from a KV transfer, the
    connector logged the pull and no failed one, every server answers /metrics after the request, and
    the proxy saw the decode register and the request succeed: every number here is one the demo prints."""
    text, summary = demo(pd.stack, max_tokens=8, timeout_s=240)
    print(summary)
    decode, prefill, proxy = summary["decode-0"], summary["prefill-0"], summary["proxy"]
    assert not any("error" in summary[name] for name in ("decode-0", "prefill-0", "proxy")), summary
    assert summary["completion_tokens"] > 0 and summary["prompt_tokens"] > 128 and isinstance(text, str), summary
    # the proxy ran the P/D flow: the decode registered, the request succeeded, nothing was retried
    # (a vLLM decode does not wait for the registration's answer — it needs only the pulled layers — so
    # on a busy machine the request may finish first and the proxy answers the still-open registration
    # "cancelled": either way, exactly one)
    assert proxy["requests"] == {"chat:ok": 1}, summary
    registrations = proxy["metaserver_registrations"]
    assert sum(registrations.values()) == 1 and set(registrations) <= {"ok", "cancelled"}, summary
    assert proxy["backend_retries"] == 0, summary
    # the prefill computed the prompt; the decode took it from the transfer (vLLM computes the last
    # prompt token itself), and no pull failed (vLLM would have recomputed it)
    assert prefill["prompt_tokens_computed"] >= summary["prompt_tokens"] - 1, summary
    assert decode["prompt_tokens_pulled"] >= summary["prompt_tokens"] - 1, summary
    assert decode["prompt_tokens_computed"] <= 1, summary
    assert decode["pulls_logged"] == 1 and decode["bytes_pulled"] > 0, summary
    assert decode["pull_failures_logged"] == decode["load_failures_recovered_by_vllm"] == 0, summary
    assert decode["generation_tokens"] >= 1, summary


def test_greedy_tokens_through_the_proxy_equal_one_plain_vllm_server(pd):
    want = answers(pd.plain.url)
    pgid = pd.plain.proc.pid
    assert group_members(pgid), "the plain server's process group is empty while it runs"
    pd.plain.stop()  # its cores to the decode; it leaves no process behind
    assert pd.plain.proc.returncode is not None and group_members(pgid) == []
    same(answers(pd.proxy_url), want)
    decode_log, prefill_log = pd.log("decode-0"), pd.log("prefill-0")
    assert "kvoffload_d2h_pulled" in decode_log and "kvoffload_d2h_load_failed" not in decode_log, decode_log[-3000:]
    assert "kvoffload_d2h_sent" in prefill_log and "kvoffload_d2h_reads_failed" not in prefill_log


@pytest.mark.slow
def test_the_pull_is_layerwise_and_moves_the_prompts_blocks(pd):
    prompt = [(i * 104729) % 40000 + 1000 for i in range(3000)]  # not seen before: no prefix-cache hit
    completion(pd.proxy_url, prompt, 2, timeout_s=180)
    decode_log, prefill_log = pd.log("decode-0"), pd.log("prefill-0")
    pulled = [
        (int(t), int(b)) for t, b in re.findall(r"kvoffload_d2h_pulled\s.*?bytes=(\d+).*?tokens=(\d+)", decode_log)
    ]
    block_bytes = 2 * 2 * 32 * BLOCK * 4  # K and V, 2 KV heads of 32, fp32, per layer
    assert (math.ceil(3000 / BLOCK) * block_bytes * LAYERS, 3000) in [(b, t) for b, t in pulled], pulled
    during = [int(n) for n in re.findall(r"kvoffload_d2h_sent\s.*?layers_read_during_forward=(\d+)", prefill_log)]
    assert during and max(during) >= 1, prefill_log[-3000:]  # an early layer landed while later ones computed


@pytest.mark.slow
def test_with_the_metastore_gone_requests_are_still_served(pd):
    pd.stack.signal("metastore", signal.SIGKILL)
    prompt = PROMPTS["long"][::-1]  # not seen before: the prefill asks the (gone) metastore for it
    got = completion(pd.proxy_url, prompt, 12, timeout_s=180)["choices"][0]["text"]
    assert got == completion(pd.prefill_url, prompt, 12, timeout_s=180)["choices"][0]["text"]
    assert "kvoffload_lookup_failed" in pd.log("prefill-0")
