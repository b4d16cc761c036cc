"""Types of the native gather/scatter extension (built from native/gather.cpp by setup.py).

Pointers are ``data_ptr()`` integers of CPU tensors that ``kvcore.hotcache.gather`` has validated.
"""

def max_threads() -> int: ...
def set_calling_thread_threads(n: int) -> None: ...
def gather_rows(
    pool_ptr: int,
    num_blocks: int,
    block_size: int,
    row_bytes: int,
    block_table_ptr: int,
    R: int,
    max_blocks: int,
    miss_rows_ptr: int,
    miss_tokens_ptr: int,
    M: int,
    dst_ptr: int,
    D: int,
    capacity: int,
    dst_index_ptr: int,
    miss_slots_ptr: int,
) -> None: ...
def scatter_rows(
    pool_ptr: int,
    num_blocks: int,
    block_size: int,
    row_bytes: int,
    slot_mapping_ptr: int,
    M: int,
    src_ptr: int,
    row_stride: int,
) -> None: ...
