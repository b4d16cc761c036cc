"""The single-process engine: layerwise prefill, hand-over to sparse decode, sampling.

``Engine.step()`` is the whole loop: prefill the waiting requests that fit (one at a time through
the shared layer buffers), hand each one's prompt KV from the prefill host pool to the decode host
pool and indexer cache, then run one decode step for every running request and sample. The
services of the P/D stack run the same two halves in two processes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from dsamodel.sampling import RequestSampler
from dsamodel.served import ServedModel, index_topk
from kvcore.config.names import DEFAULT_HOT_CACHE_POLICY
from kvcore.device import DeviceAllocator
from kvcore.pool.host_pool import HostPoolBackend
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder
from kvoffload_engine.prefill import PrefillRequest, PrefillResult
from kvoffload_engine.speculative import DraftStats, decode_step, greedy_draft
from openai_api.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizes; ``buffers``/``independent`` are the prefill plan, the rest decode and pools."""

    block_size: int = 16
    max_model_len: int = 16384
    max_num_seqs: int = 8
    chunk_size: int = 2048
    buffers: int | None = 3
    independent: tuple[int, ...] | str = (0,)
    prefetch_layers: int | None = None
    topk_buffer_size: int = 128
    keep_device_kv_cache: bool = False
    hot_cache_policy: str = DEFAULT_HOT_CACHE_POLICY  # kvcore.hotcache.POLICIES
    miss_prefetch: bool = False  # kvoffload_engine.prefetch
    prefill_pool_bytes: int = 256 << 20
    decode_pool_bytes: int = 256 << 20
    model_id: str = "model"
    native: bool = True
    num_speculative_tokens: int = 0  # 1: greedy requests decode with one MTP draft token per step

    def __post_init__(self) -> None:
        if self.num_speculative_tokens not in (0, 1):
            raise ValueError(f"num_speculative_tokens: got {self.num_speculative_tokens}; must be 0 or 1")


@dataclass
class Sequence:
    """A request in the engine: prompt, sampler, and how much was prefilled from cache."""

    request_id: str
    prompt: torch.Tensor  # [P] int64
    sampler: RequestSampler
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0

    @property
    def output_ids(self) -> list[int]:
        return self.sampler.output_ids

    @property
    def finished(self) -> bool:
        return self.sampler.finished


