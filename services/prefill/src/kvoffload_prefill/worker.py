"""The prefill worker: one ``LayerwisePrefill`` over shared-memory layer buffers and the host pool,
announcing every layer to the decode endpoints a request names and reporting its first token.

``run(prompt_ids, transfer_params)`` is the whole job of one request: readers = the decode
endpoints in ``transfer_params``; the engine announces each computed layer through their
``DecodeLink``; the reuse gate holds each slot until the save and every READ_DONE arrived.

A tensor-parallel prefill (``follower_segments``: the layer buffers of TP ranks 1..N-1, which hold
the same rows as rank 0's) has one layout per rank, each naming that rank's buffers, and one link
per rank to every decode rank it feeds (a request names decode TP ``remote_tp_size`` ranks; rank t's
contributor group is ``kvcore.pdpair.tp_contributors``). A reader is (request, decode endpoint,
prefill TP rank, its place in the group, the group's size), and each rank's link announces that
rank's share of every layer
(``kvcore.pdpair.contributor_share``), read out of that rank's buffers: no row crosses twice and
the slot is reused only once every share was read. Rank 0 does the talking for all of them (it
decides when a slot is taken, so it also knows when each follower's copy is in place), and its link
to decode TP rank 0 reports the first token.

A request given a ``Turn`` of the prefill's queue (``kvoffload_prefill.queue_bound``) waits there for
the engine — named in its decodes' heartbeats meanwhile, leaving when the bound passes or its decode
drops it — and frees the engine for the next one when its run ends.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from functools import partial

import structlog
import torch

from dsamodel.sampling import RequestSampler
from kvcore.layout import dtype_name
from kvcore.pdpair import contributor_share, tp_contributors
from kvoffload_engine.prefill import LayerwisePrefill, PrefillRequest
from kvoffload_prefill.prefix_cache import remove_unleased
from kvoffload_prefill.queue_bound import PrefillQueue, Turn
from kvoffload_proto.v1 import transfer_pb2
from openai_api.logprobs import TokenLogprob
from openai_api.sampling_params import SamplingParams
from openai_api.transfer_params import KVTransferParams
from pdlink.layout_messages import EngineShare, Region, layer_layout, layout_metadata
from pdlink.links import DecodeLink
from svcruntime.ledger import Ledger

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class PrefillOutcome:
    request_id: str
    first_token: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs


def _first_logprob(sampler: RequestSampler) -> TokenLogprob | None:
    return sampler.logprobs[0] if sampler.logprobs else None


class PrefillWorker:
    def __init__(
        self,
        engine: LayerwisePrefill,
        *,
        model_id: str,
        host_id: str,
        data_endpoint: str,
        read_timeout_s: float = 60.0,
        peer_timeout_s: float = 10.0,
        follower_segments: tuple[str, ...] = (),
        queue: PrefillQueue | None = None,
        engine_share: EngineShare | None = None,
    ) -> None:
        self.engine = engine
        self.queue = queue if queue is not None else PrefillQueue()
        size = engine.followers.size if engine.followers else 1
        if len(follower_segments) != size - 1:
            raise ValueError(
                f"a TP {size} prefill needs the layer buffers of its {size - 1} follower(s), "
                f"got {len(follower_segments)}"
            )
        versions = random.sample(range(1, 2**62), size)  # distinct
        # rank 0's layout, then each follower's: its own buffers, the same slots, rows and offsets
        self.layouts = [
            self._layout_metadata(model_id, host_id, data_endpoint, rank, version, segment, engine_share)
            for rank, (version, segment) in enumerate(zip(versions, (None, *follower_segments)))
        ]
        self.layout, self.layout_version = self.layouts[0], versions[0]
        self._links: dict[tuple[str, int], DecodeLink] = {}  # (decode endpoint, prefill TP rank) -> link
        self._lock = threading.Lock()
        self._read_timeout_s = read_timeout_s
        self._peer_timeout_s = peer_timeout_s
        self._cached_keys: set[bytes] = set()  # prefix-cache objects this worker wrote or reused
        self._outcomes: dict[str, list] = {}  # request id -> (layer, outcome) of every announce
        # stage of every request: prefilling -> awaiting_reads -> reporting -> ok | error. No
        # watchdog here: every wait of the prefill has its own deadline (gate, ReadReady, RPCs).
        self.ledger = Ledger()
        engine.announce = self._announce

    def _layout_metadata(
        self,
        model_id: str,
        host_id: str,
        data_endpoint: str,
        rank: int,
        version: int,
        segment_name: str | None,
        engine_share: EngineShare | None,
    ) -> transfer_pb2.LayoutMetadata:
        eng, bufs = self.engine, self.engine.buffers

        def region(slot: int, kind: str, row_bytes: int) -> Region | None:
            if bufs.segment is None:
                return None
            plane = bufs.segment.plane_offsets[bufs.plane_of[(slot, kind)]]
            return Region(segment_name or bufs.segment.name, plane, row_bytes, bufs.capacity_tokens)

        layers = []
        for spec in eng.plan.layout.layers:
            slot, indexer = eng.plan.slot_of(spec.index), spec.indexer
            layers.append(
                layer_layout(
                    spec.index,
                    slot=slot,
                    main_row_bytes=spec.main.row_bytes,
                    main_dtype=dtype_name(spec.main.dtype),
                    main_row_kind=spec.main.kind,
                    indexer_row_bytes=indexer.row_bytes if indexer else 0,
                    indexer_dtype=dtype_name(indexer.dtype) if indexer else "",
                    main_buffer=region(slot, "main", spec.main.row_bytes),
                    indexer_buffer=region(slot, "indexer", indexer.row_bytes) if indexer else None,
                )
            )
        return layout_metadata(
            model_id=model_id,
            layers=layers,
            block_size=eng.block_size,
            tp_rank=rank,
            tp_size=eng.followers.size if eng.followers else 1,
            data_endpoint=data_endpoint,
            host_id=host_id,
            version=version,
            engine=engine_share if rank == 0 else None,
        )

    def links(self, endpoint: str, ranks: list[int]) -> list[DecodeLink]:
        """The links of prefill TP ``ranks`` (the contributor group of the decode rank at ``endpoint``)
        to it, in rank order, each with its layout accepted."""
        out = []
        for layout in (self.layouts[r] for r in ranks):
            key = (endpoint, layout.prefill_tp_rank)
            with self._lock:
                link = self._links.get(key)
                if link is None:
                    link = self._links[key] = DecodeLink(
                        endpoint, layout, self._read_timeout_s, peer_timeout_s=self._peer_timeout_s
                    )
            link.ensure_layout()
            out.append(link)
        return out

    def _announce(self, ticket, req: PrefillRequest, start: int, end: int) -> None:
        """ReadReady of its share to every reader of the layer (their links exist: ``run`` made them);
        a rank whose share is empty (fewer rows than ranks) has nothing to read: settled here."""
        for reader in ticket.readers:
            rid, endpoint, rank, index, count = reader
            a, b = contributor_share(start, end, index, count)
            if a == b:
                ticket.read_done(reader)
                continue
            with self._lock:
                link = self._links[(endpoint, rank)]
            outcome = link.announce(ticket, reader, rid, a, b)
            with self._lock:
                self._outcomes.setdefault(rid, []).append((ticket.layer, outcome))

    def _stop_reason(self, rid: str, links: list[DecodeLink]) -> str:
        """Why the request should not compute another layer: its decode dropped it or is gone, or
        one of its layers was not read (the request has failed already)."""
        why = next((w for w in (link.dropped(rid) for link in links) if w), "")
        if why:
            return why
        with self._lock:
            failed = [layer for layer, outcome in self._outcomes.get(rid, []) if outcome.failed()]
        return f"the decode did not read layer(s) {sorted(set(failed))}" if failed else ""

    def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        transfer_params: KVTransferParams | None,
        params: SamplingParams | None = None,
        turn: Turn | None = None,
    ) -> PrefillOutcome:
        """Prefill one prompt; with decode params, every layer goes to that decode's TP ranks. With a
        ``turn`` of ``self.queue``, the engine run waits for it (``queue_bound``'s errors raised), and
        the turn leaves the queue when this returns or raises."""
        try:
            return self._serve(request_id, prompt_ids, transfer_params, params, turn)
        finally:
            if turn is not None:
                self.queue.leave(turn)

    def _serve(
        self,
        request_id: str,
        prompt_ids: list[int],
        transfer_params: KVTransferParams | None,
        params: SamplingParams | None,
        turn: Turn | None,
    ) -> PrefillOutcome:
        readers: frozenset = frozenset()
        links: list[DecodeLink] = []
        rid = request_id
        if transfer_params is not None:
            rid = transfer_params.request_id or request_id
            endpoints, found = transfer_params.decode_endpoints(), []
            for t, endpoint in enumerate(endpoints):  # decode TP rank t and its contributor group
                try:
                    group = tp_contributors(len(self.layouts), len(endpoints), t)
                except ValueError as exc:
                    raise ValueError(f"kv_transfer_params.remote_tp_size: {exc}") from None
                links += self.links(endpoint, group)  # the layouts are accepted before any slot is taken
                found += [(rid, endpoint, rank, i, len(group)) for i, rank in enumerate(group)]
            readers = frozenset(found)
        self.ledger.open(rid, "prefilling", peer=f"decode {links[0].endpoint}" if links else "")
        try:
            out = self._run(rid, prompt_ids, links, readers, params, turn)
        except BaseException as exc:
            self.ledger.finish(rid, "error", repr(exc))
            raise
        self.ledger.finish(rid, "ok")
        return out

    def _run(
        self,
        rid: str,
        prompt_ids: list[int],
        links: list[DecodeLink],
        readers: frozenset,
        params: SamplingParams | None,
        turn: Turn | None,
    ) -> PrefillOutcome:
        # the client's parameters hold for the first token too: penalties (none yet), min_tokens
        # (no EOS or stop token id while min_tokens >= 1), logprobs
        sampler = RequestSampler(params or SamplingParams(max_tokens=1), self.engine.model.config.eos_token_id)
        prompt = torch.tensor(prompt_ids, dtype=torch.long)
        if not links:
            res = self._engine_run(PrefillRequest(rid, prompt, sample=sampler.step), turn)
            self._release(res)
            return self._finished(rid, prompt_ids, res, sampler)
        for link in links:
            link.hold(rid)  # heartbeats name the request from now on, queued or computing
        try:
            stop = partial(self._stop_reason, rid, links)  # the queue and the engine ask it
            req = PrefillRequest(rid, prompt, readers=readers, sample=sampler.step, cancelled=stop)
            res = self._engine_run(req, turn)
        except BaseException:
            for link in links:
                link.release(rid)
            with self._lock:
                self._outcomes.pop(rid, None)
            raise
        try:
            self.ledger.advance(rid, "awaiting_reads")
            self._await_reads(rid)
            self.ledger.advance(rid, "reporting")
            draft = int(torch.argmax(res.draft_logits)) if res.draft_logits is not None else None  # MTP's guess
            links[0].prefill_done(rid, len(prompt_ids), res.first_token, _first_logprob(sampler), draft)
        finally:
            for link in links:
                link.release(rid)
            with self._lock:
                self._outcomes.pop(rid, None)
            self._release(res)
        return self._finished(rid, prompt_ids, res, sampler)

    def _engine_run(self, req: PrefillRequest, turn: Turn | None):
        """The engine's run of ``req``, after ``turn``'s wait in the queue (when given); the engine is
        the next one's once every layer is computed, while this request's last saves settle."""
        if turn is None:
            return self.engine.run(req)
        self.queue.wait(turn, req.cancelled or (lambda: ""))
        try:
            computed = self.engine.compute(req)
        finally:
            self.queue.ran(turn)
        return computed.settle()

    def _release(self, res) -> None:
        """End the engine's hand-off; the prompt's hash-keyed blocks stay as prefix cache."""
        self.engine.release(res)
        with self._lock:
            self._cached_keys.update(k for k in res.keys if k not in res.owned_keys)

    @staticmethod
    def _finished(rid: str, prompt_ids: list[int], res, sampler: RequestSampler) -> PrefillOutcome:
        log.info(
            "prefill_finished",
            request_id=rid,
            prompt_tokens=len(prompt_ids),
            cached_tokens=res.num_cached_tokens,
            first_token=res.first_token,
        )
        return PrefillOutcome(
            rid,
            res.first_token,
            len(prompt_ids),
            res.num_cached_tokens,
            res.num_computed_tokens,
            _first_logprob(sampler),
        )

    def _await_reads(self, rid: str) -> None:
        """Every announce of the request answered READ_DONE (each has its own deadline)."""
        with self._lock:
            outcomes = list(self._outcomes.get(rid, []))
        failed = [layer for layer, outcome in outcomes if not outcome.result(timeout=self._read_timeout_s + 5)]
        if failed:
            raise RuntimeError(f"the decode did not read layer(s) {sorted(set(failed))} of request {rid}")

    def reset_prefix_cache(self) -> dict[str, int]:
        """Drop every prefix-cache object not being read right now; returns removed / kept counts."""
        with self._lock:
            keys, self._cached_keys = list(self._cached_keys), set()
        counts, kept = remove_unleased(self.engine.pool, keys)
        with self._lock:
            self._cached_keys.update(kept)
        return counts

    def read_latency_ms(self) -> list[float]:
        with self._lock:
            return [ms for link in self._links.values() for ms in link.read_latency_ms[-1000:]]

    def close(self) -> None:
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()
