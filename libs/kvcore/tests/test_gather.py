"""kvcore.hotcache.gather: native gather/scatter == torch reference (bit-exact), every error, threads."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore.hotcache.gather import gather_rows, max_threads, scatter_blocks, scatter_rows, write_pages

ROW_BYTES = [1, 3, 5, 64, 576, 1152]
I32, I64, U8 = torch.int32, torch.int64, torch.uint8


def _bytes(*shape, seed=0) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=U8, generator=torch.Generator().manual_seed(seed))


def _expected_gather(pool, block_table, miss_rows, miss_tokens, dst, dst_index, miss_slots):
    out = dst.clone()
    bs = pool.shape[1]
    for r, t, s in zip(miss_rows.tolist(), miss_tokens.tolist(), miss_slots.tolist()):
        out[dst_index[r], s] = pool[block_table[r, t // bs], t % bs]
    return out


@st.composite
def gather_cases(draw):
    row_bytes = draw(st.sampled_from(ROW_BYTES))
    num_blocks, block_size = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    R, max_blocks = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    D, capacity = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    table = [
        [draw(st.one_of(st.just(-1), st.integers(0, num_blocks - 1))) for _ in range(max_blocks)] for _ in range(R)
    ]
    dst_index = draw(st.lists(st.integers(0, D - 1), min_size=R, max_size=R))
    # candidate misses: allocated tokens; destinations (buffer, slot) unique
    cands = [
        (r, lb * block_size + off)
        for r in range(R)
        for lb in range(max_blocks)
        if table[r][lb] >= 0
        for off in range(block_size)
    ]
    picked = draw(st.lists(st.sampled_from(cands), max_size=24)) if cands else []
    misses, used = [], set()
    for r, t in picked:
        free = [s for s in range(capacity) if (dst_index[r], s) not in used]
        if free:
            s = draw(st.sampled_from(free))
            used.add((dst_index[r], s))
            misses.append((r, t, s))
    seed = draw(st.integers(0, 2**16))
    pool = _bytes(num_blocks, block_size, row_bytes, seed=seed)  # [num_blocks, block_size, row_bytes]
    dst = _bytes(D, capacity, row_bytes, seed=seed + 1)  # [D, capacity, row_bytes]
    return (
        pool,
        torch.tensor(table, dtype=I32),
        torch.tensor([m[0] for m in misses], dtype=I32),
        torch.tensor([m[1] for m in misses], dtype=I64),
        dst,
        torch.tensor(dst_index, dtype=I32),
        torch.tensor([m[2] for m in misses], dtype=I32),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gather_cases())
def test_gather_native_equals_reference(case):
    pool, table, rows, toks, dst, dst_index, slots = case
    a, b = dst.clone(), dst.clone()
    gather_rows(pool, table, rows, toks, a, dst_index, slots, native=True)
    gather_rows(pool, table, rows, toks, b, dst_index, slots, native=False)
    assert torch.equal(a, b)
    assert torch.equal(a, _expected_gather(pool, table, rows, toks, dst, dst_index, slots))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(ROW_BYTES), st.integers(1, 6), st.integers(1, 6), st.data())
def test_scatter_native_equals_reference(row_bytes, num_blocks, block_size, data):
    total = num_blocks * block_size
    mapping = data.draw(st.lists(st.integers(0, total - 1), unique=True, max_size=total))
    seed = data.draw(st.integers(0, 2**16))
    pool = _bytes(num_blocks, block_size, row_bytes, seed=seed)
    src = _bytes(len(mapping), row_bytes, seed=seed + 1)  # [M, row_bytes]
    m = torch.tensor(mapping, dtype=I64)  # [M]
    a, b = pool.clone(), pool.clone()
    scatter_rows(a, m, src, native=True)
    scatter_rows(b, m, src, native=False)
    assert torch.equal(a, b)
    expected = pool.clone().view(-1, row_bytes)
    for i, s in enumerate(mapping):
        expected[s] = src[i]
    assert torch.equal(a, expected.view_as(pool))


@pytest.mark.parametrize("row_bytes", [576, 1152, 3])
def test_large_gather_and_scatter_in_parallel_chunks(row_bytes):
    g = torch.Generator().manual_seed(row_bytes)
    num_blocks, bs, R, max_blocks, cap = 400, 16, 6, 60, 1024
    pool = _bytes(num_blocks, bs, row_bytes, seed=1)
    table = torch.randperm(num_blocks, generator=g)[: R * max_blocks].to(I32).view(R, max_blocks)
    rows = torch.arange(R, dtype=I32).repeat_interleave(900)  # [M]
    toks = torch.cat([torch.randperm(max_blocks * bs, generator=g)[:900] for _ in range(R)])
    slots = torch.cat([torch.randperm(cap, generator=g)[:900] for _ in range(R)]).to(I32)
    dst_index = torch.randperm(R, generator=g).to(I32)
    a, b = torch.zeros(R, cap, row_bytes, dtype=U8), torch.zeros(R, cap, row_bytes, dtype=U8)
    gather_rows(pool, table, rows, toks, a, dst_index, slots)
    gather_rows(pool, table, rows, toks, b, dst_index, slots, native=False)
    assert torch.equal(a, b)
    mapping = torch.randperm(num_blocks * bs, generator=g)[:4000]
    src = _bytes(4000, row_bytes, seed=2)
    p1, p2 = pool.clone(), pool.clone()
    scatter_rows(p1, mapping, src)
    scatter_rows(p2, mapping, src, native=False)
    assert torch.equal(p1, p2)


def test_concurrent_calls_release_the_gil_and_stay_exact():
    pool = _bytes(64, 8, 576, seed=3)
    table = torch.arange(64, dtype=I32).view(4, 16)
    rows = torch.arange(4, dtype=I32).repeat_interleave(100)
    toks = torch.arange(100).repeat(4)
    slots = torch.arange(100, dtype=I32).repeat(4)
    dst_index = torch.arange(4, dtype=I32)
    expected = torch.zeros(4, 128, 576, dtype=U8)
    gather_rows(pool, table, rows, toks, expected, dst_index, slots, native=False)
    outs = [torch.zeros(4, 128, 576, dtype=U8) for _ in range(6)]

    def work(out):
        for _ in range(20):
            gather_rows(pool, table, rows, toks, out, dst_index, slots)

    threads = [threading.Thread(target=work, args=(o,)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(o, expected) for o in outs)
    assert max_threads() >= 1


# --- errors: same ValueError on both paths, nothing copied -------------------------------------


def _gather_args():
    pool = _bytes(4, 4, 3, seed=5)  # [num_blocks=4, block_size=4, row_bytes=3]
    table = torch.tensor([[0, 1, -1], [2, 3, 1]], dtype=I32)  # [R=2, max_blocks=3]
    return dict(
        pool=pool,
        block_table=table,
        miss_rows=torch.tensor([0, 1, 1], dtype=I32),
        miss_tokens=torch.tensor([1, 5, 9], dtype=I64),
        dst=torch.zeros(2, 4, 3, dtype=U8),
        dst_index=torch.tensor([1, 0], dtype=I32),
        miss_slots=torch.tensor([0, 1, 2], dtype=I32),
    )


GATHER_ERRORS = [
    ("miss_rows", [0, 1, 2], "miss_rows[2] = 2 is out of range [0, 2)"),
    ("miss_rows", [0, -1, 1], "miss_rows[1] = -1 is out of range [0, 2)"),
    ("miss_tokens", [1, 5, -3], "miss_tokens[2] = -3 is negative"),
    ("miss_tokens", [1, 5, 12], "miss_tokens[2] = 12 lies in logical block 3, beyond block_table's max_blocks = 3"),
    ("miss_tokens", [9, 5, 1], "block_table[0, 2] = -1 (unallocated) for miss_tokens[0] = 9"),
    ("block_table", [[0, 1, -1], [2, 3, 4]], "block_table[1, 2] = 4 is out of range [0, 4) for miss_tokens[2]"),
    ("block_table", [[0, 1, -1], [2, -7, 1]], "block_table[1, 1] = -7 is out of range [0, 4) for miss_tokens[1]"),
    ("miss_slots", [0, 1, 4], "miss_slots[2] = 4 is out of range [0, 4)"),
    ("miss_slots", [0, -1, 2], "miss_slots[1] = -1 is out of range [0, 4)"),
    ("dst_index", [1, 2], "dst_index[1] = 2 is out of range [0, 2) for miss_rows[1]"),
    ("miss_slots", [0, 1, 1], "miss_slots[2] = 1 writes dst[0, 1] a second time"),
]


@pytest.mark.parametrize("name,value,message", GATHER_ERRORS)
def test_gather_errors_name_argument_position_value_and_copy_nothing(name, value, message):
    texts = []
    for native in (True, False):
        args = _gather_args()
        dtype = args[name].dtype
        args[name] = torch.tensor(value, dtype=dtype)
        with pytest.raises(ValueError) as e:
            gather_rows(**args, native=native)
        texts.append(str(e.value))
        assert message in str(e.value)
        assert not args["dst"].any()  # nothing copied, not even the valid rows before the bad one
    assert texts[0] == texts[1]


def test_gather_first_bad_position_wins_across_chunks():
    args = _gather_args()
    n = 10000
    args["miss_rows"] = torch.zeros(n, dtype=I32)
    args["miss_tokens"] = torch.zeros(n, dtype=I64)
    args["miss_slots"] = torch.zeros(n, dtype=I32)
    args["dst"] = torch.zeros(2, n, 3, dtype=U8)
    args["miss_slots"] = torch.arange(n, dtype=I32)
    args["miss_rows"][9000] = 5
    args["miss_tokens"][7000] = -1
    for native in (True, False):
        with pytest.raises(ValueError, match=r"miss_tokens\[7000\] = -1 is negative"):
            gather_rows(**args, native=native)


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("pool", torch.zeros(4, 4, 3, dtype=torch.int8), "pool must be torch.uint8"),
        ("pool", torch.zeros(4, 3, 4, dtype=U8).transpose(1, 2), "strided pool blocks are not supported yet"),
        ("block_table", torch.zeros(2, 3, dtype=I64), "block_table must be torch.int32"),
        ("miss_rows", torch.zeros(3, 1, dtype=I32), "miss_rows must be [M]"),
        ("miss_tokens", torch.zeros(3, dtype=I32), "miss_tokens must be torch.int64"),
        ("miss_slots", torch.zeros(2, dtype=I32), "must have one length"),
        ("dst", torch.zeros(2, 4, 5, dtype=U8), "dst rows have 5 bytes but pool rows have 3"),
        ("dst", torch.zeros(2, 3, 4, dtype=U8).transpose(1, 2), "dst must be contiguous"),
        ("dst_index", torch.zeros(3, dtype=I32), "dst_index has 3 entries but block_table has 2 rows"),
        ("miss_rows", [0, 1, 1], "miss_rows must be a torch.int32 tensor"),
    ],
)
def test_gather_tensor_checks(name, value, message):
    for native in (True, False):
        args = _gather_args()
        args[name] = value
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            gather_rows(**args, native=native)


@pytest.mark.parametrize(
    "mapping,message",
    [
        ([0, 16, 3], "slot_mapping[1] = 16 is out of range [0, 16) (num_blocks * block_size)"),
        ([-1, 2, 3], "slot_mapping[0] = -1 is out of range [0, 16)"),
        ([5, 2, 5], "slot_mapping[2] = 5 writes that pool row a second time"),
    ],
)
def test_scatter_errors_copy_nothing(mapping, message):
    texts = []
    for native in (True, False):
        pool = torch.zeros(4, 4, 3, dtype=U8)
        with pytest.raises(ValueError) as e:
            scatter_rows(pool, torch.tensor(mapping, dtype=I64), _bytes(3, 3, seed=9), native=native)
        texts.append(str(e.value))
        assert message in str(e.value) and not pool.any()
    assert texts[0] == texts[1]


def test_scatter_tensor_checks_and_empty_calls():
    pool = torch.zeros(4, 4, 3, dtype=U8)
    with pytest.raises(ValueError, match="src has shape"):
        scatter_rows(pool, torch.tensor([1], dtype=I64), torch.zeros(1, 4, dtype=U8))
    with pytest.raises(ValueError, match="slot_mapping must be torch.int64"):
        scatter_rows(pool, torch.tensor([1], dtype=I32), torch.zeros(1, 3, dtype=U8))
    scatter_rows(pool, torch.empty(0, dtype=I64), torch.empty(0, 3, dtype=U8))
    args = _gather_args()
    for name in ("miss_rows", "miss_slots"):
        args[name] = torch.empty(0, dtype=I32)
    args["miss_tokens"] = torch.empty(0, dtype=I64)
    gather_rows(**args)
    assert not pool.any() and not args["dst"].any()


@pytest.mark.parametrize("native", [True, False])
def test_repeats_found_in_large_index_spaces(native):
    # few rows in a big pool / big hot buffer: the native check sorts instead of using a bitmap
    pool = torch.zeros(2000, 64, 1, dtype=U8)
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 99999 writes that pool row a second time"):
        scatter_rows(pool, torch.tensor([99999, 7, 99999, 7], dtype=I64), _bytes(4, 1), native=native)
    assert not pool.any()
    scatter_rows(pool, torch.tensor([127999, 0], dtype=I64), torch.tensor([[5], [6]], dtype=U8), native=native)
    assert pool[1999, 63, 0] == 5 and pool[0, 0, 0] == 6
    dst = torch.zeros(1, 100000, 1, dtype=U8)
    args = dict(
        pool=pool,
        block_table=torch.tensor([[0, 1]], dtype=I32),
        miss_rows=torch.zeros(3, dtype=I32),
        miss_tokens=torch.tensor([0, 1, 2], dtype=I64),
        dst=dst,
        dst_index=torch.zeros(1, dtype=I32),
        miss_slots=torch.tensor([99999, 5, 5], dtype=I32),
    )
    with pytest.raises(ValueError, match=r"miss_slots\[2\] = 5 writes dst\[0, 5\] a second time"):
        gather_rows(**args, native=native)
    assert not dst.any()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.sampled_from(ROW_BYTES), st.data())
def test_scatter_blocks_equals_index_copy(num_blocks, block_size, row_bytes, data):
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks))
    plane = _bytes(num_blocks, block_size * row_bytes, seed=num_blocks).view(num_blocks, block_size, row_bytes)
    src = _bytes(len(ids), block_size * row_bytes, seed=7).view(len(ids), block_size, row_bytes)
    want = plane.clone()
    want.index_copy_(0, torch.tensor(ids, dtype=I64), src)
    scatter_blocks(plane, torch.tensor(ids, dtype=I64), src)
    assert torch.equal(plane, want)


def test_scatter_blocks_refuses_a_strided_plane_a_wrong_block_and_a_repeat():
    plane = torch.zeros(4, 2, 6, dtype=U8)
    with pytest.raises(ValueError, match="contiguous"):
        scatter_blocks(plane[:, :, :3], torch.tensor([0], dtype=I64), torch.zeros(1, 2, 3, dtype=U8))
    with pytest.raises(ValueError, match=r"blocks of the plane are \(2, 6\)"):
        scatter_blocks(plane, torch.tensor([0], dtype=I64), torch.zeros(1, 2, 3, dtype=U8))
    with pytest.raises(ValueError, match="writes that pool row a second time"):
        scatter_blocks(plane, torch.tensor([1, 1], dtype=I64), torch.ones(2, 2, 6, dtype=U8))
    assert not plane.any()  # nothing copied on an error


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), st.sampled_from(ROW_BYTES), st.integers(0, 70), st.integers(0, 3), st.data())
def test_write_pages_equals_index_copy_at_any_block_stride(num_blocks, page_bytes, gap, offset, data):
    """A vLLM layer's blocks as bytes: pages at a stride past their size (other layers' bytes between
    them) and an offset into the storage; write_pages touches exactly index_copy_'s bytes."""
    ids = data.draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks))
    storage = _bytes(num_blocks * (page_bytes + gap) + offset + page_bytes, seed=num_blocks)
    stride = page_bytes + gap

    def pages(t: torch.Tensor) -> torch.Tensor:
        return torch.as_strided(t, (num_blocks, page_bytes), (stride, 1), offset)

    src = _bytes(len(ids), page_bytes, seed=7)
    want = storage.clone()
    pages(want).index_copy_(0, torch.tensor(ids, dtype=I64), src)
    write_pages(pages(storage), torch.tensor(ids, dtype=I64), src)
    assert torch.equal(storage, want)  # the pages written, and every byte between and around them kept


