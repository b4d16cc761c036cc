"""How rank 0 of a tensor-parallel group talks to its followers: an ordered broadcast channel.

Both TP engines (``tp_prefill``, ``tp_decode``) are led by rank 0: it decides, and the followers do
the same work in the same order, because every layer ends in reductions over all ranks. ``Channel``
is what carries rank 0's decisions; ``DistChannel`` is the one over ``torch.distributed`` (gloo on
CPU) that rank processes use. ``TPGroupBroken`` is what either engine raises once its followers are
out of step: from then on the group can only be restarted.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Channel", "DistChannel", "TPGroupBroken", "tensor_dtype", "tensor_spec"]


class TPGroupBroken(RuntimeError):
    """The followers are no longer in step with rank 0; the group must be restarted."""


class Channel(Protocol):
    """Rank 0 -> every follower, in order (a broadcast)."""

    def send(self, obj: Any) -> None: ...
    def recv(self) -> Any: ...
    def send_tensor(self, t: torch.Tensor) -> None: ...
    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def sync(self) -> None:
        """Every rank has got here (a broadcast may return on rank 0 before the others received it)."""
        ...

    def gather(self, obj: Any) -> list | None:
        """Every rank sends ``obj``; rank 0 gets the followers' ones, in rank order (others: None)."""
        ...


class DistChannel:
    """Broadcasts from rank 0 over the default ``torch.distributed`` group (gloo on CPU). Tensors
    travel as bytes, so any dtype does (bfloat16, fp8 indexer keys)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist

    def send(self, obj: Any) -> None:
        self._dist.broadcast_object_list([obj], src=0)

    def recv(self) -> Any:
        box = [None]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]

    def send_tensor(self, t: torch.Tensor) -> None:
        self._dist.broadcast(t.contiguous().view(torch.uint8), src=0)

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self._dist.broadcast(out.view(torch.uint8), src=0)
        return out

    def sync(self) -> None:
        self._dist.barrier()

    def gather(self, obj: Any) -> list | None:
        if self._dist.get_rank() != 0:
            self._dist.gather_object(obj, None, dst=0)
            return None
        out = [None] * self._dist.get_world_size()
        self._dist.gather_object(obj, out, dst=0)
        return out[1:]


def tensor_spec(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    """What a follower needs to receive ``t``: (shape, dtype name)."""
    return tuple(t.shape), str(t.dtype)


def tensor_dtype(name: str) -> torch.dtype:
    """A dtype's name as ``str(dtype)`` writes it (``"torch.bfloat16"``) -> the dtype."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype
