"""The test oracle of the stacks (I3), and the single-process engine timed for benchmarks.

``greedy_reference(model_dir)`` returns ``run(prompt_ids, max_tokens) -> token ids``, cached per
(prompt, max_tokens): greedy tokens on the plainest path the model has, ``dsamodel.dense_decode``:
the prompt as one chunk, then one token at a time, every layer keeping its own full KV on the
device, the indexer's top-k chosen over all of it, attention over the selected rows in top-k
order. It shares the model's math with the stacks (projections, the indexer's scores, attention
over gathered rows) and none of their machinery: no layerwise prefill or shared buffers (I1), no
host pool, hot cache, native gather or sparse-offload decode (I2), no MTP drafts, no ``Engine``; a
deterministic bug in any of those changes the stack's tokens, not these
(``kvoffload/tests/test_reference.py``).

``TimedEngine`` serves a benchmark's batch through ``kvoffload_engine``'s ``Engine`` in this process and
stamps every token (``kvoffload bench pd`` and ``load``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def greedy_reference(
    model_dir: Path, *, block_size: int = 16, max_model_len: int = 8192
) -> Callable[[list[int], int], list[int]]:
    """``run(prompt_ids, max_tokens)``: the model's greedy tokens, refused (ValueError) past
    ``max_model_len`` as the stack refuses them. ``block_size`` is the stack's; a full KV has no
    blocks, so the tokens do not depend on it (I3: placement never changes results)."""
    from dsamodel.dense_decode import generate_full_kv
    from dsamodel.weights import load_model
    from openai_api.sampling_params import SamplingParams

    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    model = load_model(model_dir)
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            if len(prompt_ids) + max_tokens > max_model_len:
                raise ValueError(
                    f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds max_model_len={max_model_len}"
                )
            with _one_thread():
                cache[key] = generate_full_kv(model, list(prompt_ids), SamplingParams(max_tokens=max_tokens))
        return cache[key]

    return run


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread meanwhile: the tiny model's decode ops are too small to share, and on a
    loaded 2-core machine each one waited ~7 ms for a descheduled OpenMP thread (measured: 12 tokens
    after a 1-token prompt took 8.3 s on two threads, 0.18 s on one). The tokens are the same."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class TimedEngine:
    """The single-process engine with a stack's sizes, loaded once, for benchmarks: ``run`` serves a
    batch of requests (all added at once, stepped until done) and returns when each token appeared."""

    def __init__(
        self, model_dir: Path, *, block_size: int, max_model_len: int, max_num_seqs: int, chunk_size: int
    ) -> None:
        from dsamodel.weights import load_model
        from kvoffload_engine.engine import Engine, EngineConfig

        self.eng = Engine(
            load_model(model_dir),
            EngineConfig(
                block_size=block_size,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                chunk_size=chunk_size,
                buffers=3,
                topk_buffer_size=128,
                prefill_pool_bytes=1 << 30,
                decode_pool_bytes=1 << 30,
            ),
        )

    def run(
        self,
        tag: str,
        work: list[tuple[list[int], int]],
        after_step: Callable[[list, list[list[float]]], None] | None = None,
    ) -> tuple[float, list[list[int]], list[list[float]]]:
        """(start time, token ids, perf_counter stamps of each token) per request of ``work``
        ((prompt, max_tokens) pairs); ``after_step(seqs, stamps)`` runs after every engine step."""
        from openai_api.sampling_params import SamplingParams

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
