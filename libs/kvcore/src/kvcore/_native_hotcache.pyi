"""Types of the native hot top-k cache extension (built from native/hotcache.cpp by setup.py).

``resolve`` takes the top-k tensor and returns its outputs (created natively); ``resident``'s
pointers are ``data_ptr()`` integers of CPU tensors that ``kvcore.hotcache.cache`` has validated; a
request is an integer handle from ``Cache.alloc``.
"""

from collections.abc import Sequence

import torch

MAX_TOKEN: int

def max_threads() -> int: ...

class Cache:
    def __init__(self, capacity: int, num_layers: int, policy: int) -> None: ...
    def alloc(self) -> int: ...
    def free(self, handle: int) -> None: ...
    def residency(self, handle: int, layer: int) -> list[tuple[int, int]]: ...
    def resident(self, layer: int, handles: Sequence[int], tokens_ptr: int, n: int, out_ptr: int) -> None: ...
    def resolve(
        self, layer: int, handles: Sequence[int], topk: torch.Tensor, stable_lens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]: ...
