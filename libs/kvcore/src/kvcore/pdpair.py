"""Whether a prefill and a decode deployment work together, and which TP ranks feed which.

``check_pd_pair`` checks two validated settings (TP ratio, the same P→D transfer backend on both
sides). Prefill TP must be >= decode TP and divisible by it: with ``ratio = prefill_tp /
decode_tp``, decode TP rank r pulls from the prefill TP ranks ``[r * ratio, (r + 1) * ratio)``
(``tp_contributors``; ``tp_target`` is the inverse), each sending its ``contributor_share`` of
the rows; ``tp_handshake_problem`` is the check both ends of a layout exchange make.
"""

from __future__ import annotations

from typing import Any

from kvcore.config.decode_settings import DecodeSettings
from kvcore.config.errors import ConfigError, describe_value
from kvcore.config.names import D2H_CONNECTOR
from kvcore.config.node import is_int
from kvcore.config.prefill_settings import PrefillSettings


def check_pd_pair(prefill: PrefillSettings, decode: DecodeSettings) -> None:
    """A prefill and a decode deployment can work together (TP ratio, same P→D transfer backend)."""
    errors: list[str] = []
    problem = tp_pair_problem(prefill.tp, decode.tp)
    if problem:
        errors.append(problem)
    p_backend = prefill.d2h.transfer_backend if prefill.d2h else None
    d_backend = decode.d2h.transfer_backend
    if prefill.d2h is None:
        errors.append(f"prefill kv_connector: no {D2H_CONNECTOR}; both sides need one for the P→D remote D2H pull")
    elif p_backend is None:
        errors.append("prefill kv_connector_extra_config.transfer_backend: not set; must be set on both sides")
    if d_backend is None:
        errors.append("decode kv_connector_extra_config.transfer_backend: not set; must be set on both sides")
    if p_backend is not None and d_backend is not None and p_backend != d_backend:
        errors.append(
            f"transfer_backend: prefill {p_backend!r} != decode {d_backend!r}; "
            "both sides must use the same transfer_backend"
        )
    if errors:
        raise ConfigError(errors)


def _shown(value: Any) -> str:
    return str(value) if is_int(value) else describe_value(value)


def tp_pair_problem(prefill_tp: int, decode_tp: int) -> str:
    """ "" when ``prefill_tp`` prefill ranks can feed ``decode_tp`` decode ranks (prefill TP >= decode
    TP and divisible by it), else why, naming both values."""
    if (
        not (is_int(prefill_tp) and is_int(decode_tp))
        or prefill_tp < 1
        or decode_tp < 1
        or prefill_tp < decode_tp
        or prefill_tp % decode_tp
    ):
        return (
            f"tp: prefill tp {_shown(prefill_tp)}, decode tp {_shown(decode_tp)}; "
            "prefill TP must be >= decode TP and divisible by it"
        )
    return ""


def tp_handshake_problem(prefill_tp_size: int, prefill_tp_rank: int, decode_tp_size: int, decode_tp_rank: int) -> str:
    """ "" when prefill TP rank ``prefill_tp_rank`` (of ``prefill_tp_size``) is a contributor of decode TP
    rank ``decode_tp_rank`` (of ``decode_tp_size``), else why, naming the values of both sides: the
    check both ends of a layout exchange make."""
    problem = tp_pair_problem(prefill_tp_size, decode_tp_size)
    if problem:
        return problem
    if not is_int(prefill_tp_rank) or not 0 <= prefill_tp_rank < prefill_tp_size:
        return (
            f"prefill_tp_rank: {_shown(prefill_tp_rank)} is outside 0..{prefill_tp_size - 1} "
            f"(prefill tp {prefill_tp_size})"
        )
    if not is_int(decode_tp_rank) or not 0 <= decode_tp_rank < decode_tp_size:
        return (
            f"decode_tp_rank: {_shown(decode_tp_rank)} is outside 0..{decode_tp_size - 1} (decode tp {decode_tp_size})"
        )
    target = prefill_tp_rank // (prefill_tp_size // decode_tp_size)
    if target != decode_tp_rank:
        return (
            f"tp rank: prefill tp rank {prefill_tp_rank} of {prefill_tp_size} feeds decode tp rank {target} "
            f"of {decode_tp_size}, not decode tp rank {decode_tp_rank}"
        )
    return ""


def tp_contributors(prefill_tp: int, decode_tp: int, decode_tp_rank: int) -> list[int]:
    """Prefill TP ranks that feed decode TP rank ``decode_tp_rank``.

    With ``ratio = prefill_tp / decode_tp`` (prefill TP >= decode TP and divisible), decode rank r
    pulls from prefill ranks ``[r * ratio, (r + 1) * ratio)``; its part of a request is complete
    only when all of them reported. MLA KV is replicated across TP, so every contributor holds the
    same rows; each sends its share of every layer (``contributor_share``), so no row crosses twice.
    """
    problem = tp_pair_problem(prefill_tp, decode_tp)
    if problem:
        raise ValueError(problem)
    if not 0 <= decode_tp_rank < decode_tp:
        raise ValueError(f"decode_tp_rank {decode_tp_rank} outside 0..{decode_tp - 1}")
    ratio = prefill_tp // decode_tp
    return list(range(decode_tp_rank * ratio, (decode_tp_rank + 1) * ratio))


def contributor_share(start: int, end: int, index: int, count: int) -> tuple[int, int]:
    """The rows of ``[start, end)`` the ``index``-th of ``count`` contributors sends: consecutive,
    as even as the rows allow (the first ones one row shorter); the shares partition the range."""
    if not 0 <= index < count:
        raise ValueError(f"contributor {index} outside 0..{count - 1}")
    if end < start:
        raise ValueError(f"rows [{start}, {end}) are not a range")
    n = end - start
    return start + index * n // count, start + (index + 1) * n // count


def tp_target(prefill_tp: int, decode_tp: int, prefill_tp_rank: int) -> int:
    """The decode TP rank a prefill TP rank sends to (the inverse of ``tp_contributors``)."""
    if not 0 <= prefill_tp_rank < prefill_tp:
        raise ValueError(f"prefill_tp_rank {prefill_tp_rank} outside 0..{prefill_tp - 1}")
    tp_contributors(prefill_tp, decode_tp, 0)  # validates the ratio
    return prefill_tp_rank // (prefill_tp // decode_tp)
