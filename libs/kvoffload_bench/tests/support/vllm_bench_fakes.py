"""Fake servers for ``kvoffload bench vllm``'s goal tests (``test_vllm_connectors_goals.py``,
``test_vllm_pools_goals.py``): ``fake_servers`` replaces every vLLM server, metastore, proxy and
mooncake_master the bench would start (no vLLM starts): each stream answers at once, and the counters
the bench reads from the servers' ``/metrics`` are kept here (each P/D decode's its own, its reads
counted as its backend's), moved by the streams as the real servers would move them; a prompt sent a
second time is a pool hit (0.1 of a miss's TTFT). The model has 30 layers; the P/D prefill logs a plan
of 4 buffers for 30 layers (a test may change the line) and holds ``SHARED_CAPACITY`` times the plain
server's tokens. ``EVENTS`` records each start, stop and timed round, by server; ``run_bench`` runs
the bench on them."""

from __future__ import annotations

import collections
import itertools
import json

from kvoffload_bench import vllm_backends, vllm_pd, vllm_pools, vllm_shared, vllm_stream
from kvoffload_bench import vllm_connectors as bench_vllm

HITS = "vllm:external_prefix_cache_hits_total"
PLAIN_CAPACITY = 23_296
SHARED_CAPACITY = {"ratio": 7.5}  # the prefill's capacity over the plain server's (a test may change it)
PREFILL_LOG = {"line": "kvoffload_shared_buffers block_bytes_per_buffer=1 buffers=4 layers=30 num_blocks=1"}
EVENTS: list[tuple[str, str]] = []  # (what, whose): ("start" | "stop" | "round 0" ..., a log file's stem)
LAYERS = 30
ROUNDS = 2
PD_PROMPT_TOKENS = 200


class FakeService:
    """A vLLM server, metastore or proxy: its address only."""

    prefill_urls: set[str] = set()
    by_url: dict[str, FakeService] = {}
    ports = itertools.count(1)  # below any real port: never one of free_stack_ports'

    def __init__(self, *args, port: int | None = None, log_path=None, **kw) -> None:
        self.port = port or (args[0] if args and isinstance(args[0], int) else next(self.ports))
        self.url, self.address = f"http://127.0.0.1:{self.port}", f"127.0.0.1:{self.port}"
        self.log_name = log_path.name if log_path is not None else ""
        self.prefill = self.log_name.endswith("prefill.log")  # each P/D pair's: "<backend>-prefill.log"
        if self.prefill:
            self.prefill_urls.add(self.url)
        self.by_url[self.url] = self

    def log_text(self) -> str:
        return PREFILL_LOG["line"] if self.prefill else ""

    def start(self) -> FakeService:
        EVENTS.append(("start", self.log_name.removesuffix(".log")))
        return self

    def stop(self) -> None:
        EVENTS.append(("stop", self.log_name.removesuffix(".log")))

    def __enter__(self) -> FakeService:
        return self

    def __exit__(self, *exc) -> None:
        return None


class FakeProxy(FakeService):
    decode_of: dict[str, str] = {}  # proxy URL -> its decode's URL

    def __init__(self, port: int, prefill_port: int, decode_port: int, log_path) -> None:
        super().__init__(port=port, log_path=log_path)
        self.decode_of[self.url] = f"http://127.0.0.1:{decode_port}"


