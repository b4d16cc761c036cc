"""P/D under vLLM: a vLLM prefill and a vLLM decode (``SfaRemoteD2HConnector``) behind the kvoffload proxy.

The stack is ``kvoffload demo --engine vllm``'s (``VllmStack``, on free loopback ports): the prefill
runs the guide's MultiConnector (remote D2H producer + the store on a real metastore), the decode the
D2H consumer, the proxy is the one the reference stack uses, unchanged. The decode runs across a
real network stack from the rest: in a network namespace of its own behind a veth pair
(``netns``: the metastore, prefill and proxy on this end of a veth pair, the decode on the other), and it reads
the prefill's blocks through Mooncake Transfer Engine (``transfer_backend: "mooncake"`` on both,
over TCP across the veth: every read straight into the decode's blocks, none streamed over gRPC;
Mooncake on one host is ``test_vllm_hybrid.py``'s, the gRPC stream under vLLM ``test_vllm_mla.py``'s).
A random 6-layer Llama (fp32) keeps it fast; its prefill keeps 4 shared layer buffers for the 6 layers.

- The demo's request answers, and the decode took the prompt's KV from the prefill (every number the
  demo prints, checked).
- Greedy tokens through the proxy equal one plain vLLM server's (no P/D, no shared buffers: its
  store connector only saves its KV to a pool of its own, for the byte comparisons below), for prompts of 1,
  block_size - 1, 2,100 and 8,000 tokens, completions and chat, streaming and not, 8 at once (the
  matrix of ``kvoffload bench vllm``: ``kvoffload_bench.pd_matrix``). The
  decode computes the last prompt token itself (vLLM's P/D: it samples the first token), over the
  pulled KV, in a kernel call of its own: log-probabilities are compared within 1e-3. The plain
  server, stopped then, leaves no process behind.
- Layerwise: the decode had pulled early layers before the prefill announced the last one (the
  producer measures it per request), and it moved the prompt's blocks, no more, every read through
  the engine.
- Faults, on the same stack (the prefill's 6 layers on 4 buffers: each step reuses every buffer while
  the decode still pulls), each killed server restarted on its port:
  - a stalled decode (SIGSTOP, shorter than the peer timeout): the prefill's next layer of a buffer
    waits at the reuse gate for the pulls of the buffer's previous layer (the prefill logs the wait),
    and once the decode resumes the request completes with the tokens the prefill alone gives; the
    decode pulled every layer's blocks of the prompt, no less, and byte for byte the plain server's
    (the decode's ``kv_digests`` against the plain server's pool objects);
  - slowed pool saves (the metastore, which every save calls, stopped and resumed over and over):
    the next layer of a buffer waits at the gate for the save of the buffer's previous layer, more
    than for the same kind of request unslowed; every block is saved, and the pool's copy and the
    decode's pulled KV are, layer by layer, byte for byte the plain server's;
  - kill -9 of the decode mid-pull: the failed reads release the gate (no ``ReuseTimeout``), the
    prefill holds no request and no KV, and with a new decode the next request succeeds;
  - kill -9 of the prefill mid-transfer: the client's request ends within the peer timeout (an error,
    or recomputed by the decode), the decode's KV usage returns to idle, and with a new prefill the
    next request succeeds.
- Last, the metastore gone: requests are still served through P/D, without the prefix cache, with a log.
- Configs vLLM must refuse at start-up: ``test_vllm_refusals.py``.
"""

from __future__ import annotations

import math
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from pool_pages import model_id, pages_digests, pool_pages, pulled_digests
from vllm_faults import gate_waits, idle, in_flight, slowed
from vllm_support import completion, store_config, tiny_llama_dir

