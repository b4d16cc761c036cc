"""The host pool's shared memory: ``SharedSegment``, the named POSIX shared memory that holds a
pool's blocks plane by plane (its shape is a ``kvcore.pool.geometry.PoolGeometry``), and the
lifecycle of segment files (``host_id``, unlinking owned segments at exit, sweeping stale ones).

A segment knows only bytes and offsets; the object index, leases and eviction belong to the pool
(``kvcore.pool.host_pool``). One process creates a segment; others attach it by name.
"""

from __future__ import annotations

import atexit
import json
import mmap
import os
import re
import struct
from typing import TYPE_CHECKING

from kvcore.pool.geometry import PoolGeometry

if TYPE_CHECKING:  # torch is imported where a segment is mapped: the metastore checks names without it
    import torch

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "kvoffload-"
SEGMENT_MAGIC = b"KVOFFPL\x00"
SEGMENT_VERSION = 1
_HEADER = struct.Struct("<8sIIQ")  # magic, version, json_len, data_offset
_PAGE = 4096
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def host_id() -> str:
    """This host's identity for shared memory: processes with the same value (hostname and kernel
    boot) can attach each other's segments; a container or another machine gets another value.
    ``KVOFFLOAD_HOST_ID`` overrides it (e.g. to force the cross-host data path)."""
    import socket

    if os.environ.get("KVOFFLOAD_HOST_ID"):
        return os.environ["KVOFFLOAD_HOST_ID"]

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


_OWNED_PATHS: dict[str, int] = {}  # segment path -> pid of the process that created it


