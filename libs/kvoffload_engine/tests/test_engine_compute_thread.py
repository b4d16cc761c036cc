"""Every request computes on the prefill engine's one compute thread, whichever thread calls it.

torch's CPU GEMM (oneDNN) keeps a cache of up to 1024 kernels per calling thread, one per matmul
shape, so per prompt length: ~0.65 MB each (measured: 1,000 lengths of one bf16 linear, 633 MB). The
prefill service calls ``compute`` from the thread of each request in service (up to 256), and its
resident memory grew by those caches, 1.2-1.7 GB per round of 256 clients, until the OOM killer
took it. On one thread the caches are those of one thread, whatever the concurrency.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from engine_support import prefill_engine, prefill_pool, seeded_prompt, tiny

from kvoffload_engine.prefill import PrefillRequest

BS = 4
CALLERS = 6


def test_requests_of_many_threads_compute_on_the_engines_one_thread_and_get_the_same_results():
    model = tiny(torch.bfloat16)
    pool = prefill_pool(model, BS)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=16)
    seen: list[int] = []  # the thread of every layer and every first-token sample

    def note() -> str:
        seen.append(threading.get_ident())
        return ""  # not cancelled

    def sample(logits: torch.Tensor) -> int:
        note()
        return int(torch.argmax(logits))

    def prefill(i: int) -> tuple[int, int]:
        res = eng.run(PrefillRequest(f"r{i}", seeded_prompt(20 + 7 * i, seed=i), sample=sample, cancelled=note))
        eng.release(res)
        return threading.get_ident(), res.first_token

    try:
        with ThreadPoolExecutor(CALLERS) as callers:
            out = list(callers.map(prefill, range(2 * CALLERS)))
        alone = [eng.run(PrefillRequest(f"again{i}", seeded_prompt(20 + 7 * i, seed=i))) for i in range(2 * CALLERS)]
        for res in alone:
            eng.release(res)
    finally:
        eng.close()
        pool.close()
    callers_seen = {ident for ident, _ in out}
    assert len(callers_seen) > 1, "the requests did not come from several threads"
    layers = len(model.cache_layers)
    chunks = sum(-(-(20 + 7 * i) // 16) for i in range(2 * CALLERS))
    assert len(seen) == chunks * layers + 2 * CALLERS  # every layer of every chunk, every sample
    assert len(set(seen)) == 1 and not set(seen) & callers_seen, (len(set(seen)), len(callers_seen))
    assert [first for _, first in out] == [res.first_token for res in alone]  # a thread hop changes no result
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-compute")]  # close ended it
