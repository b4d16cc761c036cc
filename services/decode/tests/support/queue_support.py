"""The decode queue tests' shared pieces: ``Sink`` (a request's ``emit``: its tokens, its errors, its
end) and ``push`` (a whole N-token prompt's rows and first token, as a prefill's pull installs them)."""

from __future__ import annotations

import threading

import torch

from kvoffload_decode.loop import DecodeLoop

N = 40  # the prompt length the queue tests push


class Sink:
    """A request's ``emit``: the tokens handed out, the errors, and ``done`` once it ended either way."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.errors: list[object] = []
        self.done = threading.Event()

    def __call__(self, kind, value) -> None:
        if kind == "token":
            self.tokens.append(value)
        elif kind in ("done", "error"):
            if kind == "error":
                self.errors.append(value)
            self.done.set()


def push(lp: DecodeLoop, rid: str, seed: int = 1) -> None:
    """Every layer's rows of an N-token prompt (seeded), then the prefill's first token (7)."""
    c = lp.decoder.model.config
    g = torch.Generator().manual_seed(seed)
    for layer in range(len(lp.decoder.model.cache_layers)):
        lp.write_rows(
            rid, layer, 0, torch.randn(N, c.kv_row_width, generator=g), torch.randn(N, c.index_head_dim, generator=g)
        )
    assert lp.prefill_done(rid, N, 7) == ""
