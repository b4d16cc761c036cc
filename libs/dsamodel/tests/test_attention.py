"""indexer_topk and sparse_mla_attention: definitions, determinism, purity, errors."""

import pytest
import torch

from dsamodel.attention import gather_rows, indexer_topk, sparse_mla_attention


def brute_force_topk(q, w, keys, positions, topk):
    """Python reference: best scores first, latest token first among equals, then ascending."""
    out = []
    for t in range(q.shape[0]):
        visible = int(positions[t]) + 1
        scores = [float((torch.relu(q[t].double() @ keys[s].double()) * w[t].double()).sum()) for s in range(visible)]
        best = sorted(range(visible), key=lambda s: (-scores[s], -s))[:topk]
        out.append(sorted(best) + [-1] * (topk - len(best)))
    return torch.tensor(out)


def random_indexer_inputs(t, c, heads=3, dim=8, seed=0, integer=False):
    g = torch.Generator().manual_seed(seed)
    if integer:  # small integers: every score is exact, so ties are real and reproducible
        q = torch.randint(-2, 3, (t, heads, dim), generator=g).float()
        k = torch.randint(-2, 3, (c, dim), generator=g).float()
        w = torch.randint(-2, 3, (t, heads), generator=g).float()
    else:
        q, k = torch.randn(t, heads, dim, generator=g), torch.randn(c, dim, generator=g)
        w = torch.randn(t, heads, generator=g)
    return q, w, k


@pytest.mark.parametrize("integer", [False, True])
def test_indexer_topk_matches_brute_force(integer):
    c, topk = 40, 6
    positions = torch.tensor([0, 3, 5, 6, 17, 39, 39, 25])
    q, w, k = random_indexer_inputs(len(positions), c, integer=integer)
    got = indexer_topk(q, w, k, positions, topk)
    assert got.dtype == torch.long and got.shape == (len(positions), topk)
    assert torch.equal(got, brute_force_topk(q, w, k, positions, topk))
    assert got[0].tolist() == [0, -1, -1, -1, -1, -1]  # fewer visible than topk: all of them, then -1
    assert got[2].tolist() == [0, 1, 2, 3, 4, 5]  # exactly topk visible: all of them


def test_indexer_topk_ignores_chunking_and_unseen_rows():
    q, w, k = random_indexer_inputs(50, 60, integer=True, seed=2)
    positions = torch.arange(10, 60)
    whole = indexer_topk(q, w, k, positions, 8)
    assert torch.equal(indexer_topk(q, w, k, positions, 8, chunk_bytes=1), whole)  # one query per chunk
    garbage = k.clone()
    garbage[40:] = float("nan")  # rows beyond a query's position never matter
    assert torch.equal(indexer_topk(q[:30], w[:30], garbage, positions[:30], 8), whole[:30])
    assert torch.equal(indexer_topk(q[:30], w[:30], k[:40], positions[:30], 8), whole[:30])
    assert bool((whole <= positions[:, None]).all())


def test_indexer_topk_errors():
    q, w, k = random_indexer_inputs(4, 10)
    pos = torch.arange(4)
    with pytest.raises(ValueError, match="index_keys holds 3"):
        indexer_topk(q, w, k[:3], pos, 2)
    with pytest.raises(ValueError, match="index_w"):
        indexer_topk(q, w[:, :2], k, pos, 2)
    with pytest.raises(ValueError, match="positions"):
        indexer_topk(q, w, k, pos.float(), 2)
    with pytest.raises(ValueError, match="topk"):
        indexer_topk(q, w, k, pos, 0)
    with pytest.raises(ValueError, match=">= 0"):
        indexer_topk(q, w, k, pos - 1, 2)


def attention_inputs(t=5, heads=3, r_lat=8, r=4, k=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(t, heads, r_lat, generator=g),
        torch.randn(t, heads, r, generator=g),
        torch.randn(t, k, r_lat + r, generator=g),
        torch.rand(t, k, generator=g) > 0.3,
    )


