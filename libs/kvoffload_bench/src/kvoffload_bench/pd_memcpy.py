"""``kvoffload bench pd``'s memcpy references: the copy rate next to the decode's pulls.

``MemcpySampler`` copies a pull's bytes between cold buffers in a thread of the bench process while
a round runs (the in-stack reference, under the same load); ``pull_vs_memcpy`` times the pull code
path itself against a memcpy of the same bytes with the stack down (the ``idle_*`` diagnostic).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch


class MemcpySampler:
    """Times ``dst.copy_(src)`` of ``nbytes`` in a thread until ``stop`` is set (at least once).
    Source and destination rotate over >= 64 MiB each (touched up front), so no copy is
    cache-hot; after each copy it sleeps 4x its time (<= ~20% of one core)."""

    def __init__(self, nbytes: int) -> None:
        n = max(2, -(-(64 << 20) // max(nbytes, 1)))
        self.src = torch.full((n, nbytes), 7, dtype=torch.uint8)  # [n, nbytes]
        self.dst = torch.zeros(n, nbytes, dtype=torch.uint8)
        self.nbytes = nbytes

    def start(self, stop: threading.Event) -> Callable[[], tuple[float, int]]:
        """Starts copying until ``stop`` is set; the returned function waits for the thread and
        gives (GB/s = bytes over seconds, summed over the copies; number of copies)."""
        times: list[float] = []

        def loop() -> None:
            i = 0
            while True:
                t = time.perf_counter()
                self.dst[i % len(self.dst)].copy_(self.src[(i + 1) % len(self.src)])
                dt = time.perf_counter() - t
                times.append(dt)
                i += 1
                if stop.wait(max(4 * dt, 1e-3)):
                    return

        th = threading.Thread(target=loop, name="bench-pd-memcpy", daemon=True)
        th.start()

        def finish() -> tuple[float, int]:
            th.join()
            total = sum(times)
            return (self.nbytes * len(times) / total / 1e9 if total else 0.0), len(times)

        return finish


def pull_vs_memcpy(prompt_tokens: int, block_size: int, reps: int = 25) -> tuple[float, float]:
    """(pull GB/s, memcpy GB/s) of one layer's rows, shared memory -> decode pool + indexer cache,
    side by side in this process with the stack down (the ``idle_*`` diagnostic)."""
    import uuid

    import structlog

    from dsamodel.presets import tiny_model
    from kvcore.pool.geometry import PoolGeometry
    from kvcore.pool.segment import SharedSegment
    from kvoffload_engine import build
    from kvoffload_engine.decode import SparseDecoder

    model = tiny_model(dtype="float32").to(torch.bfloat16)
    c = model.config
    main_bytes, idx_bytes = c.kv_row_width * 2, c.index_head_dim * 2
    blocks = -(-prompt_tokens // block_size)
    seg = SharedSegment.create(
        f"kvoffload-bench-pull-{uuid.uuid4().hex[:8]}", PoolGeometry(block_size, (main_bytes, idx_bytes), blocks)
    )
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
            dec.write_prompt_layer(
                "bench",
                r % layers,
                main.view(torch.bfloat16).view(prompt_tokens, -1),
                idx.view(torch.bfloat16).view(prompt_tokens, -1),
            )
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
