"""Across processes: a decode host pool in named shared memory, written in one process and
gathered into a hot buffer in another (the same-host data path the services build on)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid

import torch

from kvcore.hotcache.gather import gather_rows, scatter_rows
from kvcore.pool.block_keys import request_block_key
from kvcore.pool.eviction import NoEviction
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.local import LocalHostPool

BS, ROW = 16, 1152  # bytes per token row: a DeepSeek-V3.2 bf16 latent row

CHILD = textwrap.dedent("""
    import json, sys, torch
    from kvcore.hotcache.gather import gather_rows, scatter_rows
    from kvcore.pool.segment import SharedSegment
    args = json.loads(sys.argv[1])
    seg = SharedSegment.attach(args["name"])
    plane = seg.plane(0)  # [num_blocks, block_size, row_bytes]
    table = torch.tensor([args["blocks"]], dtype=torch.int32)
    tokens = torch.tensor(args["tokens"], dtype=torch.int64)
    hot = torch.zeros((1, 64, plane.shape[-1]), dtype=torch.uint8)
    gather_rows(plane, table, torch.zeros(len(tokens), dtype=torch.int32), tokens, hot,
                torch.zeros(1, dtype=torch.int32), torch.arange(len(tokens), dtype=torch.int32))
    torch.save(hot[0, : len(tokens)].clone(), args["out"])
    # and write one new token row back, as a decode appending to the shared pool would
    row = torch.full((1, plane.shape[-1]), 7, dtype=torch.uint8)
    scatter_rows(plane, torch.tensor([args["append_slot"]], dtype=torch.int64), row)
    seg.close()
""")


def test_rows_written_here_are_gathered_in_another_process(tmp_path):
    geo = PoolGeometry.for_capacity(BS, (ROW,), 8 * BS * ROW, plane_labels=((0, "main"),))
    pool = LocalHostPool.create(f"it-{uuid.uuid4().hex[:10]}", geo, eviction=NoEviction())
    try:
        keys = [request_block_key("req", b) for b in range(3)]
        blocks = pool.alloc(keys)
        n = 3 * BS - 5
        rows = torch.randint(0, 256, (n, ROW), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        table = torch.tensor(blocks, dtype=torch.int64)
        positions = torch.arange(n)
        slots = table[positions // BS] * BS + positions % BS  # [n] block_id * block_size + offset
        scatter_rows(pool.plane(0), slots, rows)
        tokens = [0, 5, 17, 40, 42, n - 1]
        append = n  # the next token's row, inside the last block
        args = {
            "name": pool.segment.name,
            "blocks": blocks,
            "tokens": tokens,
            "out": str(tmp_path / "hot.pt"),
            "append_slot": int(table[append // BS] * BS + append % BS),
        }
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        assert torch.equal(torch.load(tmp_path / "hot.pt"), rows[tokens])
        back = torch.empty((1, 1, ROW), dtype=torch.uint8)
        gather_rows(
            pool.plane(0),
            torch.tensor([blocks], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
            torch.tensor([append]),
            back,
            torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
        )
        assert bool((back == 7).all())
    finally:
        pool.close()
