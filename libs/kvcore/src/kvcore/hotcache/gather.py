"""Gather/scatter of token rows between the host KV pool and device hot buffers (dtype-agnostic).

A token row is ``row_bytes`` bytes (callers pass ``uint8`` views of any KV dtype):

- ``gather_rows``: decode misses -> hot buffers.
  ``dst[dst_index[r], slot] = pool[block_table[r, tok // block_size], tok % block_size]`` for each
  miss ``(r, tok, slot)`` of ``kvcore.hotcache.Resolution`` (``miss_rows``/``miss_tokens``/
  ``miss_slots``).
- ``scatter_rows``: new tokens -> pool. ``pool[s // block_size, s % block_size] = src[i]`` for
  ``s = slot_mapping[i] = block_id * block_size + offset``.
- ``scatter_blocks``: whole blocks -> a pool plane (a host pool's put): ``scatter_rows`` with each
  block as one row. torch's ``index_copy_`` of whole blocks runs at about a seventh of a memcpy on
  this machine's CPUs (32 objects of 1 MiB: 16-22 ms against 2.7 ms), one memcpy per block does not.
- ``write_pages``: whole blocks -> a paged cache's blocks as bytes, at any block stride (a vLLM
  layer, a head slice of each of its blocks): on the CPU ``scatter_rows`` with each block one row and
  the view's stride between rows (torch's ``index_copy_`` moves 8-90 KiB pages at ~2.5 GB/s here, a
  memcpy per block at 25-50); on another device the device's ``index_copy_``.

``native=True`` runs the C++/OpenMP path (one memcpy per row, rows spread over ``max_threads()``
threads with software prefetch, GIL released); ``native=False`` the torch reference
(index_select/index_copy_). Results are identical.

Validation, in this order (ValueError naming the argument, the position and the value; nothing is
copied on error): tensor dtypes, device (CPU), contiguity and shapes (a pool whose blocks are
strided is not supported yet); then every entry, lowest position first: for gather ``miss_rows``
in ``[0, R)``, ``miss_tokens >= 0``, the token's logical block ``< max_blocks``, its pool block id
allocated (``!= -1``) and ``< num_blocks``, ``miss_slots`` in ``[0, capacity)``, the row's
``dst_index`` in ``[0, D)``; for scatter ``slot_mapping`` in ``[0, num_blocks * block_size)``.
Finally no destination row may be written twice (the first repeat is named): the copies run in
parallel, so a repeat would make the result depend on timing.
"""

from __future__ import annotations

import torch

__all__ = ["gather_rows", "scatter_blocks", "scatter_rows", "write_pages", "max_threads", "torch_gather"]


def max_threads() -> int:
    """OpenMP threads the native path uses."""
    from kvcore import _native_gather

    return _native_gather.max_threads()


def use_one_thread_here() -> None:
    """Native gathers and scatters called from this thread run on it alone (no OpenMP team): for
    a background loader, whose work must not spin extra threads against the main thread's."""
    from kvcore import _native_gather

    _native_gather.set_calling_thread_threads(1)