from kvoffload_bench import pd_matrix
from kvoffload_testing.netns import Veth, split_decode, veth_namespace
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.prom import scrape
from kvoffload_testing.stack import StackConfig
from kvoffload_testing.vllm_demo import demo
from kvoffload_testing.vllm_server import Metastore, VllmServer
from kvoffload_testing.vllm_stack import (
    VllmStack,
    split_cores,
    vllm_decode_transfer_config,
    vllm_prefill_transfer_config,
)
from kvoffload_vllm.d2h_settings import DEFAULT_PEER_TIMEOUT_S
from svcruntime.processgroup import group_members, signal_group

pytestmark = pytest.mark.vllm

BLOCK = 128  # vLLM's CPU default block size
LAYERS = 6
BLOCK_BYTES = 2 * 2 * 32 * BLOCK * 4  # K and V, 2 KV heads of 32, fp32: one block of one layer
MAX_LEN = 8192 + 64
TRANSFER = "mooncake"  # the P→D pull's transfer_backend on both servers
# the stack puts the prefill on one half of the cores, the decode on the other; the plain server it is
# compared with runs on the decode's
HALVES = split_cores()
DECODE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": HALVES[1]} if HALVES else {}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "llama6", num_layers=LAYERS, max_positions=MAX_LEN)


class SplitVllmStack(VllmStack):
    """The vLLM stack with its decode in the veth's namespace on ``veth.there`` (its command run through
    ``ip netns exec``, its --host, health URL and the proxy's decoder host pointed there)."""

    def __init__(self, cfg: StackConfig, veth: Veth) -> None:
        self.veth = veth
        super().__init__(cfg)

    def commands(self) -> list[tuple[str, list[str], str]]:
        return split_decode(super().commands(), self.veth)


@pytest.fixture(scope="module")
def namespace():
    with veth_namespace() as veth:
        yield veth


@pytest.fixture(scope="module")
def pd(model, namespace, tmp_path_factory):
    """The demo's stack (``kvoffload demo --engine vllm``: metastore, the P/D pair, the proxy; its
    decode logs the digests of the KV it pulls) and a plain vLLM server (on the decode's cores:
    no P/D, no shared buffers; its store connector saves its KV to a pool of its own, on a metastore of
    its own), started side by side. Before anything else runs, the plain server computes the prompts
    whose pulled KV the fault tests compare byte for byte, and their blocks are read from its pool."""
    logs = tmp_path_factory.mktemp("pd")
    ports = free_stack_ports()
    # vLLM takes the last --kv-transfer-config: the stack's own, with each side's advertise_host (and kv_digests)
    metastore = f"{namespace.here}:{ports['metastore_port']}"
    producer = vllm_prefill_transfer_config(metastore, transfer_backend=TRANSFER, advertise_host=namespace.here)
    consumer = vllm_decode_transfer_config(ports["kv_port"], TRANSFER, kv_digests=True, advertise_host=namespace.there)
    cfg = StackConfig(
        model=model,
        log_dir=logs,
        max_model_len=MAX_LEN,
        host=namespace.here,
        transfer=TRANSFER,
        service_args={"prefill-0": ["--kv-transfer-config", producer], "decode-0": ["--kv-transfer-config", consumer]},
        **ports,
    )
    stack = SplitVllmStack(cfg, namespace)
    with Metastore(logs / "plain-metastore.log") as plain_pool:
        plain = VllmServer(
            model,
            max_model_len=MAX_LEN,
            log_path=logs / "plain.log",
            env=DECODE_ENV,
            extra_args=["--kv-transfer-config", store_config(plain_pool.address)],
        )
        try:
            with ThreadPoolExecutor(1) as pool:
                plain_up = pool.submit(plain.start)
                stack.start(progress=False)
                plain_up.result()
            plain_kv = {salt: _plain_pages(plain, plain_pool.address, fault_prompt(salt)) for salt in COMPARED}
            yield PD(stack, plain, plain_kv)
        finally:
            plain.stop()
            stack.stop()


def _plain_pages(plain: VllmServer, metastore: str, prompt: list[int]) -> list[torch.Tensor]:
    completion(plain.url, prompt, 1, timeout_s=180)
    return pool_pages(metastore, model_id(plain.log_text()), prompt, BLOCK, LAYERS)