def test_sparse_attention_matches_explicit_math():
    q_lat, q_rope, rows, valid = attention_inputs()
    valid[:, 0] = True
    out = sparse_mla_attention(q_lat, q_rope, rows, valid, 0.25)
    for t in range(q_lat.shape[0]):
        for h in range(q_lat.shape[1]):
            sel = rows[t][valid[t]].double()
            s = (sel[:, :8] @ q_lat[t, h].double() + sel[:, 8:] @ q_rope[t, h].double()) * 0.25
            expected = torch.softmax(s, 0) @ sel[:, :8]
            torch.testing.assert_close(out[t, h].double(), expected, rtol=1e-5, atol=1e-6)


def test_sparse_attention_is_pure_in_valid_rows():
    q_lat, q_rope, rows, valid = attention_inputs(seed=1)
    valid[:, 0] = True
    out = sparse_mla_attention(q_lat, q_rope, rows, valid, 0.3)
    dirty = rows.clone()
    dirty[~valid] = float("nan")  # stale or uninitialized slots
    assert torch.equal(sparse_mla_attention(q_lat, q_rope, dirty, valid, 0.3), out)
    strided = rows.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other memory layout
    assert torch.equal(sparse_mla_attention(q_lat, q_rope, strided, valid, 0.3), out)
    none_valid = torch.zeros_like(valid)
    assert torch.equal(sparse_mla_attention(q_lat, q_rope, rows, none_valid, 0.3), torch.zeros_like(q_lat))
    bf16 = sparse_mla_attention(q_lat.bfloat16(), q_rope.bfloat16(), rows.bfloat16(), valid, 0.3)
    assert bf16.dtype == torch.bfloat16


def test_same_rows_same_order_from_any_layout_is_bit_identical():
    """Two 'engines': one keeps rows by token position, one in a shuffled hot-slot buffer."""
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(50, 12, generator=g)  # [C, R + r], row = token
    topk = torch.stack([torch.randperm(50, generator=g)[:6].sort().values for _ in range(4)])  # [T, k]
    topk[0, 4:] = -1
    slot_of_token = torch.randperm(64, generator=g)[:50]  # token -> hot slot
    hot = torch.full((64, 12), float("nan"))
    hot[slot_of_token] = cache
    rows_a, valid = gather_rows(cache, topk)
    rows_b = hot[slot_of_token[topk.clamp(min=0)]]  # same rows, same top-k order, other storage
    rows_b[~valid] = 0.0
    q_lat, q_rope = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 4, generator=g)
    a = sparse_mla_attention(q_lat, q_rope, rows_a, valid, 0.2)
    assert torch.equal(sparse_mla_attention(q_lat, q_rope, rows_b, valid, 0.2), a)


def test_sparse_attention_and_gather_errors():
    q_lat, q_rope, rows, valid = attention_inputs()
    with pytest.raises(ValueError, match="kv_rows"):
        sparse_mla_attention(q_lat, q_rope, rows[..., :-1], valid, 0.2)
    with pytest.raises(ValueError, match="valid"):
        sparse_mla_attention(q_lat, q_rope, rows, valid.int(), 0.2)
    with pytest.raises(ValueError, match="disagree"):
        sparse_mla_attention(q_lat, q_rope[:2], rows, valid, 0.2)
    with pytest.raises(ValueError, match="softmax_scale"):
        sparse_mla_attention(q_lat, q_rope, rows, valid, 0)
    with pytest.raises(ValueError, match="beyond"):
        gather_rows(torch.zeros(4, 3), torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="int64"):
        gather_rows(torch.zeros(4, 3), torch.tensor([[0, 1]], dtype=torch.int32))


def test_sparse_attention_leaves_its_inputs_alone():
    """It zeroes invalid rows in a copy of its own, whatever the input dtype (a float32 input must
    not be the tensor it writes into)."""
    for dtype in (torch.float32, torch.bfloat16):
        q_lat, q_rope, rows, valid = (t.to(dtype) if t.is_floating_point() else t for t in attention_inputs(seed=2))
        rows[~valid] = float("nan")
        before = rows.clone()
        sparse_mla_attention(q_lat, q_rope, rows, valid, 0.3)
        assert torch.equal(rows.isnan(), before.isnan()) and torch.equal(rows.nan_to_num(), before.nan_to_num())
