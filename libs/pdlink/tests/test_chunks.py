"""``data_chunks``: a LayerSource's rows as DataChunks of at most ``MAX_CHUNK_BYTES``, in order,
covering the data exactly, and one empty chunk for no data."""

from __future__ import annotations

import pytest
import torch

from pdlink.chunks import MAX_CHUNK_BYTES, data_chunks


def test_max_chunk_bytes_is_the_contracts_1_mib():
    assert MAX_CHUNK_BYTES == 1 << 20


@pytest.mark.parametrize(
    "size, sizes",
    [
        (1, [1]),
        (MAX_CHUNK_BYTES, [MAX_CHUNK_BYTES]),
        (MAX_CHUNK_BYTES + 1, [MAX_CHUNK_BYTES, 1]),
    ],
    ids=["1", "1MiB", "1MiB+1"],
)
def test_chunks_cover_the_data_in_order_and_round_trip(size, sizes):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    chunks = list(data_chunks(data))
    assert [len(c.data) for c in chunks] == sizes
    assert [c.offset_bytes for c in chunks] == [sum(sizes[:i]) for i in range(len(sizes))]
    assert all(c.total_bytes == size for c in chunks)
    assert b"".join(c.data for c in chunks) == data.numpy().tobytes()


def test_no_data_is_one_empty_chunk():
    chunks = list(data_chunks(torch.empty(0, dtype=torch.uint8)))
    assert [(c.offset_bytes, c.data, c.total_bytes) for c in chunks] == [(0, b"", 0)]


@pytest.mark.parametrize(
    "data",
    [torch.zeros(4, dtype=torch.float32), torch.zeros(2, 2, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)[::2]],
    ids=["float32", "2-D", "strided"],
)
def test_anything_but_contiguous_1d_uint8_is_refused(data):
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        next(data_chunks(data))
