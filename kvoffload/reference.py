"""The single-process engine as the reference the stack is measured against.

``greedy_reference(model_dir)`` returns ``run(prompt_ids, max_tokens) -> token ids``, cached per
prompt, computed by ``dsamodel``'s ``Engine`` with the stack's block size and sizes: what every
disaggregated path must reproduce (I3). ``TimedEngine`` serves a benchmark's batch in this process
and stamps every token (``kvoffload bench pd`` and ``load``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def greedy_reference(model_dir: Path, *, block_size: int = 16, max_model_len: int = 8192
                     ) -> Callable[[list[int], int], list[int]]:
    from dsamodel.engine.engine import Engine, EngineConfig
    from dsamodel.sampling import SamplingParams
    from dsamodel.weights import load_model

    model = load_model(model_dir)
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            eng = Engine(model, EngineConfig(block_size=block_size, max_model_len=max_model_len, chunk_size=2048,
                                             buffers=3, topk_buffer_size=128, prefill_pool_bytes=64 << 20,
                                             decode_pool_bytes=64 << 20))
            try:
                cache[key] = eng.generate([prompt_ids], SamplingParams(max_tokens=max_tokens))[0]
            finally:
                eng.close()
        return cache[key]

    return run


class TimedEngine:
    """The single-process engine with a stack's sizes, loaded once, for benchmarks: ``run`` serves a
    batch of requests (all added at once, stepped until done) and returns when each token appeared."""

    def __init__(self, model_dir: Path, *, block_size: int, max_model_len: int, max_num_seqs: int,
                 chunk_size: int) -> None:
        from dsamodel.engine.engine import Engine, EngineConfig
        from dsamodel.weights import load_model

        self.eng = Engine(load_model(model_dir),
                          EngineConfig(block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                       chunk_size=chunk_size, buffers=3, topk_buffer_size=128,
                                       prefill_pool_bytes=1 << 30, decode_pool_bytes=1 << 30))

    def run(self, tag: str, work: list[tuple[list[int], int]],
            after_step: Callable[[list, list[list[float]]], None] | None = None
            ) -> tuple[float, list[list[int]], list[list[float]]]:
        """(start time, token ids, perf_counter stamps of each token) per request of ``work``
        ((prompt, max_tokens) pairs); ``after_step(seqs, stamps)`` runs after every engine step."""
        from dsamodel.sampling import SamplingParams

        eng = self.eng
        t0 = time.perf_counter()
        seqs = [eng.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(work)]
        stamps: list[list[float]] = [[] for _ in seqs]
        while eng.waiting or eng.running:
            eng.step()
            now = time.perf_counter()
            for s, st in zip(seqs, stamps, strict=True):
                st.extend([now] * (len(s.output_ids) - len(st)))
            if after_step is not None:
                after_step(seqs, stamps)
        return t0, [list(s.output_ids) for s in seqs], stamps

    def close(self) -> None:
        self.eng.close()
