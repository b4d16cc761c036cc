import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from kvcore.layout import KVLayout
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.segment import SharedSegment

SRC = str(Path(__file__).resolve().parents[1] / "src")
BS = 4
ROWS = (16, 8)  # plane 0: 16 bytes/token, plane 1: 8 bytes/token


def _name() -> str:
    return f"test-{uuid.uuid4().hex[:16]}"


def _geometry(num_blocks: int = 6) -> PoolGeometry:
    return PoolGeometry(BS, ROWS, num_blocks)


# ---- geometry --------------------------------------------------------------------------------


def test_geometry_derived_sizes():
    g = PoolGeometry(BS, ROWS, 10)
    assert g.num_planes == 2 and g.block_bytes == BS * 24 and g.total_bytes == 10 * BS * 24
    assert g.plane_bytes(1) == 10 * BS * 8
    g2 = PoolGeometry.for_capacity(BS, [16, 8], 10 * BS * 24 + 5)
    assert g2.num_blocks == 10 and g2.plane_row_bytes == (16, 8)
    with pytest.raises(ValueError, match=r"capacity_bytes=50 holds no block: one block is block_bytes=96"):
        PoolGeometry.for_capacity(BS, [16, 8], 50)


def test_geometry_from_layout():
    layout = KVLayout.for_mla(
        num_hidden_layers=2,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        block_size=4,
        num_mtp_layers=1,
        index_head_dim=4,
        index_dtype="float32",
    )
    g = PoolGeometry.from_layout(layout, 1 << 20, include_indexer=True)
    assert g.plane_row_bytes == (24, 16, 24, 16, 24, 16)
    assert g.plane_index(2, "main") == 4 and g.plane_index(2, "indexer") == 5
    assert g.block_bytes == 4 * layout.bytes_per_token and g.num_blocks == (1 << 20) // g.block_bytes
    g = PoolGeometry.from_layout(layout, 1 << 20, include_indexer=False)
    assert g.plane_row_bytes == (24, 24, 24) and g.plane_index(1) == 1
    assert g.block_bytes == 4 * layout.main_bytes_per_token
    with pytest.raises(ValueError, match="no plane"):
        g.plane_index(1, "indexer")


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, (8,), 1), "block_size"),
        ((4, (), 1), "at least one plane"),
        ((4, (8, 0), 1), r"plane_row_bytes\[1\]"),
        ((4, (8,), 0), "num_blocks"),
        ((4, (8,), 1, ((0, "main"), (1, "main"))), "2 entries for 1 planes"),
        ((4, (8, 8), 1, ((0, "main"), (0, "main"))), "unique"),
        ((4, (8,), 1, ((0, "kv"),)), "label"),
    ],
)
def test_geometry_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        PoolGeometry(*args)


# ---- shared segment --------------------------------------------------------------------------


def test_segment_layout_and_exists_semantics():
    name = _name()
    g = _geometry(5)
    with SharedSegment.create(name, g) as seg:
        assert seg.path == f"/dev/shm/kvoffload-{name}" and os.path.exists(seg.path)
        for p in range(g.num_planes):
            v = seg.plane(p)
            assert v.shape == (5, BS, ROWS[p]) and v.dtype == torch.uint8 and v.is_contiguous()
            assert seg.plane_offsets[p] % 4096 == 0
        seg.plane(0)[1] = 9
        assert seg.plane(1).sum() == 0  # planes do not overlap
        with pytest.raises(FileExistsError, match="replace=True"):
            SharedSegment.create(name, g)
        with pytest.raises(ValueError, match="plane"):
            seg.plane(2)
    assert not os.path.exists(f"/dev/shm/kvoffload-{name}")  # the creator's context unlinks


def test_segment_replace_and_unlink_idempotent():
    name = _name()
    a = SharedSegment.create(name, _geometry(2))
    a.plane(0).fill_(1)
    b = SharedSegment.create(name, _geometry(3), replace=True)
    assert b.geometry.num_blocks == 3 and b.plane(0).sum() == 0
    assert a.plane(0).sum() == 2 * BS * ROWS[0]  # the old mapping still works
    a.close()
    b.close()
    b.unlink()
    b.unlink()
    assert b.closed
    with pytest.raises(ValueError, match="closed"):
        b.plane(0)


