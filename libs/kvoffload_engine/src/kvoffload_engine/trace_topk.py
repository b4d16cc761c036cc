"""Decode on a top-k trace: a ``SparseDecoder.topk_override`` that replays ``kvcore.traces.Trace``.

A trace stream is one (request, head group, layer); the engine has requests and cache layers. The
mapping:

- **requests**: each engine request id is given one (request, group) pair of the trace — by
  default the i-th id the i-th pair in ascending (request, group) order, or explicitly;
- **layers**: cache layer ``i`` (MTP layers included) replays trace layer ``layers[i]`` (default
  ``i``), so a model with ``L`` cache layers needs a trace with layers ``0..L-1``;
- **steps**: at step ``t`` a stream's context holds ``context0 + t`` tokens. A decode step that
  processes position ``p`` has a context of ``p + 1`` tokens (the new token attends to itself), so
  position ``p`` replays step ``t = p + 1 - context0``. A request whose prompt holds
  ``context0 - 1`` tokens (``prompt_len``) replays step 0 on its first decode step (the one after
  prefill, at position ``context0 - 1``), step 1 on the next, and so on.

Entries are trace positions as recorded (ascending for the synthetic generator, -1 padding).
Mismatches raise ValueError naming what is short: fewer (request, group) pairs than requests,
fewer layers than cache layers, or a position before step 0 or past the trace's last step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvcore.traces import Trace


class TraceTopK:
    """``SparseDecoder.topk_override`` replaying ``trace`` (module docstring).

    ``requests``: the engine's request ids in order (the i-th gets the i-th (request, group) pair),
    or a mapping request id -> (trace request, group). ``num_layers``: the model's cache layers;
    ``layers``: the trace layer of each cache layer (default ``range(num_layers)``).
    """

    def __init__(
        self,
        trace: Trace,
        requests: Sequence[str] | Mapping[str, tuple[int, int]],
        *,
        num_layers: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.trace = trace
        keys = list(zip(trace.requests.tolist(), trace.groups.tolist(), trace.layers.tolist()))
        stream_of: dict[tuple[int, int, int], int] = {}
        for s, key in enumerate(keys):
            if key in stream_of:
                raise ValueError(
                    f"trace {trace.name!r}: streams {stream_of[key]} and {s} are both request "
                    f"{key[0]}, group {key[1]}, layer {key[2]}"
                )
            stream_of[key] = s
        pairs = sorted({(r, g) for r, g, _ in keys})
        if isinstance(requests, Mapping):
            pair_of = {rid: (int(p[0]), int(p[1])) for rid, p in requests.items()}
            unknown = [p for p in pair_of.values() if p not in set(pairs)]
            if unknown:
                raise ValueError(f"trace {trace.name!r} has no (request, group) pair {unknown[0]}; it has {pairs}")
        else:
            ids = list(requests)
            if len(set(ids)) != len(ids):
                raise ValueError("request ids must be distinct")
            if len(ids) > len(pairs):
                raise ValueError(
                    f"trace {trace.name!r} has {len(pairs)} (request, group) stream pairs; the engine "
                    f"needs one per request: {len(ids)}"
                )
            pair_of = dict(zip(ids, pairs))
        if num_layers < 1:
            raise ValueError(f"num_layers = {num_layers} must be >= 1")
        trace_layers = sorted(set(trace.layers.tolist()))
        layer_map = list(range(num_layers)) if layers is None else [int(x) for x in layers]
        if len(layer_map) != num_layers:
            raise ValueError(f"layers gives {len(layer_map)} trace layers for {num_layers} cache layers")
        missing = [x for x in layer_map if x not in trace_layers]
        if missing:
            raise ValueError(
                f"trace {trace.name!r} has {len(trace_layers)} layers ({_span(trace_layers)}); the "
                f"model's {num_layers} cache layers need trace layer(s) {_span(sorted(set(missing)))}"
            )
        self.request_ids = list(pair_of)
        self.pairs = [pair_of[r] for r in self.request_ids]
        self._row = {rid: n for n, rid in enumerate(self.request_ids)}
        table = torch.empty(len(self.request_ids), num_layers, dtype=torch.long)  # [R, L] stream of each
        for n, (req, grp) in enumerate(self.pairs):
            for i, tl in enumerate(layer_map):
                stream = stream_of.get((req, grp, tl))
                if stream is None:
                    raise ValueError(f"trace {trace.name!r} has no stream for request {req}, group {grp}, layer {tl}")
                table[n, i] = stream
        self._stream = table
        self.num_layers = num_layers

    def prompt_len(self, request_id: str) -> int:
        """The prompt length that lines ``request_id`` up with step 0: ``context0 - 1`` of its streams."""
        c0 = self.trace.context0[self._stream[self._row[request_id]]]  # [L]
        if bool((c0 != c0[0]).any()):
            raise ValueError(
                f"request {request_id!r}: its trace streams start at different contexts "
                f"{sorted(set(c0.tolist()))}; one prompt cannot line up with all of them"
            )
        return int(c0[0]) - 1

    def streams(self) -> torch.Tensor:
        """[R, L] the trace stream each (request, cache layer) replays."""
        return self._stream.clone()

    def __call__(self, layer: int, request_ids: list[str], positions: torch.Tensor) -> torch.Tensor:
        """[N] request ids and positions -> the trace's top-k [N, k] int64 for cache layer ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(
                f"cache layer {layer} is outside the {self.num_layers} layers mapped to trace {self.trace.name!r}"
            )
        try:
            rows = torch.tensor([self._row[r] for r in request_ids], dtype=torch.long)  # [N]
        except KeyError as e:
            raise ValueError(
                f"request {e.args[0]!r} has no stream pair of trace {self.trace.name!r} (mapped: {self.request_ids})"
            ) from None
        streams = self._stream[rows, layer]  # [N]
        steps = positions.to(torch.long) + 1 - self.trace.context0[streams]  # [N]
        bad = (steps < 0) | (steps >= self.trace.steps)
        if bool(bad.any()):
            n = int(bad.nonzero()[0, 0])
            c0 = int(self.trace.context0[streams[n]])
            raise ValueError(
                f"request {request_ids[n]!r} at position {int(positions[n])} (context {int(positions[n]) + 1}) needs "
                f"step {int(steps[n])} of trace {self.trace.name!r}, which has steps 0..{self.trace.steps - 1} "
                f"(contexts {c0}..{c0 + self.trace.steps - 1}): "
                + ("the prompt is shorter than context0 - 1" if int(steps[n]) < 0 else "the trace has too few steps")
            )
        return self.trace.topk[streams, steps].to(torch.long)  # [N, k]


def _span(xs: list[int]) -> str:
    if not xs:
        return "none"
    return f"{xs[0]}..{xs[-1]}" if xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 1 else ", ".join(map(str, xs))
