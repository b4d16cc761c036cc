"""Where each block of a prefilled prompt lives in the host pool, planned chunk by chunk.

Pool objects are written once: a full block under its chained hash key (the prefix cache), a
partial tail block under a request key that names how many tokens it holds. ``PromptBlocks`` is one
request's view of them: the leading blocks already complete in the pool (the prefix-cache hit), and
for each chunk the objects it reads (the prefix before it) and writes (``Chunk``), allocated and
leased with a few pool calls per chunk, never one per block (the pool may be a remote index).
"""

from __future__ import annotations

from kvcore.pool.block_keys import is_request_key, request_block_key
from kvcore.pool.host_pool import HostPoolBackend, ObjectExists
from kvcore.pool.leases import Lease


class Chunk:
    """Block bookkeeping of one chunk [start, end) of a request."""

    def __init__(self, start: int, end: int, block_size: int) -> None:
        self.start, self.end = start, end
        self.first_block = start // block_size
        self.end_block = -(-end // block_size)
        self.first = False  # the request's first computed chunk (after any prefix-cache hit)
        self.load_keys: list[bytes] = []  # objects of blocks [0, ceil(start / block_size))
        self.save_keys: list[bytes] = []  # objects this chunk writes ...
        self.save_blocks: list[int] = []  # ... and their block indices


class PromptBlocks:
    """The pool objects of one request's prompt: ``keys[b]`` is where block b lives (the cached
    prefix at first, then each planned chunk's), ``owned`` the request-scoped ones (removed on
    release), ``allocated`` every object this request allocated, ``leases`` what keeps them readable
    while it runs. The prefix hit is leased at once: ``cached_blocks`` full blocks."""

    def __init__(
        self,
        pool: HostPoolBackend,
        request_id: str,
        hash_keys: list[bytes],
        num_tokens: int,
        block_size: int,
        lease_ttl_ms: int,
    ) -> None:
        self.pool, self.request_id, self.hash_keys = pool, request_id, hash_keys
        self.block_size, self.lease_ttl_ms, self.num_tokens = block_size, lease_ttl_ms, num_tokens
        self.cached_blocks = self._match_prefix(num_tokens)
        self.keys: list[bytes] = hash_keys[: self.cached_blocks]
        lease = pool.lease(self.keys, lease_ttl_ms) if self.keys else None
        self.owned: list[bytes] = []  # request-scoped objects, removed on release
        self.allocated: list[bytes] = []  # every object this request allocated
        self.leases: list[Lease] = [lease] if lease else []

    def _match_prefix(self, num_tokens: int) -> int:
        """Leading full blocks already complete in the pool, leaving at least one token to compute.
        Keeps which blocks were absent for the first chunk's plan (``_absent``)."""
        usable = (num_tokens - 1) // self.block_size
        present = self.pool.exists(self.hash_keys[:usable])
        self._absent = {b for b, ok in enumerate(present) if not ok}
        return next((i for i, ok in enumerate(present) if not ok), len(present))

    def plan_chunk(self, s: int, e: int) -> Chunk:
        """Decide the pool object of every block the chunk [s, e) touches and allocate the new ones.

        On return ``keys`` covers the chunk too. One ``exists`` for the chunk's full blocks (none for
        the first chunk when the prefix match just found all of them absent: a block written since
        meets ``alloc``'s ``ObjectExists`` and is computed into a copy of our own), one lease on
        those someone else already wrote (before the ``alloc`` could evict them), one ``alloc`` for
        the rest, one lease on what this chunk writes.
        """
        bs, hash_keys, keys = self.block_size, self.hash_keys, self.keys
        chunk = Chunk(s, e, bs)
        chunk.load_keys = list(keys[: -(-s // bs)])  # the prefix [0, s), old tail object included
        del keys[chunk.first_block :]  # the old tail object is superseded by this chunk's
        blocks = range(chunk.first_block, chunk.end_block)
        full = range(chunk.first_block, e // bs)  # the chunk's blocks that end inside it
        absent, self._absent = self._absent, set()  # the match's answer is the first chunk's only
        if all(b in absent for b in full):
            written: set[int] = set()
        else:
            written = {b for b, ok in zip(full, self.pool.exists([hash_keys[b] for b in full]), strict=True) if ok}
        if written:
            self.leases.append(self.pool.lease([hash_keys[b] for b in sorted(written)], self.lease_ttl_ms))
        chunk.save_blocks = [b for b in blocks if b not in written]
        chunk.save_keys = self._alloc(
            e,
            [
                hash_keys[b] if b in full else request_block_key(self.request_id, b, version=e)
                for b in chunk.save_blocks
            ],
            chunk.save_blocks,
        )
        self.allocated += chunk.save_keys
        self.owned += [k for k in chunk.save_keys if is_request_key(k)]
        saved = dict(zip(chunk.save_blocks, chunk.save_keys))
        keys += [saved[b] if b in saved else hash_keys[b] for b in blocks]
        if chunk.save_keys:
            self.leases.append(self.pool.lease(chunk.save_keys, self.lease_ttl_ms))  # pinned while we write
        return chunk

    def _alloc(self, version: int, keys: list[bytes], blocks: list[int]) -> list[bytes]:
        """Allocate ``keys`` (of ``blocks``) in one call; a hash key another writer holds meanwhile is
        swapped for a request-scoped copy of ours and the call repeated. Returns the keys allocated."""
        keys = list(keys)
        while keys:
            try:
                self.pool.alloc(keys)
                break
            except ObjectExists as exc:
                if exc.key not in keys or is_request_key(exc.key):
                    raise
                i = keys.index(exc.key)
                keys[i] = request_block_key(self.request_id, blocks[i], version=version)
        return keys

    def release_leases(self) -> None:
        for lease in self.leases:
            lease.release()

    def remove_unwritten(self) -> None:
        """After a failure (the saves settled): remove what this request allocated, but for the
        complete hash blocks it wrote, which stay as prefix cache."""
        allocated, owned = self.allocated, self.owned
        written = [k for k, done in zip(allocated, self.pool.exists(allocated)) if done and k not in owned]
        self.pool.remove([k for k in allocated if k not in written])
