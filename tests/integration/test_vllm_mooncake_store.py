"""The store's host pool on Mooncake Store inside real vLLM servers, across two network stacks.

One real ``mooncake_master`` (on this namespace's end of A's veth pair), two vLLM servers with the
``AscendStoreConnector`` on ``backend: "mooncake"``, each in a network namespace of its own
(``kvoffload_testing.netns.namespace_pair``: a process in one reaches the other over a veth link, as
two hosts do), and a plain server without any connector. A is a prefill with the seed's shared layer
buffers (``kv_producer``, 4 layers on 3 buffers, 256-token steps); B stores without them (``kv_both``).
Each pool advertises its own namespace's address (its route toward the master); each scheduler looks
a prompt's blocks up in the master (``kvoffload_vllm.store_lookup``).

- A prompt prefilled by A is a prefix hit on B: B's lookup finds its blocks in Mooncake Store, its
  loader reads them from A's segment over TCP across the namespaces, and B answers as the plain
  server (greedy tokens, log-probabilities within 1e-3). And back: a prompt B computed is a hit on
  A, loaded into A's shared buffers, and A's later steps reload those blocks (the shared-buffer
  reloads) and answer as the plain server.
- The master killed while A saves a long prompt: A's later saves fail or are skipped (counted,
  logged), the request itself answers as the plain server; a lookup while the master is down is
  no hit (the request is computed); once the master is back, A puts its complete objects again, and
  B's hit on that prompt holds only blocks A completed before the kill and answers as the plain
  server: never a corrupt hit.
- A master that does not answer at start-up: ``test_vllm_refusals.py``; the config keys:
  ``test_vllm_guide_keys.py``.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from vllm_support import completion, store_config, tiny_llama_dir

from kvoffload_testing.netns import namespace_pair
from kvoffload_testing.prom import metric
from kvoffload_testing.vllm_server import VllmServer, running
from kvoffload_testing.vllm_stack import split_cores
from poolbackends.mooncake_master import MasterConfig, MooncakeMaster

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128
TOLERANCE = 1e-3
HITS = "vllm:external_prefix_cache_hits_total"
SAVE_ERRORS = "vllm:kvoffload_store_save_errors_total"
HALVES = split_cores() or ("", "")  # A on one half of the cores, B and the plain server on the other
A_ENV = {"VLLM_CPU_OMP_THREADS_BIND": HALVES[0]} if HALVES[0] else {}
B_ENV = {"VLLM_CPU_OMP_THREADS_BIND": HALVES[1]} if HALVES[1] else {}


def tokens(seed: int, n: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 40000 + 1000 for i in range(n)]


P1 = tokens(1, 16 * BLOCK + 40)  # prefilled by A, a hit on B
P2 = tokens(2, 16 * BLOCK + 40)  # computed by B, a hit on A
LONG = tokens(3, 3800)  # A saves it while the master dies


def greedy(url: str, prompt: list[int], n: int = 8) -> tuple[list[str], list[float]]:
    out = completion(url, prompt, n, logprobs=1, timeout_s=300)["choices"][0]["logprobs"]
    return out["tokens"], out["token_logprobs"]


def assert_as_plain(got: tuple[list[str], list[float]], plain: tuple[list[str], list[float]]) -> None:
    assert got[0] == plain[0], (got[0], plain[0])
    assert max(abs(a - b) for a, b in zip(got[1], plain[1], strict=True)) < TOLERANCE, (got[1], plain[1])


def lines(log: str, event: str) -> list[str]:
    return [x for x in log.splitlines() if re.search(rf"\b{event}\b", x)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The master, A and B (each in its namespace) and the plain server, the vLLM servers started side by side."""
    logs = tmp_path_factory.mktemp("mooncake-store")
    model = tiny_llama_dir(logs / "llama4", num_layers=4)
    with namespace_pair() as (na, nb), MooncakeMaster.start(MasterConfig(host=na.here)) as master:

        def server(name: str, env: dict, kv: str | None = None, *args: str, ns=None) -> VllmServer:
            extra = ["--kv-transfer-config", kv, *args] if kv else []
            return VllmServer(
                model,
                max_model_len=4096,
                log_path=logs / f"{name}.log",
                env={**env, "PYTHONUNBUFFERED": "1"},  # the fault test follows A's log as it is written
                extra_args=extra,
                host=ns.there if ns else "127.0.0.1",
                netns=ns.name if ns else None,
            )

        pool = {"backend": "mooncake", "mooncake_master": master.address}
        a_kv = store_config(None, "kv_producer", **pool, layerwise_num_shared_buffers=2)
        a = server("a", A_ENV, a_kv, "--max-num-batched-tokens", "256", ns=na)
        b = server("b", B_ENV, store_config(None, **pool), ns=nb)
        with running(a, b, server("plain", B_ENV)) as (_, _, plain):
            yield {"master": master, "a": a, "b": b, "plain": plain, "na": na, "nb": nb}


