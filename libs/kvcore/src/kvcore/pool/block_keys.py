"""Stable keys of host-pool objects.

Two namespaces that cannot collide:

* **Block hash keys** (``block_keys``): content-addressed, for full blocks of a prompt, so prefix-cache
  hits work across processes and restarts. ``key_i = blake2b-128(domain, model_id, key_{i-1}, tokens_i)``
  where ``key_{-1}`` is ``parent`` (or empty) and ``tokens_i`` are the block's token ids as
  little-endian int64 bytes. Every field is length-prefixed, so no two different (model id, parent,
  tokens) triples feed the hash the same bytes. Nothing here uses Python's ``hash()``, so keys do not
  depend on ``PYTHONHASHSEED``. Hash keys are exactly ``HASH_KEY_BYTES`` (16) long.
* **Request keys** (``request_block_key``): request-scoped objects (a partial tail block, blocks a
  decode owns while it appends tokens). They start with ``REQUEST_KEY_PREFIX`` and are always longer
  than ``HASH_KEY_BYTES``, so they can never equal a hash key.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Sequence

import torch

HASH_KEY_BYTES = 16
REQUEST_KEY_PREFIX = b"kvoffload/req\x00"
_DOMAIN = b"kvoffload/block/v1"
_PERSON = b"kvoffload-blk"  # blake2b personalization (<= 16 bytes)
_U64 = struct.Struct("<Q")


def _field(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _token_tensor(token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """token ids -> contiguous 1-D int64 CPU tensor; ValueError on anything else."""
    if isinstance(token_ids, torch.Tensor):
        t = token_ids
    else:
        if isinstance(token_ids, (str, bytes, bytearray)):
            raise ValueError(f"token_ids must be a sequence of ints or a 1-D tensor, got {type(token_ids).__name__}")
        if len(token_ids) == 0:
            return torch.empty(0, dtype=torch.int64)
        try:
            t = torch.as_tensor(token_ids)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"token_ids must be non-negative ints that fit in int64: {e}") from None
    if t.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise ValueError(f"token_ids must be integers, got dtype {t.dtype}")
    t = t.detach().to(device="cpu", dtype=torch.int64).contiguous()
    if t.numel() and bool((t < 0).any()):
        bad = int(torch.nonzero(t < 0)[0, 0])
        raise ValueError(f"token_ids must be non-negative; token_ids[{bad}] = {int(t[bad])}")
    return t


def block_keys(
    model_id: str,
    token_ids: Sequence[int] | torch.Tensor,
    block_size: int,
    parent: bytes | None = None,
) -> list[bytes]:
    """One chained hash key per FULL block of ``token_ids`` (a partial tail block gets none).

    ``parent`` continues a chain: ``block_keys(m, a + b, bs)`` equals
    ``block_keys(m, a, bs) + block_keys(m, b, bs, parent=<last key of a>)`` when ``len(a) % bs == 0``.
    """
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty str, got {model_id!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != HASH_KEY_BYTES):
        raise ValueError(
            f"parent must be None or a {HASH_KEY_BYTES}-byte block hash key (from block_keys), got {parent!r}"
        )
    tokens = _token_tensor(token_ids)
    num_full = tokens.numel() // block_size
    data = tokens[: num_full * block_size]
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        data = data.view(torch.uint8).view(-1, 8).flip(1).contiguous().view(torch.int64)
    raw = data.numpy().tobytes() if data.numel() else b""  # one conversion for the whole prompt
    stride = block_size * 8
    prefix = _field(_DOMAIN) + _field(model_id.encode("utf-8"))
    token_len = _U64.pack(stride)
    keys: list[bytes] = []
    prev = parent or b""
    for i in range(num_full):
        h = hashlib.blake2b(digest_size=HASH_KEY_BYTES, person=_PERSON)
        h.update(prefix)
        h.update(_field(prev))
        h.update(token_len)
        h.update(raw[i * stride : (i + 1) * stride])
        prev = h.digest()
        keys.append(prev)
    return keys


def request_block_key(request_id: str, block_index: int, version: int = 0) -> bytes:
    """Key of block ``block_index`` owned by request ``request_id``; never equal to a hash key.

    ``version`` tells write-once versions of the same block apart (a partial tail block is
    written again, under a new version, each time a chunk extends it).
    """
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
    for name, value in (("block_index", block_index), ("version", version)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise ValueError(f"{name} must be an int in [0, 2**63), got {value!r}")
    key = REQUEST_KEY_PREFIX + _field(request_id.encode("utf-8")) + _U64.pack(block_index)
    return key + _U64.pack(version) if version else key


def is_request_key(key: bytes) -> bool:
    """True for keys made by ``request_block_key``."""
    return len(key) > HASH_KEY_BYTES and key.startswith(REQUEST_KEY_PREFIX)