def gather_rows(
    pool: torch.Tensor,
    block_table: torch.Tensor,
    miss_rows: torch.Tensor,
    miss_tokens: torch.Tensor,
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    miss_slots: torch.Tensor,
    *,
    native: bool = True,
) -> None:
    """Copies each missed token row from the host pool into its hot-buffer slot (see module doc)."""
    _check("gather_rows", "pool", pool, torch.uint8, 3, "[num_blocks, block_size, row_bytes]")
    _check("gather_rows", "block_table", block_table, torch.int32, 2, "[R, max_blocks]")
    _check("gather_rows", "miss_rows", miss_rows, torch.int32, 1, "[M]")
    _check("gather_rows", "miss_tokens", miss_tokens, torch.int64, 1, "[M]")
    _check("gather_rows", "dst", dst, torch.uint8, 3, "[D, capacity, row_bytes]")
    _check("gather_rows", "dst_index", dst_index, torch.int32, 1, "[R]")
    _check("gather_rows", "miss_slots", miss_slots, torch.int32, 1, "[M]")
    num_blocks, block_size, row_bytes = pool.shape  # pool: [num_blocks, block_size, row_bytes] uint8
    R, max_blocks = block_table.shape  # block_table: [R, max_blocks] int32
    D, capacity, dst_row_bytes = dst.shape  # dst: [D, capacity, row_bytes] uint8
    M = miss_rows.shape[0]
    if block_size < 1:
        raise ValueError(f"gather_rows: pool has block_size = {block_size}; must be >= 1")
    if dst_row_bytes != row_bytes:
        raise ValueError(f"gather_rows: dst rows have {dst_row_bytes} bytes but pool rows have {row_bytes}")
    if miss_tokens.shape[0] != M or miss_slots.shape[0] != M:
        raise ValueError(
            f"gather_rows: miss_rows, miss_tokens, miss_slots must have one length, got "
            f"{M}, {miss_tokens.shape[0]}, {miss_slots.shape[0]}"
        )
    if dst_index.shape[0] != R:
        raise ValueError(f"gather_rows: dst_index has {dst_index.shape[0]} entries but block_table has {R} rows")
    if M == 0 or row_bytes == 0:
        return
    if native:
        from kvcore import _native_gather

        _native_gather.gather_rows(
            pool.data_ptr(),
            num_blocks,
            block_size,
            row_bytes,
            block_table.data_ptr(),
            R,
            max_blocks,
            miss_rows.data_ptr(),
            miss_tokens.data_ptr(),
            M,
            dst.data_ptr(),
            D,
            capacity,
            dst_index.data_ptr(),
            miss_slots.data_ptr(),
        )
        return
    _gather_reference(pool, block_table, miss_rows, miss_tokens, dst, dst_index, miss_slots)


def scatter_rows(pool: torch.Tensor, slot_mapping: torch.Tensor, src: torch.Tensor, *, native: bool = True) -> None:
    """Writes ``src[i]`` to pool row ``slot_mapping[i]`` (= block_id * block_size + offset)."""
    _check("scatter_rows", "pool", pool, torch.uint8, 3, "[num_blocks, block_size, row_bytes]")
    _check("scatter_rows", "slot_mapping", slot_mapping, torch.int64, 1, "[M]")
    _check("scatter_rows", "src", src, torch.uint8, 2, "[M, row_bytes]")
    num_blocks, block_size, row_bytes = pool.shape  # pool: [num_blocks, block_size, row_bytes] uint8
    M = slot_mapping.shape[0]
    if tuple(src.shape) != (M, row_bytes):
        raise ValueError(
            f"scatter_rows: src has shape {tuple(src.shape)}, expected [M, row_bytes] = ({M}, {row_bytes})"
        )
    if M == 0 or row_bytes == 0:
        return
    if native:
        from kvcore import _native_gather

        _native_gather.scatter_rows(
            pool.data_ptr(), num_blocks, block_size, row_bytes, slot_mapping.data_ptr(), M, src.data_ptr(), row_bytes
        )
        return
    _scatter_reference(pool, slot_mapping, src)


def scatter_blocks(plane: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor, *, native: bool = True) -> None:
    """Writes block ``src[i]`` to block ``block_ids[i]`` of ``plane`` (``[num_blocks, block_size, row_bytes]``
    uint8, contiguous; ``src`` ``[n, block_size, row_bytes]``); the checks and errors are
    ``scatter_rows``' with a block as one row."""
    if plane.dim() != 3 or not plane.is_contiguous():
        raise ValueError(
            f"scatter_blocks: plane must be a contiguous [num_blocks, block_size, row_bytes] tensor, got "
            f"shape {tuple(plane.shape)} strides {plane.stride()}"
        )
    if tuple(src.shape[1:]) != tuple(plane.shape[1:]):
        raise ValueError(
            f"scatter_blocks: src has shape {tuple(src.shape)}, blocks of the plane are {tuple(plane.shape[1:])}"
        )
    block_bytes = plane.shape[1] * plane.shape[2]
    rows = src.contiguous().view(src.shape[0], block_bytes)
    scatter_rows(plane.view(plane.shape[0], 1, block_bytes), block_ids, rows, native=native)


