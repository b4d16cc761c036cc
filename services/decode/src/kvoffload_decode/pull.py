"""The decode's ``RowSink`` (``pdlink.pull_consumer``): what its pulls install into and what it knows of
the requests waiting for KV. ``pdlink.pull_consumer.PullConsumer`` runs the pull itself (layouts,
reads, retries, counters); this module says what a layer's rows are here (the main KV and the
indexer keys, as ``kvoffload_decode`` caches store them), which requests wait and how far each
layer got, and hands the pulled rows to ``DecodeLoop.write_rows`` (rank 0) or
``FollowerPulls.write_rows`` (a TP follower). Heartbeats, ReadReady and PrefillDone are the news
that keep a pending request's watchdog (see ``DecodeLoop``) quiet.
"""

from __future__ import annotations

import torch

from kvcore.layout import CacheSpec, KVLayout, LayerSpec, dtype_name
from kvoffload_proto.v1 import transfer_pb2
from openai_api.logprobs import TokenLogprob
from pdlink.pull_consumer import Plane, Read, ReadOutcome, RowSink
from pdlink.refusals import MalformedRead, UnknownRequest

__all__ = ["DecodeRows", "first_logprob_of"]


class DecodeRows(RowSink):
    """One decode rank's pulls into ``loop``: a ``DecodeLoop`` (rank 0) or ``FollowerPulls``."""

    def __init__(self, loop, layout: KVLayout) -> None:
        self.loop, self.layout = loop, layout
        self.num_layers, self.block_size = layout.num_layers, layout.block_size

    def layout_problem(self, m: transfer_pb2.LayoutMetadata) -> str:
        for spec, got in zip(self.layout.layers, m.layers, strict=True):
            if got.main_row_kind and got.main_row_kind != spec.main.kind:
                return (
                    f"layers[{spec.index}]: the prefill's rows hold {got.main_row_kind!r}, this decode's "
                    f"{spec.main.kind!r} (kvcore.layout.ROW_KINDS): the two serve different model architectures"
                )
            want_idx = spec.indexer.row_bytes if spec.indexer else 0
            want_idx_dtype = dtype_name(spec.indexer.dtype) if spec.indexer else ""
            if (
                got.layer != spec.index
                or got.main_row_bytes != spec.main.row_bytes
                or got.indexer_row_bytes != want_idx
                or got.main_dtype != dtype_name(spec.main.dtype)
                or got.indexer_dtype != want_idx_dtype
            ):
                return (
                    f"layers[{spec.index}]: prefill layer {got.layer} rows {got.main_row_bytes}/"
                    f"{got.indexer_row_bytes} bytes {got.main_dtype}/{got.indexer_dtype or '-'}, decode layer "
                    f"{spec.index} rows {spec.main.row_bytes}/{want_idx} bytes "
                    f"{dtype_name(spec.main.dtype)}/{want_idx_dtype or '-'}"
                )
        return ""

    def planes(self, layer: int) -> list[Plane]:
        spec = self.layout.layers[layer]
        return [
            Plane(transfer_pb2.PLANE_KIND_MAIN, spec.main.row_bytes),
            Plane(transfer_pb2.PLANE_KIND_INDEXER, _indexer(spec).row_bytes),
        ]

    def begin(self, read: Read) -> range | ReadOutcome:
        r = read.request
        req = self.loop.pending_request(r.request_id)
        if req is None:
            raise UnknownRequest(f"request {r.request_id!r} is not waiting for KV here")
        n = r.src_end - r.src_start
        if r.dst_start + n > req.num_prompt_tokens:
            raise MalformedRead(
                f"rows [{r.dst_start}, {r.dst_start + n}) go past the prompt's {req.num_prompt_tokens} tokens"
            )
        self.loop.heard_from_prefill(r.request_id, f"prefill {read.endpoint}")  # a well-formed report
        with self.loop.lock:
            installed = req.rows[r.layer]
        if n and r.dst_start + n <= installed:  # a retry or duplicate: the rows are here
            return ReadOutcome(done=True)
        return range(r.src_start, r.src_end)

    def wanted(self, request_id: str) -> bool:
        return self.loop.pending_request(request_id) is not None

    def install(self, read: Read, rows: range, planes: list[torch.Tensor]) -> float:
        """The rows as the caches store them (``CacheSpec.storage``: the model dtype; an fp8 indexer's
        rows as bytes, keys + scales), written at ``dst_start``."""
        spec = self.layout.layers[read.layer]
        kv, idx = (_rows(raw, cache) for raw, cache in zip(planes, (spec.main, _indexer(spec)), strict=True))
        return self.loop.write_rows(read.request_id, read.layer, read.request.dst_start, kv, idx)

    def heard(self, request_id: str, endpoint: str) -> bool:
        return self.loop.heard_from_prefill(request_id, f"prefill {endpoint}")

    def prefill_done(self, request: transfer_pb2.PrefillDoneRequest, endpoint: str) -> str:
        """ "" when the first token (and, when the request asked for them, its log-probabilities; and
        its MTP draft when one came) is taken, else why not. UnknownRequest if not pending here."""
        rid = request.request_id
        reason = self.premature(rid, request.num_prompt_tokens, request.first_token)
        if not reason:
            self.loop.heard_from_prefill(rid, f"prefill {endpoint}")
        try:
            return reason or self.loop.prefill_done(
                rid,
                request.num_prompt_tokens,
                request.first_token,
                first_logprob_of(request),
                request.draft_token if request.has_draft else None,
            )
        except KeyError:
            raise UnknownRequest(f"request {rid!r} is not waiting for KV here") from None

    def premature(self, request_id: str, num_prompt_tokens: int, first_token: int) -> str:
        """Why a PrefillDone cannot be taken yet ("" if it can): the prefill sends it only after every
        layer's READ_DONE, so a missing layer means it came early; a first token is never replaced."""
        with self.loop.lock:
            req = self.loop.pending.get(request_id)
            if req is None or num_prompt_tokens != req.num_prompt_tokens:
                return ""  # prefill_done names these
            missing = next(((i, r) for i, r in enumerate(req.rows) if r < req.num_prompt_tokens), None)
            if missing is not None:
                return (
                    f"layer {missing[0]} has {missing[1]} of {req.num_prompt_tokens} rows: PrefillDone must "
                    "follow every layer's READ_DONE"
                )
            if req.first_token is not None and req.first_token != first_token:
                return f"the first token is already {req.first_token} (this PrefillDone says {first_token})"
            return ""


def first_logprob_of(request) -> TokenLogprob | None:
    """PrefillDoneRequest.first_token_logprobs as a TokenLogprob (None when not sent or malformed:
    the loop then refuses a request that asked for logprobs)."""
    if not request.HasField("first_token_logprobs"):
        return None
    m = request.first_token_logprobs
    if len(m.top_tokens) != len(m.top_logprobs):
        return None
    return TokenLogprob(m.token, m.logprob, tuple(zip(m.top_tokens, m.top_logprobs, strict=True)))


def _indexer(spec: LayerSpec) -> CacheSpec:
    """A layer's indexer key cache: the sparse decode keeps one for every layer."""
    if spec.indexer is None:
        raise ValueError(f"layer {spec.index} has no indexer cache: the sparse decode needs one")
    return spec.indexer


def _rows(raw: torch.Tensor, cache: CacheSpec) -> torch.Tensor:
    """Raw bytes [n, row_bytes] of one cache -> its rows as stored ([n, W] of ``cache.storage``)."""
    dtype, width = cache.storage
    return raw.view(dtype).view(-1, width)
