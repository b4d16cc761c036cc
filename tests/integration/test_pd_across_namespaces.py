"""P/D across two network stacks: the decode in a network namespace of its own, joined to the rest by a
veth pair (``netns``: Debian's iproute2, ``ip netns``), so every byte between prefill and decode crosses a real
network stack, not loopback. The metastore, the prefill and the proxy run in this namespace on the
veth's address (a /30 of its own: ``netns``), the decode behind the other end, each side under its own
host id (no shared memory between them).

- On the mooncake transfer backend: I3 (tokens equal the single process), json and SSE; every read
  went through the engine, across the veth; the rate is printed.
- On the embedded backend the same prompts stream from the prefill's LayerSource over gRPC (the
  cross-host path), and the answers are the same; both rates are printed side by side.
"""

from __future__ import annotations

import pytest

from dsamodel.tokenizer import ByteTokenizer
from kvoffload_testing.netns import SplitStack, Veth, veth_namespace
from kvoffload_testing.oracle import greedy_reference
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import StackConfig
from kvoffload_testing.stack_client import grpc_stats, post_json, stream_token_ids

pytestmark = [pytest.mark.stack]

BS = 16
TOK = ByteTokenizer()
PROMPTS = {
    "1": [65],
    "bs-1": list(range(66, 66 + BS - 1)),
    "2600": "".join(chr(32 + (i * 4099) % 90) for i in range(2600)),
}


@pytest.fixture(scope="module")
def namespace():
    """A network namespace for the decode, a veth pair between it and this one (``netns``)."""
    with veth_namespace() as veth:
        yield veth


def split_stack(model_dir, log_dir, namespace: Veth, transfer: str) -> SplitStack:
    cfg = StackConfig(
        model=model_dir,
        log_dir=log_dir,
        **free_stack_ports(),
        host=namespace.here,
        max_model_len=8192,
        block_size=BS,
        transfer=transfer,
        service_env={"decode-0": {"KVOFFLOAD_HOST_ID": "decode-host"}},  # its own host: no shared memory
    )
    return SplitStack(cfg, namespace)


@pytest.fixture(scope="module")
def reference(model_dir):
    return greedy_reference(model_dir, block_size=BS, max_model_len=8192)


def _decode_stats(stack: SplitStack) -> dict[str, float]:
    return grpc_stats(f"{stack.veth.there}:{stack.cfg.decode_control_port(0)}")


def _answers(stack: SplitStack) -> dict[str, list[int]]:
    url, out = f"{stack.url}/v1/completions", {}
    for name, prompt in PROMPTS.items():
        ids = TOK.encode(prompt, add_bos=True) if isinstance(prompt, str) else prompt
        body = {"prompt": ids, "max_tokens": 10, "temperature": 0}
        out[f"{name}-json"] = post_json(url, body)["choices"][0]["token_ids"]
        out[f"{name}-sse"] = stream_token_ids(url, body)
    return out


def _rate(stats: dict[str, float]) -> float:
    return stats["bytes_read"] / stats["read_ms_total"] / 1e6  # GB/s


def test_i3_across_namespaces_on_the_mooncake_engine_and_the_grpc_stream(model_dir, namespace, tmp_path, reference):
    rates, got = {}, {}
    for transfer in ("mooncake", "kvoffload"):  # one split stack after the other, one decode namespace
        with split_stack(model_dir, tmp_path / transfer, namespace, transfer) as stack:
            got[transfer] = _answers(stack)
            stats = _decode_stats(stack)
        read_by = "reads_engine" if transfer == "mooncake" else "reads_streamed"
        assert stats[read_by] >= 1 and stats["read_failed"] == 0, stats
        assert (
            stats["reads_shared_memory"] == 0
            and stats["read_done"] * (1 if transfer == "mooncake" else 2) == stats[read_by]
        ), stats
        rates[transfer] = _rate(stats)
    for name, prompt in PROMPTS.items():
        ids = TOK.encode(prompt, add_bos=True) if isinstance(prompt, str) else prompt
        want = reference(ids, 10)
        for transfer in got:
            assert got[transfer][f"{name}-json"] == want and got[transfer][f"{name}-sse"] == want, (transfer, name)
    ratio = rates["mooncake"] / rates["kvoffload"]
    print(f"pull rate across the veth, GB/s: {rates} (mooncake / grpc stream: {ratio:.2f})")
