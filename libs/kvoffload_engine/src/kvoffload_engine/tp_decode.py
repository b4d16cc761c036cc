"""Tensor-parallel sparse decode: rank 0 leads, ranks 1..N-1 repeat every state change and step.

Every rank holds its shard of the model (``dsamodel.tp``) and a ``SparseDecoder`` of its own: its
indexer cache, its hot top-k buffer, and a view of the one host pool of its DP rank, which holds the
full main KV of every request. Rank 0 creates that pool and alone allocates and frees its blocks;
a follower's pool is the ``kvcore.pool.attached.AttachedPool`` of rank 0's segment, and takes the
block ids rank 0 allocated from the ops below. The cache rows are the same on every rank (the latent
projection and the indexer are replicated), so every rank selects the same top-k, misses the same
rows and reads them from the shared pool, and a row two ranks write (a step's new token; a prompt
row each rank pulls from its contributor prefill ranks, for its own indexer cache) holds the same
bytes either way; only the two reductions per layer cross ranks.

Rank 0 (``LeadDecoder``, a ``SparseDecoder``) decides: admission, binding, commits, frees, which
requests step with which tokens, the MTP layer's inputs. Each change is applied on rank 0 first
(so a refusal, say a full pool, raises there and is never sent), then queued; the queue goes to
the followers, in order over a ``Channel``, as one ``("ops", [op, ...])`` message just before the
next step (which the followers must join) or ``sync``. The ops::

    ("reserve", request_id, num_tokens, block_ids)       ("grow", request_id, num_tokens, block_ids)
    ("bind", request_id)   ("finish", request_id)   ("done", request_id, num_tokens)
    ("commit", request_id, num_tokens)
    ("rows", request_id, layer, start, kv_spec, index_spec)   + two tensors (``send_rows``)
    ("forward", request_ids, tokens)                          the base layers: a step
    ("mtp", request_ids, positions, next_tokens, h_spec)      + h_prev: the MTP layer
    ("sync",)    a barrier: every follower has applied everything before it
    ("poll",)    every follower answers with its ``status()`` (a gather to rank 0)
    ("close",)   the follower returns (after a barrier)

``block_ids`` are the pool blocks rank 0 allocated for the request (all of them for ``reserve``, the
new ones for ``grow``: rank 0 grows each request before a step that needs more, and sends that
first); a follower hands them to its ``AttachedPool`` and makes the same call. ``finish`` goes to
the followers, and every one has applied it (a barrier), before rank 0 frees the blocks: a pull a
follower was still installing for the request can never write into blocks rank 0 gave to another.

``send_rows`` (the default) sends every installed prompt row along: one process computed or pulled
them and the followers take rank 0's copy (the engine tests). A decode service whose ranks each
pull their own rows turns it off and installs them on each rank itself: then every ``reserve`` is
followed by a barrier (when it returns, every rank can take rows of that request), and ``poll``
asks the followers which requests they hold whole. ``follow_decode``'s ``on_op`` sees every op a
follower applied (its service keeps its own bookkeeping of pulls by it).

A follower does not decide anything, so any error on it means it is no longer in step: it raises
out of ``follow_decode`` and its process ends. On rank 0, an error while sending, or inside a step
(the followers may be in a reduction rank 0 will not join), marks the group broken: every later
call raises ``TPGroupBroken``. Nothing waits silently: a follower that is gone fails rank 0's next
collective, and a reduction left unjoined times out.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import structlog
import torch

from kvcore.pool.attached import AttachedPool
from kvoffload_engine.decode import SparseDecoder
from kvoffload_engine.decode_requests import DecodeSeq
from kvoffload_engine.tp_channel import Channel, TPGroupBroken, tensor_dtype, tensor_spec

log = structlog.get_logger(__name__)

__all__ = ["LeadDecoder", "follow_decode"]


class LeadDecoder(SparseDecoder):
    """Rank 0's ``SparseDecoder`` of a TP group of ``size`` ranks (module doc). The caller
    serializes its calls, as for any ``SparseDecoder``."""

    def __init__(self, *args, channel: Channel, size: int, send_rows: bool = True, **kw) -> None:
        super().__init__(*args, **kw)
        self.channel, self.size, self.send_rows = channel, size, send_rows
        self.broken = ""  # why the group is out of step ("" while it is not)
        self._ops: list[tuple] = []
        self.steps_sent = 0

    def check(self) -> None:
        if self.broken:
            raise TPGroupBroken(f"the {self.size} TP decode ranks are out of step ({self.broken}); restart the decode")

    def _flush(self, *tensors: torch.Tensor) -> None:
        """Send the queued ops (the last may be followed by ``tensors``)."""
        self.check()
        ops, self._ops = self._ops, []
        try:
            self.channel.send(("ops", ops))
            for t in tensors:
                self.channel.send_tensor(t.detach().cpu())
        except Exception as exc:  # a follower is gone: the group cannot go on
            self.mark_broken(f"sending to the followers failed: {exc!r}")
            raise TPGroupBroken(f"the {self.size} TP decode ranks are out of step ({self.broken})") from exc

    def mark_broken(self, why: str) -> None:
        if not self.broken:
            self.broken = why[:500]
            log.error("tp_decode_group_out_of_step", size=self.size, error=self.broken)

    @contextmanager
    def _computing(self, op: tuple, *tensors: torch.Tensor):
        """Send ``op`` (a step the followers join), then let rank 0 compute; an error while it does
        breaks the group (the followers may wait in a reduction rank 0 will not reach)."""
        self._ops.append(op)
        self._flush(*tensors)
        try:
            yield
        except BaseException as exc:
            self.mark_broken(f"rank 0 failed inside a step: {exc!r}")
            raise

    # ---- state changes: applied here first, then queued -----------------------------------------

    def reserve(self, request_id: str, num_tokens: int) -> DecodeSeq:
        self.check()
        seq = super().reserve(request_id, num_tokens)
        self._ops.append(("reserve", request_id, num_tokens, list(seq.block_ids)))
        if not self.send_rows:  # the ranks pull their own rows: every one must know the request first
            self.sync()
        return seq

    def bind(self, request_id: str) -> None:
        self.check()
        super().bind(request_id)
        self._ops.append(("bind", request_id))

    def write_prompt_layer(
        self, request_id: str, layer: int, kv: torch.Tensor, index_k: torch.Tensor, start: int = 0
    ) -> None:
        self.check()
        super().write_prompt_layer(request_id, layer, kv, index_k, start=start)
        if self.send_rows:
            self._ops.append(("rows", request_id, layer, start, tensor_spec(kv), tensor_spec(index_k)))
            self._flush(kv, index_k)

    def set_prompt_done(self, request_id: str, num_tokens: int) -> None:
        super().set_prompt_done(request_id, num_tokens)
        self._ops.append(("done", request_id, num_tokens))

    def finish(self, request_id: str) -> None:
        """Drop the request on every follower, then free it here (its pool blocks with it): at once,
        not with the next step (an idle decode's followers must not hold what rank 0 freed), and only
        once every follower has applied it (module doc). Never raises over the caller's cleanup: a
        follower that cannot be told has broken the group."""
        if not self.broken and request_id in self.seqs:
            self._ops.append(("finish", request_id))
            try:
                self.sync()
            except TPGroupBroken:
                pass  # marked broken, logged
        super().finish(request_id)

    def _grow_told(self, seq: DecodeSeq, num_tokens: int) -> None:
        """Blocks for ``num_tokens`` tokens of ``seq``; the new ones are queued for the followers."""
        before = len(seq.block_ids)
        self._grow(seq, num_tokens)
        if len(seq.block_ids) > before:
            self._ops.append(("grow", seq.request_id, num_tokens, seq.block_ids[before:]))

    def commit(self, request_id: str, num_tokens: int) -> None:
        super().commit(request_id, num_tokens)
        self._ops.append(("commit", request_id, num_tokens))

    # ---- steps: sent first, the followers compute alongside -------------------------------------

    def forward(self, request_ids: list[str], tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        self.check()
        seqs = [self.seqs[r] for r in request_ids]  # refusals a follower would raise too: never sent
        if len(tokens) != len(seqs) or any(not t for t in tokens):
            raise ValueError("tokens must give at least one token for every request")
        for seq, toks in zip(seqs, tokens):
            if seq.num_tokens + len(toks) > self.max_model_len:
                raise ValueError(f"request {seq.request_id!r} would exceed max_model_len={self.max_model_len}")
        tokens = [[int(t) for t in toks] for toks in tokens]
        for seq, toks in zip(seqs, tokens):  # the step's new blocks, told before the step
            self._grow_told(seq, seq.num_tokens + len(toks))
        with self._computing(("forward", list(request_ids), tokens)):
            out = super().forward(request_ids, tokens)
        self.steps_sent += 1
        return out

    def mtp_forward(
        self, request_ids: list[str], positions: list[list[int]], h_prev: torch.Tensor, next_tokens: list[list[int]]
    ) -> torch.Tensor:
        self.check()
        for r in request_ids:
            self.seqs[r]  # an unknown request raises KeyError here, before anything is sent
        op = (
            "mtp",
            list(request_ids),
            [list(map(int, p)) for p in positions],
            [list(map(int, t)) for t in next_tokens],
            tensor_spec(h_prev),
        )
        with self._computing(op, h_prev):
            return super().mtp_forward(request_ids, positions, h_prev, next_tokens)

    def sync(self) -> None:
        """Every follower has applied every change made so far."""
        self._ops.append(("sync",))
        self._flush()
        try:
            self.channel.sync()
        except Exception as exc:
            self.mark_broken(f"a follower did not reach the barrier: {exc!r}")
            raise TPGroupBroken(f"the {self.size} TP decode ranks are out of step ({self.broken})") from exc

    def poll(self) -> list:
        """Every follower's ``status()`` (``follow_decode``), in rank order."""
        self._ops.append(("poll",))
        self._flush()
        try:
            statuses = self.channel.gather(None)
        except Exception as exc:
            self.mark_broken(f"a follower did not answer a poll: {exc!r}")
            raise TPGroupBroken(f"the {self.size} TP decode ranks are out of step ({self.broken})") from exc
        assert statuses is not None  # this is rank 0: it gets the followers' answers
        return statuses

    def close_followers(self) -> None:
        """The followers return from ``follow_decode``; returns once they all have the message (so
        rank 0 may tear the process group down). Nothing to do for a broken group."""
        if self.broken:
            return
        self._ops.append(("close",))
        self._flush()
        self.channel.sync()


def follow_decode(
    decoder: SparseDecoder,
    channel: Channel,
    lock: AbstractContextManager[Any] | None = None,
    *,
    on_op: Callable[[tuple], None] | None = None,
    status: Callable[[], Any] | None = None,
) -> int:
    """A follower rank's loop over its own ``decoder`` (its shard of the model, over the
    ``AttachedPool`` of rank 0's pool): apply rank 0's ops in order until it closes; returns the
    number of steps run. ``lock`` is held while an op is applied, and ``on_op(op)`` is called after
    it (a service's own pull threads install rows under the lock); ``status()`` is this rank's
    answer to a poll."""
    pool = decoder.pool
    if not isinstance(pool, AttachedPool):
        raise TypeError(f"a TP decode follower's pool must be the AttachedPool of rank 0's, got {type(pool).__name__}")
    guard = lock if lock is not None else nullcontext()
    steps = 0
    while True:
        msg = channel.recv()
        if not (isinstance(msg, tuple) and msg and msg[0] == "ops"):
            raise RuntimeError(f"TP decode follower: expected ops from rank 0, got {msg!r:.200}")
        for op in msg[1]:
            kind = op[0]
            if kind == "close":
                channel.sync()
                return steps
            if kind == "sync":
                channel.sync()
                continue
            if kind == "poll":
                channel.gather(status() if status is not None else None)
                continue
            with guard:
                steps += _apply(decoder, pool, channel, op)
                if on_op is not None:
                    on_op(op)


def _apply(decoder: SparseDecoder, pool: AttachedPool, channel: Channel, op: tuple) -> int:
    """Apply one of rank 0's ops to this rank's decoder; returns the steps it ran (1 for a forward)."""
    kind = op[0]
    if kind == "reserve":
        pool.give(op[3])
        decoder.reserve(op[1], op[2])
    elif kind == "grow":
        pool.give(op[3])
        decoder.grow(op[1], op[2])
    elif kind == "bind":
        decoder.bind(op[1])
    elif kind == "done":
        decoder.set_prompt_done(op[1], op[2])
    elif kind == "commit":
        decoder.commit(op[1], op[2])
    elif kind == "finish":
        decoder.finish(op[1])
    elif kind == "rows":
        _, rid, layer, start, (kv_shape, kv_dtype), (idx_shape, idx_dtype) = op
        kv = channel.recv_tensor(kv_shape, tensor_dtype(kv_dtype))
        idx = channel.recv_tensor(idx_shape, tensor_dtype(idx_dtype))
        decoder.write_prompt_layer(rid, layer, kv, idx, start=start)
    elif kind == "forward":
        decoder.forward(op[1], op[2])
        return 1
    elif kind == "mtp":
        _, ids, positions, next_tokens, (h_shape, h_dtype) = op
        h_prev = channel.recv_tensor(h_shape, tensor_dtype(h_dtype)).to(decoder.model.device)
        decoder.mtp_forward(ids, positions, h_prev, next_tokens)
    else:
        raise RuntimeError(f"TP decode follower: unknown op {kind!r} from rank 0")
    return 0