@atexit.register
def unlink_owned_segments() -> None:
    """A process that exits (normally, or on an unhandled exception) takes its segments with it;
    a forked child that exits does not take its parent's."""
    me = os.getpid()
    for path in [p for p, pid in _OWNED_PATHS.items() if pid == me]:
        try:
            os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_stale_segments() -> list[str]:
    """Unlink every kvoffload segment whose creator process is gone (killed with -9, crashed before
    its exit hook): its memory (reserved in full at create) would otherwise stay taken until reboot.
    Segments of live processes, and files without a readable header, are left alone. Returns the
    removed paths. Services call this at start, before creating their own segments."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(SEGMENT_PREFIX):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                magic, version, meta_len, _ = _HEADER.unpack(head)
                if magic != SEGMENT_MAGIC or meta_len > 1 << 20:
                    continue
                pid = json.loads(f.read(meta_len)).get("owner_pid")
        except (OSError, ValueError, struct.error):
            continue
        if isinstance(pid, int) and pid > 0 and not _alive(pid):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


class SharedSegment:
    """Named shared memory ``/dev/shm/kvoffload-<name>``: header, then plane-major data.

    Header: magic, version, JSON length, data offset, then JSON (geometry, plane offsets relative
    to the data offset). Plane p is a contiguous, page-aligned
    ``[num_blocks, block_size, row_bytes_p]`` uint8 region, so a gather over one plane has a
    regular block stride. ``create`` fails if the name exists unless ``replace=True`` (which
    unlinks the stale name first; processes still mapping it keep their old memory). Used as a
    context manager, the creator closes *and unlinks* on exit; an attacher only closes. ``close``
    is safe while plane views are alive: the mapping then lives until the last view is freed.
    """

    def __init__(
        self, name: str, path: str, mm: mmap.mmap, geometry: PoolGeometry, plane_offsets: list[int], owner: bool
    ) -> None:
        import torch  # here, not at the top: the metastore imports this module for its name rules

        self.name = name
        self.path = path
        self.geometry = geometry
        self.plane_offsets = tuple(plane_offsets)
        self.owner = owner
        self._identity: tuple[int, int] | None = None  # (device, inode) of an attached segment's file
        self._owner_pid: int | None = None  # the creator, as an attached segment's header names it
        if owner:
            _OWNED_PATHS[path] = os.getpid()  # unlinked at interpreter exit if the owner never did
        self.size_bytes = len(mm)
        self._mmap: mmap.mmap | None = mm
        self._mv: memoryview | None = memoryview(mm)  # torch views hold this export: see close()
        self._planes: list[torch.Tensor] = [
            torch.frombuffer(self._mv, dtype=torch.uint8, count=geometry.plane_bytes(p), offset=off).view(
                geometry.num_blocks, geometry.block_size, geometry.plane_row_bytes[p]
            )
            for p, off in enumerate(plane_offsets)
        ]

    @staticmethod
    def path_for(name: str) -> str:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"segment name must match {_NAME_RE.pattern} (no slashes), got {name!r}")
        return os.path.join(SHM_DIR, SEGMENT_PREFIX + name)

    @classmethod
    def create(cls, name: str, geometry: PoolGeometry, *, replace: bool = False) -> SharedSegment:
        if not isinstance(geometry, PoolGeometry):
            raise ValueError(f"geometry must be a PoolGeometry, got {type(geometry).__name__}")
        path = cls.path_for(name)
        if not os.path.isdir(SHM_DIR):
            raise OSError(f"{SHM_DIR} does not exist: the embedded host pool needs POSIX shared memory")
        rel, off = [], 0  # plane offsets relative to the data start, page-aligned
        for p in range(geometry.num_planes):
            rel.append(off)
            off = _round_up(off + geometry.plane_bytes(p), _PAGE)
        meta = json.dumps({"geometry": geometry.to_dict(), "plane_offsets": rel, "owner_pid": os.getpid()}).encode()
        data_offset = _round_up(_HEADER.size + len(meta), _PAGE)
        size = data_offset + off
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            if not replace:
                raise FileExistsError(
                    f"shared segment {path} already exists: attach() to share it, or create(..., replace=True) "
                    f"to discard a stale one"
                ) from None
            os.unlink(path)
            fd = os.open(path, flags, 0o600)
        try:
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)  # reserve now: a sparse tmpfs file SIGBUSes when full
                else:  # pragma: no cover
                    os.ftruncate(fd, size)
            except OSError as e:
                st = os.statvfs(SHM_DIR)
                raise OSError(
                    f"cannot reserve {size} bytes for {path} ({e.strerror}); {SHM_DIR} has "
                    f"{st.f_bavail * st.f_frsize} bytes free: enlarge it (docker --shm-size) or shrink the pool"
                ) from None
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        mm[_HEADER.size : _HEADER.size + len(meta)] = meta
        mm[: _HEADER.size] = _HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, len(meta), data_offset)  # magic last
        return cls(name, path, mm, geometry, [data_offset + o for o in rel], owner=True)

    @classmethod
    def attach(cls, name: str) -> SharedSegment:
        path = cls.path_for(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared segment {path}: has the pool owner created it?") from None
        try:
            st = os.fstat(fd)
            size = st.st_size
            if size < _HEADER.size:
                raise ValueError(f"{path} is not a kvoffload pool segment ({size} bytes, no header)")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            magic, version, meta_len, data_offset = _HEADER.unpack(mm[: _HEADER.size])
            if magic != SEGMENT_MAGIC:
                raise ValueError(
                    f"{path} is not a kvoffload pool segment (magic {magic!r}, expected {SEGMENT_MAGIC!r}); "
                    f"if it was just created, its header may not be written yet"
                )
            if version != SEGMENT_VERSION:
                raise ValueError(f"{path} has segment version {version}; this kvcore reads {SEGMENT_VERSION}")
            meta = json.loads(bytes(mm[_HEADER.size : _HEADER.size + meta_len]))
            geometry = PoolGeometry.from_dict(meta["geometry"])
            offsets = [data_offset + int(o) for o in meta["plane_offsets"]]
            if len(offsets) != geometry.num_planes or any(
                o < data_offset or o + geometry.plane_bytes(p) > size for p, o in enumerate(offsets)
            ):
                raise ValueError(f"{path} header does not match its size {size}: {meta}")
        except BaseException:
            mm.close()
            raise
        seg = cls(name, path, mm, geometry, offsets, owner=False)
        seg._identity = (st.st_dev, st.st_ino)
        seg._owner_pid = meta["owner_pid"] if isinstance(meta.get("owner_pid"), int) else None
        return seg

    def gone(self) -> bool:
        """An attached segment whose owner is gone: its name was unlinked or now names another
        segment, or the process that created it no longer runs. Its mapping is then only memory held
        for nothing (the owner's pool or buffers will never be written again)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        if self._identity is not None and (st.st_dev, st.st_ino) != self._identity:
            return True
        return self._owner_pid is not None and not _alive(self._owner_pid)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def plane(self, p: int) -> torch.Tensor:
        """uint8 view ``[num_blocks, block_size, row_bytes_p]`` of plane p (shares the memory)."""
        if self._mmap is None:
            raise ValueError(f"segment {self.path} is closed")
        return self._planes[self.geometry.check_plane(p)]

    def close(self) -> None:
        """Unmap (now, or when the last outstanding plane view is freed). Idempotent."""
        if self._mmap is None:
            return
        mm, self._mmap, self._mv, self._planes = self._mmap, None, None, []
        try:
            mm.close()
        except BufferError:
            pass  # views still alive hold the mapping; it is unmapped when they are freed

    def unlink(self) -> None:
        """Remove the name; existing mappings stay valid. Idempotent (a missing name is ignored)."""
        _OWNED_PATHS.pop(self.path, None)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        return f"SharedSegment({self.path!r}, {self.size_bytes} bytes, owner={self.owner}, closed={self.closed})"
