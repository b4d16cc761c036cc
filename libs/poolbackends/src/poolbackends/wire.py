"""How the MetaStore's errors, geometries and records travel over gRPC, in both directions.

Errors: each type has one status code (metastore.proto lists them). The servicer sends
``status_of(exc)`` with ``message_of(exc)`` and ``trailing_metadata(exc)`` (type name, offending
key, ``PoolFullError`` numbers); the client rebuilds the exact type with ``error_from_rpc`` — only
types named in ``STATUS``, checked against the code, never anything evaluated from network data.
A call that could not reach the MetaStore or timed out is ``MetaStoreUnavailable``.
"""

from __future__ import annotations

import grpc

from kvcore.pool.errors import LeaseExpired, ObjectExists, ObjectLeased, ObjectNotFound, PoolError, PoolFullError
from kvcore.pool.geometry import PoolGeometry
from kvoffload_proto.v1 import metastore_pb2 as pb
from poolbackends.errors import (
    MetaStoreUnavailable,
    NoPoolRegistered,
    PoolConflict,
    PoolNotRegistered,
    WorldSizeExceeded,
)
from poolbackends.records import Location, PoolRecord

ERROR_MD = "kvoffload-error"  # exception class name
KEY_MD = "kvoffload-key-bin"  # offending key, raw bytes
FULL_MD = {  # PoolFullError attribute -> trailing metadata key on RESOURCE_EXHAUSTED
    "needed": "kvoffload-needed-blocks",
    "free": "kvoffload-free-blocks",
    "evictable": "kvoffload-evictable-blocks",
    "num_blocks": "kvoffload-num-blocks",
}

STATUS: dict[type[BaseException], grpc.StatusCode] = {
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
    ObjectNotFound: grpc.StatusCode.NOT_FOUND,
    LeaseExpired: grpc.StatusCode.NOT_FOUND,
    PoolNotRegistered: grpc.StatusCode.NOT_FOUND,
    ObjectExists: grpc.StatusCode.ALREADY_EXISTS,
    PoolConflict: grpc.StatusCode.ALREADY_EXISTS,
    PoolFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ObjectLeased: grpc.StatusCode.FAILED_PRECONDITION,
    WorldSizeExceeded: grpc.StatusCode.FAILED_PRECONDITION,
    NoPoolRegistered: grpc.StatusCode.FAILED_PRECONDITION,
}
# The types a client rebuilds by the ERROR_MD name (PoolFullError and ValueError come from the code alone).
BY_NAME: dict[str, type[PoolError]] = {
    t.__name__: t for t in STATUS if issubclass(t, PoolError) and t is not PoolFullError
}
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


# ---- errors: servicer side ---------------------------------------------------------------------


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status code of a known error type (most specific first), else None."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return None


def trailing_metadata(exc: BaseException) -> tuple[tuple[str, str | bytes], ...]:
    """Metadata that lets the client rebuild ``exc`` (type name, key, PoolFullError numbers)."""
    md: list[tuple[str, str | bytes]] = [(ERROR_MD, type(exc).__name__)]
    key = getattr(exc, "key", None)
    if isinstance(key, bytes):
        md.append((KEY_MD, key))
    if isinstance(exc, PoolFullError):
        numbers = {
            "needed": exc.needed,
            "free": exc.free,
            "evictable": exc.evictable,
            "num_blocks": getattr(exc, "num_blocks", 0),
        }
        md.extend((mdkey, str(numbers[name])) for name, mdkey in FULL_MD.items())
    return tuple(md)


def message_of(exc: BaseException) -> str:
    """The status message: the error text, naming the key when the text does not already."""
    text = str(exc)
    key = getattr(exc, "key", None)
    if isinstance(key, bytes) and repr(key) not in text:
        text = f"{text} (key {key!r})"
    return text


# ---- errors: client side -----------------------------------------------------------------------


def error_from_rpc(e: grpc.RpcError, method: str) -> Exception:
    """The typed exception of a failed call; never evaluates network data."""
    code, details = e.code(), e.details() or ""
    # grpc-stubs types a metadatum as an object with .key and .value; grpc hands (key, value) named tuples
    md: dict[str, str | bytes] = dict(e.trailing_metadata() or ())  # type: ignore[arg-type]
    key = md.get(KEY_MD)
    key = key if isinstance(key, bytes) else None
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        n = {name: int(md.get(mdkey, 0)) for name, mdkey in FULL_MD.items()}
        exc = PoolFullError(
            key=key, needed=n["needed"], free=n["free"], evictable=n["evictable"], num_blocks=n["num_blocks"]
        )
        exc.args = (details,)
        return exc
    cls = BY_NAME.get(str(md.get(ERROR_MD, "")))
    if cls is not None and STATUS[cls] == code:
        return cls(details, key=key)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(details)
    if code in _UNREACHABLE:
        return MetaStoreUnavailable(f"MetaStore {method}: {code.name}: {details}", code=code)
    return PoolError(f"MetaStore {method}: {code.name}: {details}", key=key)


# ---- geometry and records ----------------------------------------------------------------------


def geometry_from_pb(g: pb.PoolGeometry) -> PoolGeometry:
    return PoolGeometry(
        g.block_size,
        tuple(g.plane_row_bytes),
        g.num_blocks,
        tuple((label.layer, label.kind) for label in g.plane_labels),
    )


def geometry_to_pb(g: PoolGeometry) -> pb.PoolGeometry:
    return pb.PoolGeometry(
        block_size=g.block_size,
        plane_row_bytes=g.plane_row_bytes,
        num_blocks=g.num_blocks,
        plane_labels=[pb.PlaneLabel(layer=layer, kind=kind) for layer, kind in g.plane_labels],
    )


def pool_from_pb(p: pb.PoolInfo) -> PoolRecord:
    return PoolRecord(p.pool_id, p.segment_name, p.host, geometry_from_pb(p.geometry))


def pool_to_pb(r: PoolRecord) -> pb.PoolInfo:
    return pb.PoolInfo(
        pool_id=r.pool_id,
        segment_name=r.segment_name,
        host=r.host,
        geometry=geometry_to_pb(r.geometry),
        block_bytes=r.block_bytes,
    )


def location_from_pb(loc: pb.ObjectLocation) -> Location:
    return Location(loc.key, loc.pool_id, loc.block_id, loc.size_bytes, tuple(loc.written_planes), loc.complete)


def location_to_pb(loc: Location) -> pb.ObjectLocation:
    return pb.ObjectLocation(
        key=loc.key,
        pool_id=loc.pool_id,
        block_id=loc.block_id,
        size_bytes=loc.size_bytes,
        complete=loc.complete,
        written_planes=loc.written_planes,
    )