class PD:
    """The running stack's parts, by what the tests ask of them; ``plain_kv[salt]``: per layer, the
    plain server's full blocks of ``fault_prompt(salt)``."""

    def __init__(self, stack: VllmStack, plain: VllmServer, plain_kv: dict[int, list[torch.Tensor]]) -> None:
        self.stack, self.plain, self.plain_kv = stack, plain, plain_kv
        self.proxy_url, self.model = stack.url, str(stack.cfg.model)
        self.metastore = f"{stack.cfg.host}:{stack.cfg.metastore_port}"
        self.prefill_url, self.decode_url = stack.http_url("prefill-0"), stack.http_url("decode-0")

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
    want = pd_matrix.answers(pd.plain.url, pd.model)
    pgid = pd.plain.proc.pid
    assert group_members(pgid), "the plain server's process group is empty while it runs"
    pd.plain.stop()  # its cores to the decode; it leaves no process behind
    assert pd.plain.proc.returncode is not None and group_members(pgid) == []
    assert pd_matrix.mismatches(pd_matrix.answers(pd.proxy_url, pd.model), want) == []
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
    assert (math.ceil(3000 / BLOCK) * BLOCK_BYTES * LAYERS, 3000) in [(b, t) for b, t in pulled], pulled
    during = [int(n) for n in re.findall(r"kvoffload_d2h_sent\s.*?layers_read_during_forward=(\d+)", prefill_log)]
    assert during and max(during) >= 1, prefill_log[-3000:]  # an early layer landed while later ones computed
    decode = scrape(pd.decode_url)
    engine, streamed = (
        decode.total(f"vllm:kvoffload_d2h_consumer_{n}_total") for n in ("reads_engine", "reads_streamed")
    )
    assert engine >= LAYERS and streamed == 0  # every read through Mooncake Transfer Engine
    # none streamed out of the prefill's LayerSource
    assert scrape(pd.prefill_url).total("vllm:kvoffload_d2h_producer_bytes_served_total") == 0


# ---- faults: a stalled or killed decode, a killed prefill (each killed server restarted on its port) ----

PEER_TIMEOUT_S = DEFAULT_PEER_TIMEOUT_S  # the stack's connectors keep the default
# how long the decode stays stopped once the prefill waits at the gate for it: with the time the prefill
# takes to reach the gate, below the peer timeout (a stall, not a death; 4 s broke the proxy's connection
# to the decode here)
HELD_S = 1.0
REACH_GATE_S = 2.5  # the prefill reaches a layer whose buffer the stopped decode still reads within this
ANNOUNCED = "kvoffload_d2h_step_announced"


COMPARED = (1, 6)  # the fault prompts whose pulled KV is compared with the plain server's, block for block


def fault_prompt(salt: int, tokens: int = 6000) -> list[int]:
    """A prompt not seen before; 6,000 tokens take the prefill three steps of 2,048, each reusing
    every shared buffer while the decode still pulls."""
    return [(i * 7919 + salt * 104729) % 40000 + 1000 for i in range(tokens)]


def _mid_transfer(pd: PD, body: list[int]) -> tuple[dict, threading.Thread]:
    """``body`` sent through the proxy (its outcome filled in by the returned thread), once the prefill
    announced a step of its layers: the request is mid-pull."""
    outcome: dict = {}
    before = pd.log("prefill-0").count(ANNOUNCED)
    thread = in_flight(pd.proxy_url, body, outcome)
    deadline = time.monotonic() + 120
    while pd.log("prefill-0").count(ANNOUNCED) <= before:
        assert time.monotonic() < deadline, pd.log("prefill-0")[-3000:]
        time.sleep(0.02)
    return outcome, thread


def _prefill_alone(pd: PD, body: list[int], max_tokens: int) -> str:
    """What the prefill answers by itself (no P/D): what the proxy must answer too."""
    return completion(pd.prefill_url, body, max_tokens, timeout_s=180)["choices"][0]["text"]


