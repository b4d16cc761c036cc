"""A top-k trace: the positions a sparse-attention indexer selected, step by step, per stream.

A stream is one (request, layer, head group) of decode: at step ``t`` its context holds
``context0 + t`` tokens (one new token per step) and the indexer selected ``k`` of them. Traces
are benchmark data: the hot cache, its policies and Belady's optimum are measured on them, and
the decode engine can run with its indexer's choice replaced by one.

``Trace.topk`` is ``[streams, steps, k]`` int32, each entry a position in
``[0, context0[s] + t)`` or ``-1`` (padding: a stream whose context held fewer than ``k``
tokens); positions within one step are distinct. Saved with ``torch.save`` as a plain dict of
tensors and JSON-able metadata (``save``/``load``), so a cached trace is read back bit-for-bit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = 1


@dataclass(frozen=True)
class Trace:
    """Top-k selections of ``streams`` streams over ``steps`` decode steps (module docstring)."""

    name: str
    topk: torch.Tensor  # [streams, steps, k] int32, -1 = padding
    context0: torch.Tensor  # [streams] int64: context length at step 0
    layers: torch.Tensor  # [streams] int32: the stream's layer
    requests: torch.Tensor  # [streams] int32: the stream's request
    groups: torch.Tensor  # [streams] int32: the stream's KV-head group (0 when the model has one)
    meta: dict = field(default_factory=dict)  # how it was made: generator parameters or recording

    def __post_init__(self) -> None:
        t = self.topk
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 3:
            raise ValueError(f"Trace {self.name!r}: topk must be an int32 [streams, steps, k] tensor")
        n = t.shape[0]
        for name in ("context0", "layers", "requests", "groups"):
            v = getattr(self, name)
            if not isinstance(v, torch.Tensor) or v.shape != (n,):
                raise ValueError(f"Trace {self.name!r}: {name} must be a [{n}] tensor, one entry per stream")
        if n and t.numel():
            limit = self.context0.view(-1, 1, 1) + torch.arange(t.shape[1]).view(1, -1, 1)  # [S, T, 1]
            if bool((t < -1).any()) or bool((t >= limit).any()):
                raise ValueError(f"Trace {self.name!r}: a position is outside [0, context0 + step) and not -1")

    @property
    def streams(self) -> int:
        return self.topk.shape[0]

    @property
    def steps(self) -> int:
        return self.topk.shape[1]

    @property
    def k(self) -> int:
        return self.topk.shape[2]

    @property
    def num_layers(self) -> int:
        return int(self.layers.max()) + 1 if self.streams else 0

    def context(self, step: int) -> torch.Tensor:
        """[streams] context length at ``step``."""
        return self.context0 + step

    def select(self, mask: torch.Tensor, name: str | None = None) -> Trace:
        """The streams where ``mask`` [streams] is true."""
        return Trace(
            name or self.name,
            self.topk[mask].contiguous(),
            self.context0[mask],
            self.layers[mask],
            self.requests[mask],
            self.groups[mask],
            dict(self.meta),
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Writes the trace atomically (a temporary file renamed into place)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(
            {
                "format": FORMAT,
                "name": self.name,
                "topk": self.topk,
                "context0": self.context0,
                "layers": self.layers,
                "requests": self.requests,
                "groups": self.groups,
                "meta": json.dumps(self.meta),
            },
            tmp,
        )
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        d = torch.load(Path(path), weights_only=True)
        if d.get("format") != FORMAT:
            raise ValueError(f"{path}: trace format {d.get('format')!r}, this version reads {FORMAT}")
        return cls(d["name"], d["topk"], d["context0"], d["layers"], d["requests"], d["groups"], json.loads(d["meta"]))


def traces_dir() -> Path:
    """Where generated traces are cached: ``$KVOFFLOAD_HOME/traces`` (default ``~/.cache/kvoffload``)."""
    home = os.environ.get("KVOFFLOAD_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "kvoffload") / "traces"
