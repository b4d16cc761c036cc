"""``kvoffload bench pd``: the P/D stack through the proxy vs the single-process engine.

Both serve the same 8 concurrent greedy requests of 4096-token prompts with the same engine sizes.
``ttft_ratio`` and ``tpot_ratio`` compare the medians over the requests (P/D / single process;
goal for TPOT <= 1.3). ``pull_gbps_ratio_to_memcpy`` (goal >= 0.5): the same-host pull's data
movement (a layer's rows read out of a prefill's shared-memory buffer and installed into a decode
host pool and indexer cache, by the decode's own code path) against a memcpy of the same bytes,
side by side on an idle machine; ``pull_gbps_in_stack`` is what the decode measured during the run
(both cores busy with prefill compute). Greedy tokens must be identical (I3).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

GOAL_TPOT_RATIO = 1.3
GOAL_PULL_RATIO = 0.5


def _stream_timed(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """(tokens, time to first token, time per output token after the first) of one streaming request."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ids, stamps = [], []
    with urllib.request.urlopen(req, timeout=1800) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"request failed: {event['error']}")
                new = [t for c in event["choices"] for t in c.get("token_ids", [])]
                ids += new
                stamps += [time.perf_counter()] * len(new)
    return ids, stamps[0] - t0, _tpot(stamps)


