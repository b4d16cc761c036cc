"""What one hot-cache ``resolve`` returns (``Resolution``) and the largest token index it accepts
(``MAX_TOKEN``): shared by ``kvcore.hotcache.cache`` and its reference path, ``kvcore.hotcache.reference``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOKEN = 2**31 - 2  # largest accepted token index (the native map is indexed by int32 tokens)


@dataclass(frozen=True)
class Resolution:
    """Result of one ``resolve`` call over a batch of rows (one request per row)."""

    slots: torch.Tensor  # [rows, k] int32, -1 for padding
    miss_rows: torch.Tensor  # [M] int32, batch row of each unique miss
    miss_tokens: torch.Tensor  # [M] int64
    miss_slots: torch.Tensor  # [M] int32
    num_hits: int  # unique tokens already resident
    num_misses: int  # unique tokens to load (== M)
