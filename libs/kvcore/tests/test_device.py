"""Device resolution and the counting allocator."""

import gc

import pytest
import torch

from kvcore.device import DeviceAllocator, resolve_device


def test_cpu_is_default_and_unknown_kind_is_refused():
    assert resolve_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; the refusal case needs none")
def test_missing_cuda_is_an_error_not_a_fallback():
    with pytest.raises(ValueError, match="cuda"):
        resolve_device("cuda")


def test_missing_npu_is_an_error():
    with pytest.raises(ValueError, match="torch_npu"):
        resolve_device("npu")


def test_allocator_counts_current_and_peak_per_tag():
    alloc = DeviceAllocator("cpu")
    a = alloc.empty((4, 8), torch.float32, "hot")
    b = alloc.zeros((16,), torch.bfloat16, "indexer")
    assert torch.count_nonzero(b) == 0
    s = alloc.stats()
    assert s.current_bytes == 128 + 32 and s.peak_bytes == 160
    assert s.current_by_tag == {"hot": 128, "indexer": 32}
    view = a[1:]
    del a
    gc.collect()
    assert alloc.stats().current_bytes == 160  # a view keeps the storage alive
    del view, b
    gc.collect()
    s = alloc.stats()
    assert s.current_bytes == 0 and s.peak_bytes == 160 and s.peak_by_tag["hot"] == 128
    alloc.reset_peak()
    assert alloc.stats().peak_bytes == 0


def test_allocator_rejects_negative_shapes():
    with pytest.raises(ValueError, match="negative"):
        DeviceAllocator().empty((-1, 2), torch.float32, "x")