def _tpot(stamps: list[float]) -> float:
    """Median gap between tokens over the second half of a stream (the first tokens can arrive in
    one burst when decoding starts before the client's stream is connected end to end)."""
    half = stamps[len(stamps) // 2 :]
    gaps = [b - a for a, b in zip(half, half[1:])]
    return statistics.median(gaps) if gaps else 0.0


def _single_process(model_dir: Path, prompts: list[list[int]], max_tokens: int, block_size: int):
    from dsamodel.engine.engine import Engine, EngineConfig
    from dsamodel.sampling import SamplingParams
    from dsamodel.weights import load_model

    model = load_model(model_dir)
    eng = Engine(model, EngineConfig(block_size=block_size, max_model_len=8192, max_num_seqs=len(prompts),
                                     chunk_size=2048, buffers=3, topk_buffer_size=128,
                                     prefill_pool_bytes=1 << 30, decode_pool_bytes=1 << 30))
    try:
        t0 = time.perf_counter()
        seqs = [eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
        stamps: dict[str, list[float]] = {s.request_id: [] for s in seqs}
        while eng.waiting or eng.running:
            eng.step()
            now = time.perf_counter()
            for s in seqs:
                while len(stamps[s.request_id]) < len(s.output_ids):
                    stamps[s.request_id].append(now)
        ttft = [stamps[s.request_id][0] - t0 for s in seqs]
        tpot = [_tpot(st) for st in stamps.values()]
        return [s.output_ids for s in seqs], ttft, tpot
    finally:
        eng.close()


def _pull_vs_memcpy(prompt_tokens: int, block_size: int, reps: int = 25) -> tuple[float, float]:
    """(pull GB/s, memcpy GB/s) of one layer's rows, shared memory -> decode pool + indexer cache."""
    import uuid

    import structlog
    from dsamodel.engine import build
    from dsamodel.engine.decode import SparseDecoder
    from dsamodel.presets import tiny_model
    from kvcore.segment import PoolGeometry, SharedSegment

    model = tiny_model(dtype="float32").to(torch.bfloat16)
    c = model.config
    main_bytes, idx_bytes = c.kv_row_width * 2, c.index_head_dim * 2
    blocks = -(-prompt_tokens // block_size)
    seg = SharedSegment.create(f"kvoffload-bench-pull-{uuid.uuid4().hex[:8]}",
                               PoolGeometry(block_size, (main_bytes, idx_bytes), blocks))
    pool = build.decode_pool(model, block_size, 1 << 30)
    dec = SparseDecoder(model, pool, topk_buffer_size=128, max_num_seqs=1, max_model_len=prompt_tokens + 16)
    try:
        dec.admit("bench", prompt_tokens + 1)
        main = seg.plane(0).view(-1, main_bytes)[:prompt_tokens]  # the prefill's buffer rows
        idx = seg.plane(1).view(-1, idx_bytes)[:prompt_tokens]
        main.fill_(3)
        idx.fill_(5)
        nbytes = main.numel() + idx.numel()
        layers = len(model.cache_layers)
        dst = torch.empty(layers, nbytes, dtype=torch.uint8)  # like the pool: one region per layer
        src = torch.cat((main.reshape(-1), idx.reshape(-1)))
        pulls, copies = [], []
        for r in range(reps + layers):  # the first round over the layers touches every page once
            t = time.perf_counter()
            dec.write_prompt_layer("bench", r % layers, main.view(torch.bfloat16).view(prompt_tokens, -1),
                                   idx.view(torch.bfloat16).view(prompt_tokens, -1))
            t1 = time.perf_counter()
            dst[r % layers].copy_(src)
            t2 = time.perf_counter()
            if r >= layers:
                pulls.append(t1 - t)
                copies.append(t2 - t1)
        return nbytes / statistics.median(pulls) / 1e9, nbytes / statistics.median(copies) / 1e9
    finally:
        dec.finish("bench")
        pool.close()
        seg.close()
        seg.unlink()
        structlog.reset_defaults()


def run(*, requests: int = 8, prompt_tokens: int = 4096, max_tokens: int = 64, block_size: int = 16) -> dict:
    from dsamodel.bench import quiet_logs

    from kvoffload.stack import Stack, StackConfig, ensure_tiny_model, stack_stats

    quiet_logs()

    work = Path(tempfile.mkdtemp(prefix="kvoffload-bench-pd-"))
    model_dir = ensure_tiny_model(work / "tiny")
    gen = random.Random(0)
    prompts = [[gen.randrange(256) for _ in range(prompt_tokens)] for _ in range(requests)]
    base = gen.randrange(31000, 39000, 50)
    cfg = StackConfig(model=model_dir, log_dir=work / "logs", proxy_port=base, prefill_ports=(base + 1,),
                      decode_ports=(base + 2,), kv_port=base + 20, metastore_port=base + 3,
                      max_model_len=8192, block_size=block_size)
    with Stack(cfg) as stack:
        with cf.ThreadPoolExecutor(requests) as pool:
            pd = list(pool.map(lambda p: _stream_timed(f"{stack.url}/v1/completions", p, max_tokens), prompts))
        stats = stack_stats(cfg)["decode-0"]
    single_ids, single_ttft, single_tpot = _single_process(model_dir, prompts, max_tokens, block_size)
    pd_ttft = statistics.median(r[1] for r in pd)
    pd_tpot = statistics.median(r[2] for r in pd)
    in_stack = stats["bytes_read"] / (stats["read_ms_total"] / 1000) / 1e9 if stats["read_ms_total"] else 0.0
    pull_gbps, memcpy = _pull_vs_memcpy(prompt_tokens, block_size)
    tpot_ratio = pd_tpot / statistics.median(single_tpot)
    return {
        "bench": "pd", "requests": requests, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
        "pd_ttft_s": pd_ttft, "single_ttft_s": statistics.median(single_ttft),
        "ttft_ratio": pd_ttft / statistics.median(single_ttft),
        "pd_tpot_s": pd_tpot, "single_tpot_s": statistics.median(single_tpot), "tpot_ratio": tpot_ratio,
        "pull_bytes": int(stats["bytes_read"]), "pulls": int(stats["read_done"]), "pull_gbps_in_stack": in_stack,
        "pull_gbps": pull_gbps,
        "memcpy_gbps": memcpy, "pull_gbps_ratio_to_memcpy": pull_gbps / memcpy,
        "tokens_equal": [r[0] for r in pd] == single_ids,
        "goals_met": {"tpot_ratio": tpot_ratio <= GOAL_TPOT_RATIO, "pull_gbps_ratio_to_memcpy": pull_gbps / memcpy >= GOAL_PULL_RATIO},
    }
