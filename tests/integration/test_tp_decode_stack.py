"""Tensor-parallel decode in the P/D stack: (prefill TP, decode TP) = (4, 2) with MTP drafting on
the decode, and (4, 4), on a float32 tiny model (greedy tokens then equal the one-rank engine's).

The decode is rank 0 of N (``--tensor-parallel-size N``): ranks 1..N-1 are processes it started,
each with its own control port (kv_port + rank) and shard of the model, pulling from its own
contributor group of prefill ranks, and all of them over the one host pool of the DP rank (rank 0's
segment, attached: one copy of each prompt in host memory). I3 through the proxy; each decode
rank's Stats show it pulled only its contributors' rows; and when decode rank 1 dies the decode
says so (not ready, naming the rank) instead of waiting on it."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsamodel.presets import write_tiny
from dsamodel.tokenizer import ByteTokenizer
from kvoffload_testing.oracle import greedy_reference
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import grpc_stats, post_json, stream_token_ids

pytestmark = [pytest.mark.stack, pytest.mark.slow]

BS = 16
TOK = ByteTokenizer()
LONG_TEXT = "".join(chr(32 + (i * 7919) % 90) for i in range(2000))
MTP = json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 1})


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("model32") / "tiny", dtype="float32")


@pytest.fixture(scope="module")
def reference(model32):
    return greedy_reference(model32, block_size=BS, max_model_len=4096)


@pytest.fixture(scope="module")
def one_row(model32):
    """Bytes of one token's row over every cache layer (main + indexer)."""
    from dsamodel.weights import load_model
    from kvoffload_engine.model_layout import kv_layout

    model = load_model(str(model32))
    return sum(s.main.row_bytes + s.indexer.row_bytes for s in kv_layout(model.config, BS, model.dtype).layers)


# (prefill TP, decode TP, MTP): a decode of TP 2 with two contributors per rank and MTP drafting,
# and one of TP 4, one contributor each
@pytest.fixture(scope="module", params=[(4, 2, True), (4, 4, False)], ids=["tp4-2-mtp", "tp4-4"])
def stack(request, model32, tmp_path_factory):
    prefill_tp, decode_tp, mtp = request.param
    args = {
        "prefill-0": ["--tensor-parallel-size", str(prefill_tp)],
        "decode-0": ["--speculative-config", MTP] if mtp else [],
    }
    cfg = StackConfig(
        model=model32,
        log_dir=tmp_path_factory.mktemp(f"tp{prefill_tp}-{decode_tp}") / "logs",
        **free_stack_ports(1, 1, decode_tp=decode_tp),
        max_model_len=4096,
        block_size=BS,
        service_args=args,
        decode_tp=decode_tp,
    )
    with Stack(cfg) as s:
        s.prefill_tp, s.decode_tp, s.mtp = prefill_tp, decode_tp, mtp
        yield s


def _rank_stats(stack, rank: int) -> dict:
    return grpc_stats(f"{stack.cfg.host}:{stack.cfg.decode_control_port(0) + rank}", tls=stack.cfg.tls)