def fake_servers(tmp_path, monkeypatch):
    """Replaces the servers; returns the test's knobs and the model directory. Knobs: ``failed``, the
    backends whose decode fails every pull (and recomputes); ``one_event``, the servers ("plain" or a
    backend) that deliver a whole answer in one event (their TPOT is then the server's own latency);
    ``matrix``: "differs" makes one matrix answer through P/D differ; ``slow``: a server's log name ->
    how many times slower its TTFT is."""
    import kvoffload_testing.vllm_server

    metrics: collections.Counter = collections.Counter()  # the store server's and the plain server's
    decodes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # each decode's own
    seen: set[tuple[int, ...]] = set()
    knobs: dict = {"failed": set(), "one_event": set(), "slow": {}, "slow_hit": {}}
    consumer = vllm_backends.CONSUMER.format
    rounds = {tuple(vllm_stream.pd_prompt(r, PD_PROMPT_TOKENS)): r for r in range(ROUNDS)}
    EVENTS.clear()

    def stream(url: str, model: str, prompt: list[int], max_tokens: int):
        who = FakeService.by_url[url].log_name.split("-")[0].removesuffix(".log")  # plain, vllm or a backend
        if url in FakeProxy.decode_of:  # the decode pulls the prompt's KV (or fails to), through its backend
            decode = FakeProxy.decode_of[url]
            pulled = who not in knobs["failed"]
            counts = decodes[decode]
            counts[consumer("requests_pulled" if pulled else "requests_failed")] += 1
            counts[consumer("bytes_read")] += 1000 * pulled
            counts[consumer("read_ms_total")] += 1e-6 * pulled  # 1 ns: far faster than any memcpy
            counts[consumer("reads_engine" if who == "mooncake" else "reads_streamed")] += 30 * pulled
        if tuple(prompt) in rounds:
            EVENTS.append((f"round {rounds[tuple(prompt)]}", who))
        hit = tuple(prompt) in seen  # the store part's second send of a prompt loads it from the pool
        seen.add(tuple(prompt))
        metrics[HITS] += hit * (len(prompt) // vllm_pd.BLOCK_SIZE) * vllm_pd.BLOCK_SIZE
        log_name = FakeService.by_url[url].log_name
        ttft = (0.1 * knobs["slow_hit"].get(log_name, 1.0) if hit else 1.0) * knobs["slow"].get(log_name, 1.0)
        if who in knobs["one_event"]:  # every token in one event; the server timed 3 steps of 20 ms
            metrics[vllm_stream.ITL[0]] += 0.06
            metrics[vllm_stream.ITL[1]] += 3
            return ttft, ["a", "b", "c", "d"], [ttft] * 4
        return ttft, ["a", "b", "c", "d"], [ttft + 0.01 * i for i in range(4)]

    monkeypatch.setattr(kvoffload_testing.vllm_server, "VllmServer", FakeService)
    monkeypatch.setattr(kvoffload_testing.vllm_server, "Metastore", FakeService)
    monkeypatch.setattr(kvoffload_testing.vllm_server, "Proxy", FakeProxy)
    monkeypatch.setattr(vllm_pools, "start_master", lambda: FakeService(log_path=tmp_path / "mooncake-master.log"))

    def metric(url: str, name: str) -> float:
        return decodes[url][name] if name.startswith("vllm:kvoffload_d2h_consumer_") else metrics[name]

    for module in (vllm_pools, vllm_pd, vllm_stream):
        monkeypatch.setattr(module, "stream", stream)
    for module in (vllm_pd, vllm_stream, vllm_backends):
        monkeypatch.setattr(module, "settled", lambda url, names: {n: metric(url, n) for n in names})
    monkeypatch.setattr(vllm_pools, "metric", metric)

    monkeypatch.setattr(bench_vllm.pd_matrix, "answers", _matrix(knobs))
    monkeypatch.setattr(
        vllm_shared,
        "capacity_tokens",
        lambda url: int(PLAIN_CAPACITY * (SHARED_CAPACITY["ratio"] if url in FakeService.prefill_urls else 1)),
    )
    return knobs, _config_only_model(tmp_path / "model")


def _matrix(knobs: dict):
    """The equality matrix's answers: the proxy's differ in one case where the test asks."""

    def answers(url: str, model: str, lengths: tuple[int, ...]) -> dict:
        out = {f"completion-{n}": (["a", "b"], [-0.5, -0.25]) for n in lengths}
        if url in FakeProxy.decode_of and knobs.get("matrix") == "differs":
            out[f"completion-{lengths[-1]}"] = (["a", "c"], [-0.5, -0.25])
        return out

    return answers


def _config_only_model(model):
    """A model directory holding only the config.json the bench reads (its layers: ``LAYERS``)."""
    model.mkdir()
    config = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": LAYERS, "num_key_value_heads": 2}
    (model / "config.json").write_text(json.dumps(config))
    return model


def run_bench(model, **kw) -> dict:
    return bench_vllm.run(
        model=str(model),
        prefix_tokens=256,
        rounds=ROUNDS,
        max_tokens=4,
        pd_prompt_tokens=PD_PROMPT_TOKENS,
        pd_max_tokens=4,
        progress=False,
        **kw,
    )
