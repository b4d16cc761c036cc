"""Faults of the vLLM P/D stack whose prefill keeps shared layer buffers, on a random 6-layer Llama
(the one ``test_vllm_pd.py`` runs: 6 layers on 4 buffers; chunks of 128 tokens, so a prompt takes
many steps and every buffer is reused while the decode still pulls): one stack for the module, a
killed server replaced on its port.

- A stalled decode (SIGSTOP, the reference stack's stall fault, shorter than the peer timeout): the
  prefill's next layer of a buffer waits at the reuse gate for the pulls of the buffer's previous
  layer (the prefill logs the wait), and once the decode resumes the request completes with the
  tokens the prefill alone gives; the decode pulled every layer's blocks of the prompt, no less.
- kill -9 of the decode mid-pull: the failed reads release the gate within the peer timeout (no
  ``ReuseTimeout``), the prefill holds no request and no KV, and with a new decode on the port the
  next request through the proxy succeeds with the right tokens.
- kill -9 of the prefill mid-transfer: the client's request ends within the peer timeout (an error,
  or recomputed by the decode), the decode's KV usage returns to idle, and with a new prefill on the
  port the next request succeeds.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import pytest
from vllm_support import completion, tiny_llama_dir

from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.prom import scrape
from kvoffload_testing.vllm_server import Metastore, Proxy, VllmServer, running
from kvoffload_testing.vllm_stack import split_cores, vllm_decode_transfer_config, vllm_prefill_transfer_config
from svcruntime.processgroup import signal_group

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PEER_TIMEOUT_S = 3.0
STALL_S = 2.0  # below the peer timeout: a stall, not a death
LAYERS, BLOCK = 6, 128
BLOCK_BYTES = 2 * 2 * 32 * BLOCK * 4  # K and V, 2 KV heads of 32, fp32: one block of one layer
HALVES = split_cores() or ("", "")
PREFILL_ENV = {"VLLM_CPU_OMP_THREADS_BIND": HALVES[0]} if HALVES[0] else {}
DECODE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": HALVES[1]} if HALVES[1] else {}
ANNOUNCED = "kvoffload_d2h_step_announced"


def prompt(salt: int, tokens: int = 3000) -> list[int]:
    return [(i * 7919 + salt * 104729) % 40000 + 1000 for i in range(tokens)]


def _prefill(model, port: int, log_path, metastore: str) -> VllmServer:
    kv = json.loads(vllm_prefill_transfer_config(metastore))
    kv["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]["peer_timeout_s"] = PEER_TIMEOUT_S
    args = ["--kv-transfer-config", json.dumps(kv), "--max-num-batched-tokens", "128"]
    return VllmServer(model, port=port, max_model_len=4096, log_path=log_path, env=PREFILL_ENV, extra_args=args)


def _decode(model, port: int, kv_port: int, log_path) -> VllmServer:
    kv = json.loads(vllm_decode_transfer_config(kv_port))
    kv["kv_connector_extra_config"]["peer_timeout_s"] = PEER_TIMEOUT_S
    args = ["--kv-transfer-config", json.dumps(kv)]
    return VllmServer(model, port=port, max_model_len=4096, log_path=log_path, env=DECODE_ENV, extra_args=args)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The metastore, the prefill, the decode and the proxy; ``stack["new_decode"]()`` /
    ``stack["new_prefill"]()`` start a replacement on the same port (the old one must be gone)."""
    logs = tmp_path_factory.mktemp("pdfaults")
    model = tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "llama6", num_layers=LAYERS)
    ports = free_stack_ports(1, 1)
    with Metastore(logs / "metastore.log") as ms:
        out: dict = {"logs": logs}
        out["new_prefill"] = lambda n: _prefill(model, ports["prefill_ports"][0], logs / f"prefill{n}.log", ms.address)
        out["new_decode"] = lambda n: _decode(
            model, ports["decode_ports"][0], ports["kv_port"], logs / f"decode{n}.log"
        )
        with running(out["new_prefill"](0), out["new_decode"](0)) as (prefill, decode):
            out.update(prefill=prefill, decode=decode)
            proxy = Proxy(ports["proxy_port"], prefill.port, decode.port, logs / "proxy.log")
            out["proxy"] = proxy
            try:
                yield out
            finally:
                proxy.close()
                for name in ("prefill", "decode"):
                    out[name].stop()


def _in_flight(proxy_url: str, body: list[int], outcome: dict) -> threading.Thread:
    def client() -> None:
        try:
            outcome["answer"] = completion(proxy_url, body, 8, timeout_s=180)["choices"][0]["text"]
        except Exception as exc:  # noqa: BLE001 - the error is an outcome under test
            outcome["error"] = str(exc)
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=client)
    thread.start()
    return thread