@pytest.mark.parametrize("prompt", [[65], "long"], ids=["1", "2000"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_i3_with_a_tp_decode(stack, reference, prompt, stream):
    ids = TOK.encode(LONG_TEXT, add_bos=True) if prompt == "long" else prompt
    body = {"prompt": ids, "max_tokens": 10, "temperature": 0}
    url = f"{stack.url}/v1/completions"
    got = stream_token_ids(url, body) if stream else post_json(url, body)["choices"][0]["token_ids"]
    assert got == reference(ids, 10)


def test_each_decode_rank_pulls_from_its_contributors_only(stack, reference, one_row):
    ranks = range(stack.decode_tp)
    ids = TOK.encode(LONG_TEXT[::-1][:1500], add_bos=True)  # no earlier test sent it
    before = [_rank_stats(stack, r) for r in ranks]
    got = post_json(f"{stack.url}/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0})
    after = [_rank_stats(stack, r) for r in ranks]
    assert got["choices"][0]["token_ids"] == reference(ids, 6)
    ratio = stack.prefill_tp // stack.decode_tp
    for rank in ranks:
        contributors = range(rank * ratio, (rank + 1) * ratio)
        by = {
            int(k.rsplit("_", 1)[1]): after[rank][k] - before[rank].get(k, 0)
            for k in after[rank]
            if k.startswith("bytes_read_prefill_tp_rank_")
        }
        assert set(by) == set(contributors), (rank, by)  # never a row from another group's rank
        assert after[rank]["bytes_read"] - before[rank]["bytes_read"] == len(ids) * one_row == sum(by.values())
        assert all(b > 0 for b in by.values()), by
    # every rank drops it, at once (rank 0 sends the free when it frees, not with a next step that an
    # idle decode never takes): no blocks of the shared pool held, by rank 0 or by a follower
    deadline = time.monotonic() + 10
    held = [after[r] for r in ranks]
    while any((h["pool_used_blocks"], h["sequences"]) != (0, 0) for h in held) and time.monotonic() < deadline:
        time.sleep(0.05)
        held = [_rank_stats(stack, r) for r in ranks]
    assert all((h["pool_used_blocks"], h["sequences"]) == (0, 0) for h in held), held
    drafts = after[0]["drafts"] - before[0]["drafts"]
    assert (drafts > 0) == stack.mtp  # the decode's MTP layer drafted (and its verifying steps ran on both ranks)


def _decode_segments(cfg, dp_rank: int = 0) -> list[str]:
    """The host-pool segments of decode DP rank ``dp_rank`` (named after its rank 0's control port)."""
    from kvcore.pool.segment import SEGMENT_PREFIX, SHM_DIR

    port = cfg.decode_control_port(dp_rank)
    return glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}kvoffload-decode-{port}-*"))


def _mapped_by(pid: int, path: str) -> bool:
    return any(line.endswith(path) for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def test_the_decode_ranks_share_one_host_pool(stack):
    """One pool per DP rank (the guide's ``dram_size_per_dp_GB``): rank 0 made it, every follower maps
    it, no rank made another; the decode's metrics count it once."""
    [segment] = _decode_segments(stack.cfg)
    [joined] = stack.events("decode-0", "tp_ranks_joined")
    assert len(joined["pids"]) == stack.decode_tp - 1
    for pid in joined["pids"]:
        assert _mapped_by(pid, segment), (pid, segment)
    size = os.stat(segment).st_size
    with urllib.request.urlopen(f"http://{stack.cfg.host}:{stack.cfg.decode_ports[0]}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    [capacity] = re.findall(r"^kvoffload_decode_pool_capacity_bytes (\S+)$", metrics, re.M)
    assert 0 < float(capacity) <= size  # the one pool's bytes, not N times them


def test_two_decode_dp_ranks_each_of_tp2(model32, reference, tmp_path):
    """Two DP ranks of one decode deployment, each TP 2 (control ports kv_port + 2 d + t), behind one
    TP 2 prefill: I3 for requests spread over both, each registered as its own DP rank."""
    cfg = StackConfig(
        model=model32,
        log_dir=tmp_path / "logs",
        **free_stack_ports(1, 2, decode_tp=2),
        max_model_len=4096,
        block_size=BS,
        service_args={"prefill-0": ["--tensor-parallel-size", "2"]},
        decode_dp=True,
        decode_tp=2,
    )
    prompts = [TOK.encode(LONG_TEXT[i * 300 : (i + 1) * 300], add_bos=True) for i in range(4)]
    with Stack(cfg) as stack, ThreadPoolExecutor(len(prompts)) as pool:  # at once: the proxy spreads them
        answers = list(
            pool.map(
                lambda ids: post_json(
                    f"{stack.url}/v1/completions", {"prompt": ids, "max_tokens": 5, "temperature": 0}
                ),
                prompts,
            )
        )
        for ids, got in zip(prompts, answers, strict=True):
            assert got["choices"][0]["token_ids"] == reference(ids, 5)
        served = [sum(1 for e in stack.events(f"decode-{d}", "layout_exchange") if e["accepted"]) for d in (0, 1)]
        ports = [stack.events(f"decode-{d}", "serving")[0]["control_port"] for d in (0, 1)]
        pulled = [
            grpc_stats(f"{cfg.host}:{cfg.kv_port + 2 * d + t}", tls=cfg.tls)["bytes_read"]
            for d in (0, 1)
            for t in (0, 1)
        ]
        segments = [_decode_segments(cfg, d) for d in (0, 1)]
    assert ports == [cfg.kv_port, cfg.kv_port + 2]
    assert [len(s) for s in segments] == [1, 1], segments  # one pool per DP rank, its TP ranks' shared
    assert all(served) and all(pulled), (served, pulled)  # both DP ranks, and all four TP ranks, got work


def test_the_decode_ranks_accepted_their_contributors_layouts(stack):
    """Both ranks log into the decode's log (rank 1 as ``kvoffload-decode-tp1``): each accepted one
    layout from each prefill rank of its contributor group, and no other."""
    accepted = [e for e in stack.events("decode-0", "layout_exchange") if e["accepted"]]
    ratio = stack.prefill_tp // stack.decode_tp
    services = ["kvoffload-decode"] + [f"kvoffload-decode-tp{r}" for r in range(1, stack.decode_tp)]
    for rank, service in enumerate(services):
        mine = [e for e in accepted if e["service"] == service]
        assert mine and all(
            (e["prefill_tp_size"], e["decode_tp_rank"], e["decode_tp_size"])
            == (stack.prefill_tp, rank, stack.decode_tp)
            for e in mine
        ), mine
        assert sorted(e["prefill_tp_rank"] for e in mine) == list(range(rank * ratio, (rank + 1) * ratio))


def test_a_dead_decode_rank_makes_the_decode_not_ready(stack):
    """Last for each stack (it kills decode rank 1)."""
    [joined] = stack.events("decode-0", "tp_ranks_joined")
    import os

    os.kill(joined["pids"][0], signal.SIGKILL)
    health = f"http://{stack.cfg.host}:{stack.cfg.decode_ports[0]}/health"
    deadline, status, text = time.monotonic() + 15, 200, ""
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