def write_pages(pages: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """``pages[block_ids[i]] = src[i]``: ``pages`` a ``[num_blocks, page_bytes]`` uint8 view whose rows
    are dense runs of bytes at any row stride >= ``page_bytes`` (``src``: ``[n, page_bytes]``). On the
    CPU one memcpy per block after ``scatter_rows``' checks (ids in range, none twice; ValueError,
    nothing written); on another device the device's ``index_copy_``."""
    if not isinstance(pages, torch.Tensor) or pages.dtype != torch.uint8 or pages.dim() != 2:
        raise ValueError(f"write_pages: pages must be a [num_blocks, page_bytes] uint8 tensor, got {_shape_of(pages)}")
    num_blocks, page_bytes = pages.shape
    if tuple(src.shape) != (block_ids.shape[0], page_bytes) or src.dtype != torch.uint8:
        raise ValueError(
            f"write_pages: src must be [len(block_ids), page_bytes] = ({block_ids.shape[0]}, {page_bytes}) "
            f"uint8, got {_shape_of(src)}"
        )
    if pages.device.type != "cpu":
        pages.index_copy_(0, block_ids.to(pages.device), src.to(pages.device))
        return
    if page_bytes > 1 and pages.stride(1) != 1 or pages.stride(0) < page_bytes:
        raise ValueError(
            f"write_pages: each block of pages must be one dense run of bytes not overlapping the next, got "
            f"strides {pages.stride()} for shape {tuple(pages.shape)}"
        )
    _check("write_pages", "block_ids", block_ids, torch.int64, 1, "[n]")
    if block_ids.shape[0] == 0 or page_bytes == 0:
        return
    from kvcore import _native_gather

    rows = src.contiguous()
    try:
        _native_gather.scatter_rows(
            pages.data_ptr(),
            num_blocks,
            1,
            page_bytes,
            block_ids.data_ptr(),
            block_ids.shape[0],
            rows.data_ptr(),
            pages.stride(0),
        )
    except ValueError as e:  # its checks are scatter_rows': name this call's arguments
        raise ValueError(
            str(e)
            .replace("scatter_rows: slot_mapping", "write_pages: block_ids")
            .replace(" (num_blocks * block_size)", " (blocks of pages)")
            .replace("that pool row", "that block")
        ) from None


def _shape_of(t: object) -> str:
    return f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check(fn: str, name: str, t: object, dtype: torch.dtype, ndim: int, shape: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be a {dtype} tensor {shape}, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{fn}: {name} must be {dtype} {shape}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} must be on the CPU, got {t.device}")
    if t.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be {shape}, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        extra = " (strided pool blocks are not supported yet)" if name == "pool" else ""
        raise ValueError(f"{fn}: {name} must be contiguous{extra}, got strides {t.stride()}")


def _first(bad: torch.Tensor) -> int | None:
    """Lowest True position of a [M] bool tensor, or None."""
    idx = bad.nonzero()
    return int(idx[0, 0]) if idx.numel() else None


def _first_repeat(keys: torch.Tensor) -> int | None:
    """Lowest position i with keys[i] == keys[j] for some j < i, or None."""
    # keys: [M] int64
    _, order = torch.sort(keys, stable=True)
    sorted_keys = keys[order]
    dup = sorted_keys[1:] == sorted_keys[:-1]  # later occurrence in stable order
    return int(order[1:][dup].min()) if bool(dup.any()) else None


def _gather_reference(pool, block_table, miss_rows, miss_tokens, dst, dst_index, miss_slots) -> None:
    num_blocks, block_size, row_bytes = pool.shape
    R, max_blocks = block_table.shape
    D, capacity, _ = dst.shape
    rows = miss_rows.long()  # [M]
    toks = miss_tokens  # [M] int64
    bad_row = (rows < 0) | (rows >= R)
    r_safe = torch.where(bad_row, 0, rows)
    bad_tok = ~bad_row & (toks < 0)
    lb = torch.div(toks.clamp(min=0), block_size, rounding_mode="floor")  # [M] logical block
    bad_lb = ~bad_row & ~bad_tok & (lb >= max_blocks)
    ok = ~(bad_row | bad_tok | bad_lb)
    blk = (
        torch.where(ok, block_table[r_safe, torch.where(ok, lb, 0)].long(), 0)
        if R and max_blocks
        else torch.zeros_like(toks)
    )
    bad_blk = ok & ((blk < 0) | (blk >= num_blocks))
    slots = miss_slots.long()
    bad_slot = ok & ~bad_blk & ((slots < 0) | (slots >= capacity))
    buf = dst_index.long()[r_safe] if R else torch.zeros_like(toks)
    bad_buf = ok & ~bad_blk & ~bad_slot & ((buf < 0) | (buf >= D))
    i = _first(bad_row | bad_tok | bad_lb | bad_blk | bad_slot | bad_buf)
    if i is not None:
        r, t = int(rows[i]), int(toks[i])
        if bad_row[i]:
            msg = f"miss_rows[{i}] = {r} is out of range [0, {R})"
        elif bad_tok[i]:
            msg = f"miss_tokens[{i}] = {t} is negative"
        elif bad_lb[i]:
            msg = (
                f"miss_tokens[{i}] = {t} lies in logical block {t // block_size}, "
                f"beyond block_table's max_blocks = {max_blocks}"
            )
        elif bad_blk[i] and int(blk[i]) == -1:
            msg = f"block_table[{r}, {t // block_size}] = -1 (unallocated) for miss_tokens[{i}] = {t}"
        elif bad_blk[i]:
            msg = (
                f"block_table[{r}, {t // block_size}] = {int(blk[i])} is out of range [0, {num_blocks}) "
                f"for miss_tokens[{i}]"
            )
        elif bad_slot[i]:
            msg = f"miss_slots[{i}] = {int(slots[i])} is out of range [0, {capacity})"
        else:
            msg = f"dst_index[{r}] = {int(buf[i])} is out of range [0, {D}) for miss_rows[{i}]"
        raise ValueError(f"gather_rows: {msg}")
    dst_rows = buf * capacity + slots  # [M] row in dst viewed as [D*capacity, row_bytes]
    i = _first_repeat(dst_rows)
    if i is not None:
        raise ValueError(
            f"gather_rows: miss_slots[{i}] = {int(slots[i])} writes dst[{int(buf[i])}, {int(slots[i])}] a second time"
        )
    torch_gather(pool, block_table, miss_rows, miss_tokens, dst, dst_index, miss_slots)


def torch_gather(pool, block_table, miss_rows, miss_tokens, dst, dst_index, miss_slots) -> None:
    """The reference's data movement alone (no checks): index math, index_select, index_copy_."""
    _, block_size, row_bytes = pool.shape
    capacity = dst.shape[1]
    rows = miss_rows.long()  # [M]
    blk = block_table[rows, miss_tokens // block_size].long()  # [M] pool block ids
    src_rows = blk * block_size + miss_tokens % block_size  # [M] rows of pool as [num_blocks*block_size, row_bytes]
    dst_rows = dst_index[rows].long() * capacity + miss_slots  # [M] rows of dst as [D*capacity, row_bytes]
    picked = pool.view(-1, row_bytes).index_select(0, src_rows)  # [M, row_bytes]
    dst.view(-1, row_bytes).index_copy_(0, dst_rows, picked)


def _scatter_reference(pool, slot_mapping, src) -> None:
    num_blocks, block_size, row_bytes = pool.shape
    total = num_blocks * block_size
    i = _first((slot_mapping < 0) | (slot_mapping >= total))
    if i is not None:
        raise ValueError(
            f"scatter_rows: slot_mapping[{i}] = {int(slot_mapping[i])} is out of range [0, {total}) "
            "(num_blocks * block_size)"
        )
    i = _first_repeat(slot_mapping)
    if i is not None:
        raise ValueError(f"scatter_rows: slot_mapping[{i}] = {int(slot_mapping[i])} writes that pool row a second time")
    pool.view(-1, row_bytes).index_copy_(0, slot_mapping, src)  # pool rows: [num_blocks*block_size, row_bytes]
