"""Tensor parallel P/D under vLLM: a vLLM prefill of TP 2 feeding a vLLM decode of TP 1 and one of
TP 2, each behind its own kvoffload proxy (``SfaRemoteD2HConnector`` on every side).

The model is the tests' tiny Llama (``vllm_support.tiny_llama_dir``: 2 layers, 2 KV heads of 32,
float32), so vLLM gives each prefill rank one of the two KV heads: every row of a TP 1 decode is
assembled from both prefill ranks' head slices, and decode rank t of TP 2 takes prefill rank t's
blocks whole (``kvoffload_vllm.d2h_tp``). The prefill's ranks share one half of the cores and the
decodes' ranks the other (``split_cores``: on two cores, one each): a decode waiting for its KV runs
empty steps without a pause, and a prefill rank on the decode's core would hold up every
all-reduce of the prefill's forward.

- I3: greedy answers through each proxy (completions and chat, streamed and not, prompts of 1, 127,
  129 and 1,500 tokens) are the tokens the same decode gives computing the prompt itself, log
  probabilities within 1e-3 (the decodes keep no prefix cache: every answer is computed over the KV
  of its own request, pulled or not).
- Bytes per rank, as ``test_tp_stack.py`` counts them for the reference engine: the TP 1 decode
  pulled each prompt's blocks of every layer once, half of the bytes from each prefill rank; each
  rank of the TP 2 decode pulled half of them, all from its own prefill rank; every decode rank
  registered rank 0's port and the TP size with the proxy.
"""

from __future__ import annotations

import ast
import json
import math
import re

import pytest
from vllm_support import chat, completion, stream_choices, tiny_llama_dir

from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.vllm_server import Metastore, Proxy, VllmServer, free_port, running
from kvoffload_testing.vllm_stack import split_cores, vllm_prefill_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128  # vLLM's CPU default block size
LAYERS = 3
ROW_BYTES = 2 * 2 * 32 * 4  # one token of one layer on one rank of TP 1: 2 KV heads, K and V, 32 float32 each
TOLERANCE = 1e-3
HALVES = split_cores() or ("0", "0")  # the prefill's ranks on one half of the cores, the decodes' on the other
PROMPTS = {
    "one": [1000],
    "127": [(i * 53) % 9000 + 400 for i in range(127)],
    "129": [(i * 31) % 5000 + 200 for i in range(129)],
    "1500": [(i * 7919) % 40000 + 1000 for i in range(1500)],
}
LOADED = r"kvoffload_loaded\s.*"  # the store's line of a load: one per rank
CHAT = [{"role": "user", "content": "Name three colours of the rainbow, one per line."}]


def consumer(kv_port: int) -> str:
    return json.dumps(
        {
            "kv_connector": "SfaRemoteD2HConnector",
            "kv_role": "kv_consumer",
            "kv_port": kv_port,
            "kv_connector_module_path": "kvoffload_vllm",
            "kv_load_failure_policy": "fail",  # a failed pull fails the request: never recomputed silently
            "kv_connector_extra_config": {"transfer_backend": "kvoffload"},
        }
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-tp")
    model = tiny_llama_dir(logs / "tiny", num_layers=LAYERS)
    ports = free_stack_ports(1, 2, decode_tp=2)  # both ranks' control ports of the TP 2 decode checked free

    def server(name: str, port: int, kv_config: str, tp: int) -> VllmServer:
        core = HALVES[0] if name.startswith("prefill") else HALVES[1]
        return VllmServer(
            model,
            port=port,
            log_path=logs / f"{name}.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": "|".join([core] * tp)},  # module docstring
            extra_args=[
                *("--kv-transfer-config", kv_config, "--tensor-parallel-size", str(tp)),
                # a decode's own answer is computed, never its prefix cache's copy of pulled KV; a prefill's
                # repeated prefix comes from the store's pool
                "--no-enable-prefix-caching",
            ],
        )

    kv_port, proxy_ports = ports["kv_port"], (ports["proxy_port"], free_port())
    metastore = Metastore(logs / "metastore.log", port=ports["metastore_port"])
    # the guide's prefill: the D2H producer and the store, its 3 layers on 2 shared buffers (layer 0 alone)
    producer = vllm_prefill_transfer_config(metastore.address, shared_buffers=1)
    with (
        metastore,
        running(
            server("prefill-tp2", ports["prefill_ports"][0], producer, 2),
            server("decode-tp1", ports["decode_ports"][0], consumer(kv_port), 1),
            server("decode-tp2", ports["decode_ports"][1], consumer(kv_port + 16), 2),
        ) as (prefill, decode1, decode2),
    ):
        with (
            Proxy(proxy_ports[0], prefill.port, decode1.port, logs / "proxy-tp1.log") as proxy1,
            Proxy(proxy_ports[1], prefill.port, decode2.port, logs / "proxy-tp2.log") as proxy2,
        ):
            yield {
                "prefill": prefill,
                "tp1": (decode1, proxy1, kv_port),
                "tp2": (decode2, proxy2, kv_port + 16),
            }


