"""Tensor-parallel prefill: rank 0 leads, ranks 1..N-1 follow it layer by layer.

Rank 0 runs the whole ``LayerwisePrefill``: the host pool, the shared layer buffers, the saves, the
announcements to decode endpoints and the first token. Only it touches the pool (as in the
reference: only TP rank 0 saves). Every rank holds its shard of the model (``dsamodel.tp``) and runs
every layer of every chunk, because each layer ends in two reductions over all ranks. A follower
needs no pool: rank 0 sends it, in order over a ``Channel``,

- ``("chunk", request_id, tokens, start, end, final)``: the chunk ``[start, end)`` begins (``tokens``
  is ``prompt[start:end + 1]``: the chunk and, for the MTP layer, the token after it);
- ``("layer", main, indexer)`` before each layer: go on; ``main`` / ``indexer`` are the (shape, dtype)
  of the rows ``[0, start)`` rank 0's slot holds (the prefix and earlier chunks), which follow as
  two tensors (none when ``start`` is 0);
- ``("first", token)`` in a final chunk with an MTP layer: the sampled first token it needs;
- ``("stop", reason)`` instead of any of those: rank 0 gave the request up (its decode went away,
  a load failed); the follower drops the chunk and waits for the next one;
- ``("close",)``: the follower returns (after a barrier with rank 0: a broadcast may return on rank 0
  before the others received it, and the group must not be torn down under them).

The cache rows are the same on every rank (the latent projection and the indexer are replicated),
so a follower computes its chunk's rows itself and attends over the same rows rank 0 does.

**Contributor buffers.** A decode rank pulls a request's rows from its contributor group of prefill
ranks, each sending its share, so that no byte crosses twice and no rank carries every transfer.
For that each follower keeps the rows in layer buffers of its own, a shared-memory segment laid out
as rank 0's (same plan, slots and rows): ``Followers.buffers(plan, num_blocks, names)`` sends
``("buffers", plan, num_blocks, names)`` once, before any chunk, and every follower creates
``names[rank - 1]``; from then on each layer writes its rows ``[0, end)`` into the same slot rank 0
uses. Rank 0 keeps the control: it acquired the slot (its reuse gate waits for every contributor's
reads of the previous occupant) before it sends ``layer``, and a follower writes its rows before
the layer's reductions, which rank 0 leaves only once every rank has joined them. So when rank 0
announces a layer, every follower's copy of it is in place.

A failure of rank 0 while the followers wait for a message is told to them (``stop``). One inside a
layer's computation (after ``layer`` was sent; a bug, out of memory) leaves the followers inside a
reduction that rank 0 will not join: the group is then out of step, rank 0 says so on every later
request (``TPGroupBroken``), and the followers' collectives time out. The service restarts it.
"""

from __future__ import annotations

import structlog
import torch

from dsamodel.model import DSAModel
from kvcore.device import DeviceAllocator
from kvoffload_engine.buffers import LayerBuffers
from kvoffload_engine.chunk_attention import attend
from kvoffload_engine.tp_channel import Channel, TPGroupBroken, tensor_dtype, tensor_spec

log = structlog.get_logger(__name__)

__all__ = ["Followers", "follow"]


class Followers:
    """Rank 0's side of the protocol (module doc). ``LayerwisePrefill`` calls it from its compute
    thread; ``waiting`` is whether the followers wait for a message now (so a ``stop`` reaches them)."""

    def __init__(self, channel: Channel, size: int) -> None:
        self.channel, self.size = channel, size
        self.waiting = True
        self.broken = ""  # why the group is out of step ("" while it is not)

    def check(self) -> None:
        if self.broken:
            raise TPGroupBroken(f"the {self.size} TP ranks are out of step ({self.broken}); restart the prefill")

    def buffers(self, plan, num_blocks: int, segment_names: list[str]) -> None:
        """Every follower creates its contributor buffers (module doc): ``segment_names[rank - 1]``,
        laid out as rank 0's ``LayerBuffers(plan, num_blocks, ...)``; returns once all have."""
        if len(segment_names) != self.size - 1:
            raise ValueError(f"{len(segment_names)} segment names for {self.size - 1} followers")
        self.check()
        self.channel.send(("buffers", plan, num_blocks, list(segment_names)))
        self.channel.sync()

    def chunk(self, request_id: str, tokens: list[int], start: int, end: int, final: bool) -> None:
        self.check()
        self.channel.send(("chunk", request_id, tokens, start, end, final))
        self.waiting = True

    def layer(self, main: torch.Tensor, indexer: torch.Tensor) -> None:
        """Go on with the next layer; ``main`` / ``indexer``: rows ``[0, start)`` of rank 0's slot."""
        self.channel.send(("layer", tensor_spec(main), tensor_spec(indexer)))
        if main.shape[0]:
            self.channel.send_tensor(main.cpu())
            self.channel.send_tensor(indexer.cpu())
        self.waiting = False  # computing: in the layer's reductions

    def layer_done(self) -> None:
        self.waiting = True

    def first(self, token: int) -> None:
        self.channel.send(("first", int(token)))

    def abort(self, exc: BaseException) -> None:
        """Rank 0 gave up the running chunk: tell waiting followers, else mark the group broken."""
        if self.broken:
            return
        if self.waiting:
            try:
                self.channel.send(("stop", repr(exc)[:500]))
            except Exception as send_exc:  # noqa: BLE001 - a follower is gone: never raise over the caller's cleanup
                self.broken = f"telling the followers to stop failed: {send_exc!r}"[:500]
                log.error("tp_group_out_of_step", size=self.size, error=repr(send_exc))
        else:
            self.broken = f"rank 0 failed inside a layer: {exc!r}"[:500]
            log.error("tp_group_out_of_step", size=self.size, error=repr(exc))

    def close(self) -> None:
        """The followers return from ``follow``; returns once they all have the message (so rank 0
        may tear the process group down)."""
        if not self.broken:
            self.channel.send(("close",))
            self.channel.sync()