class Engine:
    """Prefill + sparse decode of one model in one process (the reference for I3)."""

    def __init__(
        self, model: ServedModel, config: EngineConfig = EngineConfig(), prefill_pool: HostPoolBackend | None = None
    ) -> None:
        """``prefill_pool``: the host pool (prefix cache) the prefill saves to and loads from, e.g.
        a shared one of another backend; the caller keeps it and closes it. Default: one of
        ``config.prefill_pool_bytes`` in this process, closed by ``close``."""
        self.model, self.config = model, config
        index_topk(model)  # a model that cannot decode sparsely is refused before anything is allocated
        self.allocator = DeviceAllocator(model.device)
        self._owns_prefill_pool = prefill_pool is None
        self.prefill_pool = (
            prefill_pool
            if prefill_pool is not None
            else build.prefill_pool(model, config.block_size, config.prefill_pool_bytes)
        )
        self.decode_pool = build.decode_pool(model, config.block_size, config.decode_pool_bytes)
        self.prefill = build.prefill_engine(
            model,
            self.prefill_pool,
            buffers=config.buffers,
            independent=config.independent,
            chunk_size=config.chunk_size,
            max_model_len=config.max_model_len,
            prefetch=config.prefetch_layers,
            model_id=config.model_id,
            allocator=self.allocator,
        )
        self.decoder = SparseDecoder(
            model,
            self.decode_pool,
            topk_buffer_size=config.topk_buffer_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            keep_device_kv_cache=config.keep_device_kv_cache,
            allocator=self.allocator,
            native=config.native,
            hot_cache_policy=config.hot_cache_policy,
            miss_prefetch=config.miss_prefetch,
        )
        if config.num_speculative_tokens and not model.config.num_nextn_predict_layers:
            raise ValueError("num_speculative_tokens=1 needs a model with an MTP layer (num_nextn_predict_layers >= 1)")
        self.prefix_keys: set[bytes] = set()  # prefix-cache objects (hash keys) the prompts wrote or reused
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._next_input: dict[str, int] = {}
        self._draft: dict[str, int] = {}  # greedy requests under speculative decode: the MTP draft
        self.draft_stats = DraftStats()

    @property
    def num_drafts(self) -> int:
        return self.draft_stats.drafts

    @property
    def num_accepted(self) -> int:
        return self.draft_stats.accepted

    def add_request(self, request_id: str, prompt_ids: list[int] | torch.Tensor, params: SamplingParams) -> Sequence:
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError("prompt must be a non-empty list of token ids")
        if prompt.numel() + params.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt ({prompt.numel()}) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={self.config.max_model_len}"
            )
        seq = Sequence(request_id, prompt, RequestSampler(params, self.model.config.eos_token_id))
        self.waiting.append(seq)
        return seq

    def step(self) -> list[Sequence]:
        """Admit and prefill what fits, then one decode step; returns the requests that finished."""
        finished: list[Sequence] = []
        while self.waiting and self.decoder.can_admit(self.waiting[0].prompt.numel() + 1):
            seq = self.waiting.popleft()
            self._prefill(seq)
            (finished if seq.finished else self.running).append(seq)
            if seq.finished:
                self._retire(seq)
        if self.running:
            self._decode_step()
            for seq in [s for s in self.running if s.finished]:
                self.running.remove(seq)
                self._retire(seq)
                finished.append(seq)
        return finished

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request (its decode state freed); False if it is not here."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return True
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self._retire(seq)
                return True
        return False

    def _propose(self, seq: Sequence, draft_logits: torch.Tensor) -> int:
        """The draft token for the position after the next input: the MTP head's greedy choice."""
        return greedy_draft(seq.request_id, draft_logits)

    def _retire(self, seq: Sequence) -> None:
        self.decoder.finish(seq.request_id)
        self._next_input.pop(seq.request_id, None)
        self._draft.pop(seq.request_id, None)

    def _decode_step(self) -> None:
        """One decode step (``kvoffload_engine.speculative``): a request with a draft verifies it
        (greedy) and drafts the next one."""
        seqs = {s.request_id: s for s in self.running}
        decode_step(
            self.decoder,
            [(s.request_id, s.sampler) for s in self.running],
            self._next_input,
            self._draft,
            self.draft_stats,
            lambda rid, logits: self._propose(seqs[rid], logits),
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion; output token ids per prompt, in order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(f"gen-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        while self.waiting or self.running:
            self.step()
        return [s.output_ids for s in seqs]

    def _prefill(self, seq: Sequence) -> None:
        res = self.prefill.run(PrefillRequest(seq.request_id, seq.prompt, sample=seq.sampler.step))
        owned = set(res.owned_keys)
        self.prefix_keys.update(k for k in res.keys if k not in owned)
        try:
            seq.num_cached_tokens, seq.num_computed_tokens = res.num_cached_tokens, res.num_computed_tokens
            if not seq.finished:
                self._hand_over(res, seq.prompt.numel())
                self._next_input[seq.request_id] = res.first_token
                if self.config.num_speculative_tokens and seq.sampler.params.temperature == 0:
                    # speculation needs an MTP layer (checked in __init__), whose logits the prefill returns
                    assert res.draft_logits is not None
                    self._draft[seq.request_id] = self._propose(seq, res.draft_logits)
        finally:
            self.prefill.release(res)

    def _hand_over(self, res: PrefillResult, num_tokens: int) -> None:
        """Copy the prompt's main KV into the decode pool and its indexer keys onto the device."""
        dec, pool = self.decoder, self.prefill_pool
        dec.admit(res.request_id, num_tokens + 1)
        try:
            geo = pool.geometry
            for layer in self.model.cache_layers:
                i = layer.cache_index
                rows = []
                for kind in ("main", "indexer"):
                    plane = geo.plane_index(i, kind)
                    dtype, width = (
                        (self.model.dtype, self.model.config.kv_row_width)
                        if kind == "main"
                        else self.model.index_codec.storage(self.model.dtype)
                    )
                    buf = torch.empty((len(res.keys), geo.block_size, width), dtype=dtype)
                    pool.get_into(res.keys, plane, buf)
                    rows.append(buf.view(-1, width)[:num_tokens])  # [P, W]
                dec.write_prompt_layer(res.request_id, i, rows[0], rows[1])
            dec.set_prompt_done(res.request_id, num_tokens)
        except BaseException:
            dec.finish(res.request_id)
            raise

    def close(self) -> None:
        self.prefill.close()
        if self._owns_prefill_pool:
            self.prefill_pool.close()
        self.decode_pool.close()