def test_write_pages_takes_a_head_slice_of_each_block():
    """The decode's TP install: one contributor's half of every block (``d2h_tp.sliced``)."""
    storage = _bytes(6, 2, 48, seed=3)
    half = storage.view(6, 96).unflatten(1, (2, -1))[:, 1]  # [6, 48], stride 96
    src = _bytes(3, 48, seed=4)
    want = storage.clone()
    want.view(6, 96).unflatten(1, (2, -1))[:, 1].index_copy_(0, torch.tensor([5, 0, 2]), src)
    write_pages(half, torch.tensor([5, 0, 2]), src)
    assert torch.equal(storage, want)


def test_write_pages_refuses_what_it_cannot_write_and_writes_nothing():
    storage = torch.zeros(4, 16, dtype=U8)
    pages = storage[:, 4:12]  # [4, 8], stride 16
    one = torch.ones(1, 8, dtype=U8)
    with pytest.raises(ValueError, match=r"block_ids\[1\] = 2 writes that block a second time"):
        write_pages(pages, torch.tensor([2, 2]), torch.ones(2, 8, dtype=U8))
    with pytest.raises(ValueError, match=r"block_ids\[0\] = 4 is out of range \[0, 4\) \(blocks of pages\)"):
        write_pages(pages, torch.tensor([4]), one)
    with pytest.raises(ValueError, match=r"src must be \[len\(block_ids\), page_bytes\] = \(1, 8\)"):
        write_pages(pages, torch.tensor([0]), torch.ones(1, 9, dtype=U8))
    with pytest.raises(ValueError, match="one dense run of bytes not overlapping the next"):
        write_pages(torch.as_strided(storage, (4, 8), (4, 1)), torch.tensor([0]), one)  # rows overlap
    with pytest.raises(ValueError, match="one dense run of bytes"):
        write_pages(storage.view(4, 8, 2)[:, :, 0], torch.tensor([0]), one)  # every other byte
    with pytest.raises(ValueError, match="uint8"):
        write_pages(storage.view(torch.int16), torch.tensor([0]), one)
    with pytest.raises(ValueError, match="block_ids must be torch.int64"):
        write_pages(pages, torch.tensor([0], dtype=I32), one)
    assert not storage.any()
    write_pages(pages, torch.tensor([], dtype=I64), torch.zeros(0, 8, dtype=U8))  # nothing to write
    assert not storage.any()
