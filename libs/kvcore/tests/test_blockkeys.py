import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcore.pool.block_keys import HASH_KEY_BYTES, block_keys, is_request_key, request_block_key

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_one_key_per_full_block():
    keys = block_keys("m", list(range(10)), 4)
    assert len(keys) == 2 and all(len(k) == HASH_KEY_BYTES for k in keys)
    assert block_keys("m", list(range(3)), 4) == []
    assert block_keys("m", [], 4) == []
    assert block_keys("m", list(range(8)), 4) == keys  # the partial tail does not matter


def test_chained_and_prefix_stable():
    a = block_keys("m", list(range(16)), 4)
    b = block_keys("m", list(range(12)) + [99, 5, 6, 7], 4)
    assert a[:3] == b[:3] and a[3] != b[3]
    c = block_keys("m", [0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11], 4)
    assert a[0] == c[0] and a[1] != c[1] and a[2] != c[2]  # a changed block changes every later key
    assert block_keys("m", list(range(8, 16)), 4, parent=a[1]) == a[2:]


def test_model_id_parent_and_split_matter():
    t = list(range(8))
    assert block_keys("m1", t, 4) != block_keys("m2", t, 4)
    assert block_keys("m", t, 8)[0] not in block_keys("m", t, 4)
    assert block_keys("m", t, 4, parent=b"\x00" * 16) != block_keys("m", t, 4)
    # same tokens at a block boundary vs inside another split
    assert set(block_keys("m", t, 2)).isdisjoint(block_keys("m", t, 4))


def test_tensor_and_list_agree():
    t = list(range(1000, 1064))
    ref = block_keys("m", t, 16)
    assert block_keys("m", torch.tensor(t, dtype=torch.int32), 16) == ref
    assert block_keys("m", torch.tensor(t, dtype=torch.int64), 16) == ref
    assert block_keys("m", tuple(t), 16) == ref
    long = torch.arange(1, 2 * 64 + 1)[::2]  # non-contiguous view
    assert block_keys("m", long, 8) == block_keys("m", long.tolist(), 8)


def test_golden_value_is_stable_across_releases():
    # Pool objects outlive processes: changing the hash silently drops every cached prefix.
    assert block_keys("deepseek-v3.2", [1, 2, 3, 4], 4)[0].hex() == GOLDEN


GOLDEN = "1658e755f358cca7ce8417ec89d78ba9"


def test_matches_the_documented_construction():
    def field(b):
        return struct.pack("<Q", len(b)) + b

    prev = b""
    toks = [7, 8, 9, 10, 11, 12]
    for i, key in enumerate(block_keys("mdl", toks, 3)):
        h = hashlib.blake2b(digest_size=16, person=b"kvoffload-blk")
        raw = b"".join(t.to_bytes(8, "little") for t in toks[3 * i : 3 * i + 3])
        h.update(field(b"kvoffload/block/v1") + field(b"mdl") + field(prev) + field(raw))
        prev = h.digest()
        assert key == prev


def test_independent_of_pythonhashseed():
    code = (
        "from kvcore.pool.block_keys import block_keys, request_block_key;"
        "print(b''.join(block_keys('deepseek', list(range(100)), 16)).hex(), request_block_key('r', 3).hex())"
    )
    outs = set()
    for seed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=SRC)
        outs.add(
            subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
        )
    here = b"".join(block_keys("deepseek", list(range(100)), 16)).hex() + " " + request_block_key("r", 3).hex()
    assert outs == {here + "\n"}


def test_request_keys():
    k = request_block_key("req-1", 0)
    assert k == request_block_key("req-1", 0)
    assert k != request_block_key("req-1", 1) != request_block_key("req-2", 1)
    assert request_block_key("a", 12) != request_block_key("a1", 2)
    assert len(k) != HASH_KEY_BYTES and is_request_key(k)
    assert not any(is_request_key(h) for h in block_keys("m", range(64), 4))
    with pytest.raises(ValueError, match="parent"):
        block_keys("m", [1, 2], 2, parent=k)


@pytest.mark.parametrize(
    "args, match",
    [
        (("m", [1, 2], 0), "block_size"),
        (("m", [1, 2], True), "block_size"),
        (("m", [1, -2], 1), "non-negative"),
        (("m", torch.tensor([1, -2]), 1), "non-negative"),
        (("m", [[1, 2]], 1), "1-D"),
        (("m", [1.5, 2.0], 1), "integers"),
        (("m", torch.tensor([True]), 1), "integers"),
        (("m", [2**64], 1), "int64"),
        (("m", "abc", 1), "sequence"),
        (("", [1], 1), "model_id"),
        (("m", [1], 1, b"short"), "parent"),
    ],
)
def test_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        block_keys(*args)


@pytest.mark.parametrize("args", [("", 0), ("r", -1), ("r", 1.0), (None, 0), ("r", 2**63)])
def test_bad_request_key_inputs(args):
    with pytest.raises(ValueError):
        request_block_key(*args)


def test_request_key_versions_differ_and_version_zero_is_the_plain_key():
    from kvcore.pool.block_keys import is_request_key, request_block_key

    plain = request_block_key("r1", 3)
    assert request_block_key("r1", 3, version=0) == plain
    versions = {request_block_key("r1", 3, version=v) for v in (0, 17, 18)}
    assert len(versions) == 3 and all(is_request_key(k) for k in versions)
    with pytest.raises(ValueError, match="version"):
        request_block_key("r1", 3, version=-1)