def _next_request_is_right(pd: PD, body: list[int], max_tokens: int) -> None:
    got = completion(pd.proxy_url, body, max_tokens, timeout_s=180)["choices"][0]["text"]
    assert got == _prefill_alone(pd, body, max_tokens)


@pytest.mark.slow
def test_a_stalled_decode_holds_the_next_layer_at_the_gate_and_the_pull_completes(pd):
    """The decode stopped mid-pull: the prefill's next layer of a shared buffer waits at the gate for the
    stopped decode's read (its ``kvoffload_shared_gate_held`` line names a pull), for as long as the
    decode stays stopped after that (measured here, at whatever speed the machine runs), and the
    request completes right once the decode runs again."""
    body = fault_prompt(1)
    outcome, thread = _mid_transfer(pd, body)
    stalled_from = len(pd.log("prefill-0"))
    decode = pd.stack.process("decode-0")
    signal_group(decode, signal.SIGSTOP, 0)
    try:
        held_seen = _held_by_a_pull(pd, stalled_from, within_s=REACH_GATE_S)
        time.sleep(HELD_S)
    finally:
        # read before the decode runs again: the gate's wait began before its line was seen and ends
        # after SIGCONT, so this is a lower bound however late this thread is scheduled afterwards
        continued_at = time.monotonic()
        signal_group(decode, signal.SIGCONT, 0)
    held_s = continued_at - held_seen  # the gate held at least this long while the decode was stopped
    thread.join(timeout=180)
    assert "answer" in outcome, outcome
    waits = [float(w) for w in re.findall(r"gate_wait_s=([\d.]+)", pd.log("prefill-0")[stalled_from:])]
    assert waits and max(waits) >= held_s, (waits, held_s)
    pulled = re.findall(r"kvoffload_d2h_pulled\s.*?bytes=(\d+).*?tokens=(\d+)", pd.log("decode-0"))
    assert (str(math.ceil(len(body) / BLOCK) * BLOCK_BYTES * LAYERS), str(len(body))) in pulled, pulled
    _pulled_kv_is_the_plain_servers(pd, 1)
    assert outcome["answer"] == _prefill_alone(pd, body, 8)
    assert "ReuseTimeout" not in pd.log("prefill-0")


def _held_by_a_pull(pd: PD, since: int, within_s: float) -> float:
    """The moment (monotonic) the prefill's log first said a layer waits at the gate for a decode's
    pull, after offset ``since``; AssertionError past ``within_s`` (the decode stays stopped meanwhile,
    and must not reach its peer timeout)."""
    deadline = time.monotonic() + within_s
    while not any(
        "'pull'" in held for held in re.findall(r"kvoffload_shared_gate_held.*", pd.log("prefill-0")[since:])
    ):
        assert time.monotonic() < deadline, f"no layer waited for the stopped decode: {pd.log('prefill-0')[-3000:]}"
        time.sleep(0.02)
    return time.monotonic()