def test_segment_close_with_live_view_is_safe():
    seg = SharedSegment.create(_name(), _geometry(2))
    view = seg.plane(1)
    seg.close()
    seg.unlink()
    view.fill_(3)  # mapping outlives close() while views exist
    assert int(view.sum()) == 3 * view.numel()


def test_attach_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no shared segment"):
        SharedSegment.attach(_name())
    name = _name()
    path = f"/dev/shm/kvoffload-{name}"
    with open(path, "wb") as f:
        f.write(b"NOTMAGIC" + b"\0" * 100)
    try:
        with pytest.raises(ValueError, match="not a kvoffload pool segment"):
            SharedSegment.attach(name)
    finally:
        os.unlink(path)
    for bad in ("a/b", "", "x" * 300):
        with pytest.raises(ValueError, match="segment name"):
            SharedSegment.attach(bad)


def test_cross_process_attach():
    name = _name()
    code = (
        "import sys, torch; from kvcore.pool.segment import SharedSegment\n"
        "seg = SharedSegment.attach(sys.argv[1])\n"
        "assert seg.geometry.plane_row_bytes == (16, 8), seg.geometry\n"
        "assert int(seg.plane(0)[2].sum()) == 7 * seg.plane(0)[2].numel()\n"
        "seg.plane(1)[3] = torch.arange(32, dtype=torch.uint8).view(4, 8)\n"
        "seg.close()\n"
    )
    with SharedSegment.create(name, _geometry(5)) as seg:
        seg.plane(0)[2] = 7
        subprocess.run([sys.executable, "-c", code, name], check=True, env=dict(os.environ, PYTHONPATH=SRC), timeout=60)
        assert torch.equal(seg.plane(1)[3], torch.arange(32, dtype=torch.uint8).view(4, 8))
        assert seg.plane(1)[[0, 1, 2, 4]].sum() == 0


def test_owner_process_exit_removes_its_segments(tmp_path):
    import os
    import subprocess
    import sys
    import uuid

    name = f"exit-{uuid.uuid4().hex[:8]}"
    code = (
        "from kvcore.pool.segment import SharedSegment\nfrom kvcore.pool.geometry import PoolGeometry\n"
        f"SharedSegment.create({name!r}, PoolGeometry(4, (8,), 4))\n"
    )  # never closed
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(SharedSegment.path_for(name))


def test_sweep_removes_the_segments_of_killed_processes_only():
    """kill -9 skips the exit hook, so the segment (reserved in full) would stay in /dev/shm until
    reboot; the sweep a service runs at start removes it, and never a live process's segment."""
    from kvcore.pool.segment import sweep_stale_segments

    dead, live = _name(), _name()
    code = (
        "import os, signal\nfrom kvcore.pool.segment import SharedSegment\n"
        "from kvcore.pool.geometry import PoolGeometry\n"
        f"SharedSegment.create({dead!r}, PoolGeometry(4, (8,), 4))\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": SRC}
    )
    assert proc.returncode == -9, proc.stderr
    assert os.path.exists(SharedSegment.path_for(dead))
    with SharedSegment.create(live, _geometry()) as seg:
        removed = sweep_stale_segments()
        assert SharedSegment.path_for(dead) in removed and not os.path.exists(SharedSegment.path_for(dead))
        assert os.path.exists(seg.path) and seg.path not in removed


def test_an_attached_segment_is_gone_once_unlinked_replaced_or_its_owner_killed():
    name = _name()
    with SharedSegment.create(name, _geometry()) as owner:
        seg = SharedSegment.attach(name)
        assert not seg.gone()  # the owner (this process) runs and the name is its segment
        owner.unlink()
        assert seg.gone()
        seg.close()
    with SharedSegment.create(name, _geometry()):
        seg = SharedSegment.attach(name)
        with SharedSegment.create(name, _geometry(), replace=True):  # the name now means another segment
            assert seg.gone()
        seg.close()
    dead = _name()
    code = (
        "import os, signal, sys\nfrom kvcore.pool.segment import SharedSegment\n"
        "from kvcore.pool.geometry import PoolGeometry\n"
        f"SharedSegment.create({dead!r}, PoolGeometry(4, (8,), 4))\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": SRC}
    )
    assert proc.returncode == -9, proc.stderr
    seg = SharedSegment.attach(dead)  # the file is still there: only the owner is gone
    try:
        assert seg.gone()
    finally:
        seg.close()
        SharedSegment.path_for(dead) and os.unlink(SharedSegment.path_for(dead))