Step = tuple[str, float]


def steps(choices: list[dict]) -> list[Step]:
    out: list[Step] = []
    for c in choices:
        lp = c.get("logprobs") or {}
        if "tokens" in lp:  # completions
            out += list(zip(lp["tokens"], lp["token_logprobs"], strict=True))
        else:  # chat
            out += [(t["token"], t["logprob"]) for t in lp.get("content") or []]
    return out


def answers(url: str) -> dict[str, list[Step]]:
    out = {}
    for name, prompt in PROMPTS.items():
        out[name] = steps(completion(url, prompt, 8, logprobs=1)["choices"])
        out[f"{name}-sse"] = steps(
            stream_choices(url, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1})
        )
    out["chat"] = steps(chat(url, CHAT, 8, logprobs=True)["choices"])
    return out


def assert_agree(got: dict[str, list[Step]], want: dict[str, list[Step]]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert len(got[name]) == len(want[name]) == 8, name
        assert [t for t, _ in got[name]] == [t for t, _ in want[name]], name
        worst = max(abs(a - b) for (_, a), (_, b) in zip(got[name], want[name], strict=True))
        assert worst < TOLERANCE, (name, worst)


def pulled(log: str) -> list[dict]:
    """The decode's ``kvoffload_d2h_pulled`` lines: tokens, bytes, by prefill rank, its rank."""
    out = []
    for line in log.splitlines():
        if "kvoffload_d2h_pulled" not in line:
            continue
        by_rank = re.search(r"bytes_by_prefill_tp_rank=(\{[^}]*\})", line)
        out.append(
            {
                "tokens": int(re.search(r"\btokens=(\d+)", line).group(1)),
                "bytes": int(re.search(r"\bbytes=(\d+)", line).group(1)),
                "by_rank": ast.literal_eval(by_rank.group(1)) if by_rank else None,
                "tp_rank": int(re.search(r"\btp_rank=(\d+)", line).group(1)),
            }
        )
    return out


def registered(proxy: Proxy) -> list[dict]:
    """The proxy's ``decoder_registered`` events (its log is JSON, one event per line)."""
    events = [json.loads(line) for line in proxy.log_path.read_text().splitlines() if line.startswith("{")]
    return [e for e in events if e.get("event") == "decoder_registered"]


def fresh(seed: int) -> list[int]:
    """A 1,500-token prompt no other test sends (no block of it in a decode's prefix cache)."""
    return [(i * 4099 + seed * 7) % 40000 + 1000 for i in range(1500)]


def prompt_bytes(tokens: int) -> int:
    """A TP 1 engine's bytes of a prompt's blocks in every layer (vLLM moves whole blocks)."""
    return math.ceil(tokens / BLOCK) * BLOCK * ROW_BYTES * LAYERS


@pytest.mark.parametrize("decode_tp", ["tp1", "tp2"])
def test_greedy_answers_through_the_proxy_are_the_decodes_own(servers, decode_tp):
    decode, proxy, _ = servers[decode_tp]
    assert_agree(answers(proxy.url), answers(decode.url))


def test_a_tp1_decode_pulls_every_prompt_half_from_each_prefill_rank(servers):
    decode, proxy, kv_port = servers["tp1"]
    before = len(pulled(decode.log_text()))
    completion(proxy.url, fresh(1), 2)
    (line,) = pulled(decode.log_text())[before:]
    whole = prompt_bytes(line["tokens"])
    assert line["tokens"] >= 1499 and line["tp_rank"] == 0
    assert line["bytes"] == whole and line["by_rank"] == {0: whole // 2, 1: whole // 2}
    assert {(r["remote"], r["remote_tp_size"]) for r in registered(proxy)} == {(f"127.0.0.1:{kv_port}", 1)}


def test_each_rank_of_a_tp2_decode_pulls_its_half_from_its_own_prefill_rank(servers):
    decode, proxy, kv_port = servers["tp2"]
    before = len(pulled(decode.log_text()))
    completion(proxy.url, fresh(2), 2)
    lines = sorted(pulled(decode.log_text())[before:], key=lambda line: line["tp_rank"])
    assert [line["tp_rank"] for line in lines] == [0, 1]
    for t, line in enumerate(lines):
        assert line["tokens"] >= 1499
        assert line["bytes"] == prompt_bytes(line["tokens"]) // 2
        assert line["by_rank"] == {t: line["bytes"]}
    assert {(r["remote"], r["remote_tp_size"]) for r in registered(proxy)} == {(f"127.0.0.1:{kv_port}", 2)}


def test_the_prefill_ranks_each_announced_to_the_decode_rank_they_feed(servers):
    kv1, kv2 = servers["tp1"][2], servers["tp2"][2]
    sent = sent_lines(servers["prefill"].log_text())
    for rank in (0, 1):
        mine = {decode for tp_rank, decode in sent if tp_rank == rank}
        # both ranks feed the TP 1 decode's one rank; of the TP 2 decode's, rank t feeds rank t only
        assert f"127.0.0.1:{kv1}" in mine and f"127.0.0.1:{kv2 + rank}" in mine, (rank, sent)
        assert f"127.0.0.1:{kv2 + 1 - rank}" not in mine, (rank, sent)
        assert mine <= {f"127.0.0.1:{kv1}", f"127.0.0.1:{kv2}", f"127.0.0.1:{kv2 + 1}"}, (rank, sent)


def sent_lines(log: str) -> list[tuple[int, str]]:
    """(prefill TP rank, decode endpoint) of every ``kvoffload_d2h_sent`` line of ``log``; a line that
    does not read as exactly one such event (two processes' output run together) fails the test with it."""
    out = []
    for line in log.splitlines():
        if "kvoffload_d2h_sent" not in line:
            continue
        rank, decode = re.findall(r"\btp_rank=(\d+)\b", line), re.findall(r"\bdecode=([\d.]+:\d+)(?!\d)", line)
        assert line.count("kvoffload_d2h_sent") == 1 and len(rank) == 1 and len(decode) == 1, line
        out.append((int(rank[0]), decode[0]))
    assert out, "no kvoffload_d2h_sent line"
    return out


def test_each_prefill_rank_saves_its_slice_to_the_pool_and_loads_it_back(servers):
    prefill = servers["prefill"]
    prompt = fresh(3)[:1000]  # 7 full blocks
    first = steps(completion(prefill.url, prompt, 8, logprobs=1)["choices"])
    before = len(re.findall(LOADED, prefill.log_text()))
    again = steps(completion(prefill.url, prompt, 8, logprobs=1)["choices"])
    assert_agree({"again": again}, {"again": first})
    log = prefill.log_text()
    assert re.search(r"kvoffload_prefix_hit\s.*hit_tokens=896\b", log), log[-3000:]
    loaded = re.findall(LOADED, log)[before:]
    assert len(loaded) == 2 and all(re.search(r"\bblocks=7\b", line) for line in loaded), loaded  # each rank
    workers = re.findall(r"kvoffload_store_connector\s.*role=WORKER.*", log)
    assert len(workers) == 2 and all("shared_buffers=[[0], [1, 2]]" in w for w in workers), workers