def test_a_prompt_prefilled_on_one_host_is_a_prefix_hit_on_the_other(servers):
    a, b, plain = servers["a"], servers["b"], servers["plain"]
    for name, ns in (("a", servers["na"]), ("b", servers["nb"])):  # each pool is reached at its own address
        connected = lines(servers[name].log_text(), "mooncake_pool_connected")
        assert connected and all(f"host={ns.there}" in x for x in connected), connected
    assert "kvoffload_shared_buffers" in a.log_text()  # A runs on shared layer buffers
    assert_as_plain(greedy(a.url, P1), greedy(plain.url, P1))  # A computes P1 and saves its 16 full blocks
    asked = P1 + tokens(4, 30)
    hits = metric(b.url, HITS)
    assert_as_plain(greedy(b.url, asked), greedy(plain.url, asked))
    assert metric(b.url, HITS) - hits == 16 * BLOCK  # every full block from A's segment, over the veth link
    assert any("blocks=16" in x for x in lines(b.log_text(), "kvoffload_loaded")), b.log_text()[-3000:]
    # back: B computes P2; A's hit on it fills its shared buffers, and its next steps (256 tokens each)
    # reload those blocks from the host copy before every shared layer writes
    assert_as_plain(greedy(b.url, P2), greedy(plain.url, P2))
    asked = P2 + tokens(5, 600)
    hits = metric(a.url, HITS)
    assert_as_plain(greedy(a.url, asked), greedy(plain.url, asked))
    assert metric(a.url, HITS) - hits == 16 * BLOCK
    reloaded = [int(re.search(r"\breloaded_blocks=(\d+)", x)[1]) for x in lines(a.log_text(), "kvoffload_shared_step")]
    assert sum(reloaded) >= 2 * 16, reloaded  # at least two steps after the hit reloaded its 16 blocks


def test_the_master_killed_mid_save_never_corrupts_a_later_hit(servers):
    a, b, plain, master = servers["a"], servers["b"], servers["plain"], servers["master"]
    expected = greedy(plain.url, LONG)
    saved_before = len(lines(a.log_text(), "kvoffload_saved"))
    errors_before = metric(a.url, SAVE_ERRORS)
    answer: dict = {}

    def ask() -> None:
        try:
            answer["got"] = greedy(a.url, LONG)
        except RuntimeError as exc:  # a failed request is allowed; a wrong answer is not
            answer["error"] = str(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    deadline = time.monotonic() + 120
    while len(lines(a.log_text(), "kvoffload_saved")) == saved_before:  # A's first step of LONG saved
        assert asking.is_alive() and time.monotonic() < deadline, "A saved nothing of the long prompt"
        time.sleep(0.005)
    master.kill()
    asking.join(300)
    saved = lines(a.log_text(), "kvoffload_saved")[saved_before:]
    saved_blocks = sum(int(re.search(r"\bblocks=(\d+)", x)[1]) for x in saved)
    assert "got" in answer or "error" in answer, answer
    if "got" in answer:
        assert_as_plain(answer["got"], expected)
    assert saved_blocks < len(LONG) // BLOCK, saved  # the kill came before the last save
    assert metric(a.url, SAVE_ERRORS) > errors_before  # the saves after it failed or were skipped, counted
    assert lines(a.log_text(), "kvoffload_save_failed") or lines(a.log_text(), "kvoffload_save_skipped")
    # the master down: a lookup finds nothing, the request is computed
    down = LONG + tokens(6, 20)
    assert_as_plain(greedy(a.url, down), greedy(plain.url, down))
    assert lines(a.log_text(), "kvoffload_lookup_failed")
    master.restart()  # a fresh master, no key: A puts its complete objects again
    deadline = time.monotonic() + 60
    while not lines(a.log_text(), "mooncake_pool_republished"):
        assert time.monotonic() < deadline, a.log_text()[-3000:]
        time.sleep(0.2)
    later = LONG + tokens(7, 20)
    hits = metric(b.url, HITS)
    assert_as_plain(greedy(b.url, later), greedy(plain.url, later))
    hit = metric(b.url, HITS) - hits
    assert 0 < hit <= saved_blocks * BLOCK, (hit, saved_blocks)  # only blocks completed before the kill