def _pulled_kv_is_the_plain_servers(pd: PD, salt: int) -> None:
    """Every layer of ``fault_prompt(salt)``'s KV that the decode pulled equals, byte for byte, the
    plain server's (no shared buffers), and so does the prefill's copy in its pool."""
    prompt, plain = fault_prompt(salt), pd.plain_kv[salt]
    digests, (first, stop) = pulled_digests(pd.log("decode-0"), len(prompt))
    assert (first, stop) == (0, len(prompt) // BLOCK)
    assert digests == pages_digests(plain, first, stop)
    saved = pool_pages(pd.metastore, model_id(pd.log("prefill-0")), prompt, BLOCK, LAYERS)
    assert all(torch.equal(a, b) for a, b in zip(saved, plain, strict=True))


@pytest.mark.slow
def test_slowed_pool_saves_hold_the_next_layer_at_the_gate_and_the_saved_and_pulled_kv_is_the_plain_servers(pd):
    """The prefill's pool saves wait on the metastore (a lease and a mark_written call per layer and
    request); with the metastore answering every call up to 1 s late (SIGSTOP 1 s, SIGCONT 0.2 s, over
    and over: longer than a layer's forward here, ~0.2-0.4 s), the saver falls behind the forward, and
    a layer whose buffer's previous occupant is still being saved waits at the reuse gate — side by
    side with the same kind of request unslowed (its waits: ~0). The metastore must still answer within
    its callers' deadlines (5 s a call, 10 s between heartbeats): with windows of 20 ms on a busy CI
    machine it did not (a lease past its deadline, the pool expired), hence 0.2 s."""
    since = len(pd.log("prefill-0"))
    completion(pd.proxy_url, fault_prompt(7), 8, timeout_s=180)
    unslowed = gate_waits(pd.log("prefill-0")[since:])
    since = len(pd.log("prefill-0"))
    body = fault_prompt(6)
    with slowed(pd.stack.process("metastore"), stopped_s=1.0, running_s=0.2):
        answer = completion(pd.proxy_url, body, 8, timeout_s=180)["choices"][0]["text"]
    log = pd.log("prefill-0")[since:]
    waits = gate_waits(log)
    assert sum(waits) >= sum(unslowed) + 0.5, (waits, unslowed)
    assert "kvoffload_save_failed" not in log and "kvoffload_save_skipped" not in log, log[-3000:]
    assert "ReuseTimeout" not in log
    _pulled_kv_is_the_plain_servers(pd, 6)
    assert answer == _prefill_alone(pd, body, 8)


@pytest.mark.slow
def test_kill_9_of_the_decode_mid_pull_releases_the_gate_and_the_next_request_succeeds(pd):
    since = len(pd.log("prefill-0"))
    _, thread = _mid_transfer(pd, fault_prompt(2))
    assert signal_group(pd.stack.process("decode-0"), signal.SIGKILL, 10)
    thread.join(timeout=180)
    assert not thread.is_alive()
    idle(pd.prefill_url, within_s=PEER_TIMEOUT_S + 10)  # the failed reads let every layer go on, and the request end
    log = pd.log("prefill-0")[since:]
    assert "kvoffload_d2h_reads_failed" in log and "ReuseTimeout" not in log, log[-3000:]
    pd.stack.restart("decode-0", timeout_s=600)
    _next_request_is_right(pd, fault_prompt(3, 700), 8)


@pytest.mark.slow
def test_kill_9_of_the_prefill_mid_transfer_ends_the_request_and_frees_the_decode(pd):
    since = len(pd.log("decode-0"))
    outcome, thread = _mid_transfer(pd, fault_prompt(4))
    assert signal_group(pd.stack.process("prefill-0"), signal.SIGKILL, 10)
    killed_at = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert outcome["at"] - killed_at < PEER_TIMEOUT_S + 5, outcome
    if "error" in outcome:
        assert "prefill" in outcome["error"] or "502" in outcome["error"], outcome
    idle(pd.decode_url, within_s=PEER_TIMEOUT_S + 10)
    log = pd.log("decode-0")[since:]
    assert "kvoffload_d2h_cancelled" in log or "kvoffload_d2h_load_failed" in log, log[-3000:]
    pd.stack.restart("prefill-0", timeout_s=600)
    _next_request_is_right(pd, fault_prompt(5, 500), 4)


@pytest.mark.slow
def test_with_the_metastore_gone_requests_are_still_served(pd):
    pd.stack.signal("metastore", signal.SIGKILL)
    prompt = pd_matrix.prompt(2100, salt=99)  # not seen before: the prefill asks the (gone) metastore for it
    got = completion(pd.proxy_url, prompt, 12, timeout_s=180)["choices"][0]["text"]
    assert got == completion(pd.prefill_url, prompt, 12, timeout_s=180)["choices"][0]["text"]
    assert "kvoffload_lookup_failed" in pd.log("prefill-0")
