"""Greedy tokens of the single-process engine: what every disaggregated path must reproduce (I3).

``greedy_reference(model_dir)`` returns ``run(prompt_ids, max_tokens) -> token ids``, cached per
prompt, computed by ``dsamodel``'s ``Engine`` with the stack's block size and sizes.
"""

from __future__ import annotations

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