class _Stopped(Exception):
    pass


def _expect(channel: Channel, *kinds: str) -> tuple:
    msg = channel.recv()
    if msg[0] == "stop":
        raise _Stopped(msg[1])
    if msg[0] not in kinds:
        raise RuntimeError(f"TP follower: expected {' or '.join(kinds)} from rank 0, got {msg[0]!r}")
    return msg


def _layer(
    model: DSAModel,
    channel: Channel,
    layer,
    h: torch.Tensor,
    positions: torch.Tensor,
    start: int,
    buffers: LayerBuffers | None,
):
    _, (main_shape, main_dtype), (idx_shape, idx_dtype) = _expect(channel, "layer")
    main_dtype, idx_dtype = tensor_dtype(main_dtype), tensor_dtype(idx_dtype)
    # rows [0, start) of the layer, sent before the chunk's own: received in that order
    prefix = (channel.recv_tensor(main_shape, main_dtype), channel.recv_tensor(idx_shape, idx_dtype)) if start else None
    proj = layer.project(h, positions)
    main = proj.kv.to(main_dtype)
    idx = model.index_codec.encode(proj.index_k).to(idx_dtype)
    if prefix is not None:
        main, idx = torch.cat((prefix[0], main)), torch.cat((prefix[1], idx))
    if buffers is not None:  # this rank's copy, for the decode ranks it contributes to
        i, end = layer.cache_index, main.shape[0]
        buffers.main(i)[:end] = main
        buffers.indexer(i)[:end] = idx
    return layer.finish(h, attend(model, layer, proj, main, idx, positions))


def follow(model: DSAModel, channel: Channel) -> int:
    """A follower rank's loop: run every chunk rank 0 announces until it closes; returns the number
    of chunks run to the end."""
    done = 0
    buffers: LayerBuffers | None = None
    try:
        while True:
            msg = channel.recv()
            if msg[0] == "close":
                channel.sync()
                return done
            if msg[0] == "buffers":
                _, plan, num_blocks, names = msg
                if buffers is not None:
                    raise RuntimeError("TP follower: rank 0 sent its buffers twice")
                buffers = LayerBuffers(
                    plan, num_blocks, DeviceAllocator(model.device), model.dtype, segment_name=names[model.tp.rank - 1]
                )
                channel.sync()
                continue
            done += _chunk(model, channel, msg, buffers)
    finally:
        if buffers is not None:
            buffers.close()


def _chunk(model: DSAModel, channel: Channel, msg: tuple, buffers: LayerBuffers | None) -> int:
    """Run the chunk ``msg`` announces; 1 when it ran to the end, 0 when rank 0 stopped it."""
    layers, base = model.cache_layers, model.config.num_hidden_layers
    if msg[0] != "chunk":
        raise RuntimeError(f"TP follower: expected chunk or close from rank 0, got {msg[0]!r}")
    _, request_id, tokens, start, end, final = msg
    try:
        with torch.inference_mode():
            ids = torch.tensor(tokens, dtype=torch.long, device=model.device)
            positions = torch.arange(start, end, device=model.device)
            h = model.embed(ids[: end - start])
            for layer in layers[:base]:
                h = _layer(model, channel, layer, h, positions, start, buffers)
            if len(layers) > base:
                nxt = ids[1:]
                if final:  # the token after the prompt is the first token: rank 0 sends it
                    _, first = _expect(channel, "first")
                    nxt = torch.cat((nxt, torch.tensor([first], device=model.device)))
                h_mtp = model.mtp_input(model.final_norm(h), nxt, depth=0)
                _layer(model, channel, layers[base], h_mtp, positions, start, buffers)
    except _Stopped as stop:
        log.info("tp_follower_chunk_stopped", request_id=request_id, reason=str(stop))
        return 0
    return 1
