"""``kvoffload demo --engine vllm`` end to end, on real processes: a kvoffload metastore, a vLLM prefill
(MultiConnector: SfaRemoteD2HConnector producer + AscendStoreConnector), a vLLM decode
(SfaRemoteD2HConnector consumer) and the kvoffload proxy, started by ``VllmStack`` on free loopback
ports with a small random-weight Llama. One chat request through the proxy must come back with
tokens, and the decode must have taken the prompt's KV from the prefill instead of computing it:
vLLM's own counters say its prompt tokens came from a KV transfer, the connector logged the pull
and no failed one (vLLM would have recomputed it), every server still answers /metrics after the
request, and the proxy saw the decode register and the request succeed — every number here is one
the demo prints.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_support import tiny_llama_dir

from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import StackConfig
from kvoffload_testing.vllm_demo import demo
from kvoffload_testing.vllm_server import tail
from kvoffload_testing.vllm_stack import VllmStack

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


NOISE = ("Route: ", "GET /health", "GET /metrics", "nanobind", "leaked ")


def log_tails(log_dir: Path, lines: int = 30) -> str:
    """The last lines of the prefill's, decode's and proxy's logs, without vLLM's route table and the probes."""
    out = []
    for name in ("prefill-0", "decode-0", "proxy"):
        kept = [line for line in tail(log_dir / f"{name}.log", 400).splitlines() if not any(n in line for n in NOISE)]
        out.append(f"--- {name}.log:\n" + "\n".join(line[:400] for line in kept[-lines:]))
    return "\n".join(out)


def test_demo_with_the_vllm_engine_answers_and_the_decode_pulls_the_prompt_kv(tmp_path):
    model = tiny_llama_dir(tmp_path / "tiny")
    cfg = StackConfig(model=model, log_dir=tmp_path / "logs", max_model_len=2048, **free_stack_ports())
    stack = VllmStack(cfg)
    stack.start(progress=False)
    try:
        text, summary = demo(stack, max_tokens=8, timeout_s=240)  # seconds on this model, unless the machine is busy
    except Exception as exc:
        raise AssertionError(f"the demo request failed: {exc!r}\n{log_tails(cfg.log_dir)}") from exc
    finally:
        stack.stop()
    print(summary)
    logs = log_tails(cfg.log_dir)
    decode, prefill, proxy = summary["decode-0"], summary["prefill-0"], summary["proxy"]
    assert not any("error" in summary[name] for name in ("decode-0", "prefill-0", "proxy")), (summary, logs)
    assert summary["completion_tokens"] > 0 and summary["prompt_tokens"] > 128, (summary, logs)
    assert isinstance(text, str)
    # the proxy ran the P/D flow: the decode registered, the request succeeded, nothing was retried
    # (the registration is answered once the proxy has the prefill's HTTP answer; a vLLM decode does not
    # wait for it — it needs only the pulled layers — so on a busy machine the request may finish first
    # and the proxy then answers the still-open registration "cancelled": either way, exactly one)
    assert proxy["requests"] == {"chat:ok": 1}, (summary, logs)
    registrations = proxy["metaserver_registrations"]
    assert sum(registrations.values()) == 1 and set(registrations) <= {"ok", "cancelled"}, (summary, logs)
    assert proxy["backend_retries"] == 0, (summary, logs)
    # the prefill computed the prompt; the decode took it from the transfer (vLLM computes the last
    # prompt token itself), and no pull failed (vLLM would have recomputed it)
    assert prefill["prompt_tokens_computed"] >= summary["prompt_tokens"] - 1, (summary, logs)
    assert decode["prompt_tokens_pulled"] >= summary["prompt_tokens"] - 1, (summary, logs)
    assert decode["prompt_tokens_computed"] <= 1, (summary, logs)
    assert decode["pulls_logged"] == 1 and decode["bytes_pulled"] > 0, (summary, logs)
    assert decode["pull_failures_logged"] == decode["load_failures_recovered_by_vllm"] == 0, (summary, logs)
    assert decode["generation_tokens"] >= 1, (summary, logs)
