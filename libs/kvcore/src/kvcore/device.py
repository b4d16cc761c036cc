"""Devices and the counting allocator.

``resolve_device`` picks ``cpu`` (the default), ``cuda`` when available, or ``npu`` when
``torch_npu`` imports and sees a device. Every device tensor kvcore allocates goes through a
``DeviceAllocator``, which counts current and peak bytes per tag; memory claims (offload vs no
offload) are measured with it, and on CUDA cross-checked against ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch

_KINDS = ("auto", "cpu", "cuda", "npu")


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except Exception:  # noqa: BLE001 - torch_npu failing to load, however it fails, means no NPU
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available() and npu.device_count() > 0)


def resolve_device(kind: str = "cpu") -> torch.device:
    """``"cpu"`` | ``"cuda"`` | ``"npu"`` | ``"auto"`` (npu, then cuda, then cpu) -> torch.device.

    Asking for an accelerator that is not there is an error that says so; nothing falls back.
    """
    base = kind.split(":", 1)[0]
    if base not in _KINDS:
        raise ValueError(f"device: got {kind!r}; must be one of {', '.join(_KINDS)} (optionally with ':index')")
    if base == "auto":
        if _npu_available():
            return torch.device("npu")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if base == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {kind!r} requested but torch.cuda.is_available() is False; use 'cpu'")
    if base == "npu" and not _npu_available():
        raise ValueError(f"device: {kind!r} requested but torch_npu is not installed or sees no Ascend NPU; use 'cpu'")
    return torch.device(kind)


@dataclass(frozen=True)
class MemoryStats:
    """Bytes held by tensors of one allocator, now and at the peak, in total and per tag."""

    current_bytes: int
    peak_bytes: int
    current_by_tag: dict[str, int]
    peak_by_tag: dict[str, int]


class DeviceAllocator:
    """Allocates device tensors and counts their bytes until they are garbage-collected.

    ``empty``/``zeros`` return ordinary tensors; the count drops when the tensor (and every view
    of it) is gone. Thread-safe.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device) if not isinstance(device, torch.device) else device
        self._lock = threading.Lock()
        self._current = 0
        self._peak = 0
        self._by_tag: dict[str, int] = defaultdict(int)
        self._peak_by_tag: dict[str, int] = defaultdict(int)

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype, tag: str) -> torch.Tensor:
        """An uninitialized tensor on this device, counted under ``tag``."""
        if any(int(s) < 0 for s in shape):
            raise ValueError(f"allocator: negative dimension in shape {tuple(shape)} for {tag!r}")
        t = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        return self.track(t, tag)

    def zeros(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype, tag: str) -> torch.Tensor:
        t = self.empty(shape, dtype, tag)
        t.zero_()
        return t

    def track(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """Count a tensor allocated elsewhere (e.g. a view of shared memory) until it is collected."""
        if t.device != self.device:
            raise ValueError(f"allocator: tensor on {t.device} tracked by the allocator of {self.device}")
        nbytes = t.numel() * t.element_size()
        with self._lock:
            self._current += nbytes
            self._by_tag[tag] += nbytes
            self._peak = max(self._peak, self._current)
            self._peak_by_tag[tag] = max(self._peak_by_tag[tag], self._by_tag[tag])
        weakref.finalize(t, self._release, nbytes, tag)
        return t

    def _release(self, nbytes: int, tag: str) -> None:
        with self._lock:
            self._current -= nbytes
            self._by_tag[tag] -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._current
            self._peak_by_tag = defaultdict(int, self._by_tag)

    def stats(self) -> MemoryStats:
        with self._lock:
            return MemoryStats(self._current, self._peak, dict(self._by_tag), dict(self._peak_by_tag))