def _mid_transfer(stack: dict, body: list[int]) -> tuple[dict, threading.Thread]:
    """``body`` sent through the proxy (its outcome filled in by the returned thread), once the prefill
    announced a step of its layers: the request is mid-pull."""
    prefill, outcome = stack["prefill"], {}
    before = prefill.log_text().count(ANNOUNCED)
    thread = _in_flight(stack["proxy"].url, body, outcome)
    deadline = time.monotonic() + 120
    while prefill.log_text().count(ANNOUNCED) <= before:
        assert time.monotonic() < deadline, prefill.log_text()[-3000:]
        time.sleep(0.02)
    return outcome, thread


def _prefill_alone(stack: dict, body: list[int], max_tokens: int) -> str:
    """What the prefill answers by itself (no P/D): what the proxy must answer too."""
    return completion(stack["prefill"].url, body, max_tokens, timeout_s=180)["choices"][0]["text"]


def _next_request_is_right(stack: dict, body: list[int], max_tokens: int) -> None:
    got = completion(stack["proxy"].url, body, max_tokens, timeout_s=180)["choices"][0]["text"]
    assert got == _prefill_alone(stack, body, max_tokens)


def _idle(server: VllmServer, within_s: float) -> float:
    """Seconds until ``server`` runs no request and holds no KV block (AssertionError past ``within_s``)."""
    t0 = time.monotonic()
    while True:
        m = scrape(server.url)
        if m.total("vllm:num_requests_running") == 0 and m.total("vllm:kv_cache_usage_perc") == 0:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, f"{server.url} still holds requests or KV"
        time.sleep(0.2)


def test_a_stalled_decode_holds_the_next_layer_at_the_gate_and_the_pull_completes(stack):
    prefill, decode, body = stack["prefill"], stack["decode"], prompt(1)
    outcome, thread = _mid_transfer(stack, body)
    stalled_from = len(prefill.log_text())
    signal_group(decode.proc, signal.SIGSTOP, 0)
    time.sleep(STALL_S)
    signal_group(decode.proc, signal.SIGCONT, 0)
    thread.join(timeout=180)
    assert "answer" in outcome, outcome
    waits = [float(w) for w in re.findall(r"gate_wait_s=([\d.]+)", prefill.log_text()[stalled_from:])]
    assert waits and max(waits) >= STALL_S / 2, waits  # a layer waited for the stalled decode's pulls
    pulled = re.findall(r"kvoffload_d2h_pulled\s.*?bytes=(\d+).*?tokens=(\d+)", decode.log_text())
    assert (str(-(-len(body) // BLOCK) * BLOCK_BYTES * LAYERS), str(len(body))) in pulled, pulled
    assert outcome["answer"] == _prefill_alone(stack, body, 8)
    assert "ReuseTimeout" not in prefill.log_text()


def test_kill_9_of_the_decode_mid_pull_releases_the_gate_and_the_next_request_succeeds(stack):
    prefill, decode = stack["prefill"], stack["decode"]
    _, thread = _mid_transfer(stack, prompt(2))
    assert signal_group(decode.proc, signal.SIGKILL, 10)
    thread.join(timeout=180)
    assert not thread.is_alive()
    _idle(prefill, within_s=PEER_TIMEOUT_S + 10)  # the failed reads let every layer go on, and the request end
    log = prefill.log_text()
    assert "kvoffload_d2h_reads_failed" in log and "ReuseTimeout" not in log, log[-3000:]
    decode.stop()
    stack["decode"] = stack["new_decode"](1).start()
    _next_request_is_right(stack, prompt(3, 700), 8)


def test_kill_9_of_the_prefill_mid_transfer_ends_the_request_and_frees_the_decode(stack):
    prefill, decode = stack["prefill"], stack["decode"]
    outcome, thread = _mid_transfer(stack, prompt(4))
    assert signal_group(prefill.proc, signal.SIGKILL, 10)
    killed_at = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert outcome["at"] - killed_at < PEER_TIMEOUT_S + 5, outcome
    if "error" in outcome:
        assert "prefill" in outcome["error"] or "502" in outcome["error"], outcome
    _idle(decode, within_s=20)
    log = decode.log_text()
    assert "kvoffload_d2h_cancelled" in log or "kvoffload_d2h_load_failed" in log, log[-3000:]
    prefill.stop()
    stack["prefill"] = stack["new_prefill"](1).start()
    _next_request_is_right(stack, prompt(5, 500), 4)
