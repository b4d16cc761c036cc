"""The checks every host pool (and the metastore's index) applies to its callers' arguments: keys,
counts, positive numbers, the objects an index holds for keys. No torch here: the metastore, which
never touches a byte of KV, imports them without it (``kvcore.pool.host_pool`` re-exports them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from kvcore.pool.errors import ObjectNotFound

MAX_KEY_BYTES = 512
T = TypeVar("T")


def check_keys(keys: Sequence[bytes], *, unique: bool) -> list[bytes]:
    """``keys`` as a list of 1..MAX_KEY_BYTES bytes keys (unique if asked), else ValueError."""
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
        raise ValueError(f"keys must be a list of bytes keys, got {type(keys).__name__}")
    keys = list(keys)
    for i, k in enumerate(keys):
        if not isinstance(k, bytes) or not 0 < len(k) <= MAX_KEY_BYTES:
            raise ValueError(f"keys[{i}] must be bytes of length 1..{MAX_KEY_BYTES}, got {k!r:.80}")
    if unique and len(set(keys)) != len(keys):
        dup = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise ValueError(f"keys must be unique in one call; {dup!r} repeats")
    return keys


def check_positive(name: str, value: object) -> None:
    """ValueError naming ``name`` unless ``value`` > 0 (a timeout, an interval)."""
    # any caller's value (object): a non-number fails the comparison itself, with a TypeError
    if not value > 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be > 0, got {value!r}")


def check_count(name: str, value: object) -> None:
    """ValueError naming ``name`` unless ``value`` is an int >= 1 (bool rejected): a size, a TTL."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def objects_of(index: Mapping[bytes, T], keys: Sequence[bytes]) -> list[T]:
    """What ``index`` holds for each key, in order; ``ObjectNotFound`` naming the first key it lacks."""
    out = []
    for k in keys:
        entry = index.get(k)
        if entry is None:
            raise ObjectNotFound(f"no object for key {k!r}", key=k)
        out.append(entry)
    return out
