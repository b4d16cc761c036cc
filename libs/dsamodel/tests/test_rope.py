"""RoPE: norm-preserving, relative (q.k depends on the position difference only), two layouts."""

import pytest
import torch

from dsamodel.rope import apply_rope


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotation_is_relative_and_norm_preserving(interleaved):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 16, generator=g, dtype=torch.float64)

    def dot(m, n):
        qm = apply_rope(q, torch.tensor([m]), 10000.0, interleaved=interleaved)
        kn = apply_rope(k, torch.tensor([n]), 10000.0, interleaved=interleaved)
        return float((qm * kn).sum())

    assert dot(7, 3) == pytest.approx(dot(104, 100), rel=1e-5)
    assert dot(7, 3) != pytest.approx(dot(7, 5), rel=1e-3)
    rotated = apply_rope(q, torch.tensor([12345]), 10000.0, interleaved=interleaved)
    assert float(rotated.norm()) == pytest.approx(float(q.norm()), rel=1e-6)
    assert torch.equal(apply_rope(q.float(), torch.tensor([0]), 10000.0, interleaved=interleaved), q.float())


def test_layouts_differ_by_a_permutation():
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([0, 5, 900])
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved pairs -> halves
    inter = apply_rope(x, pos, 10000.0, interleaved=True)
    halves = apply_rope(x[..., perm], pos, 10000.0, interleaved=False)
    torch.testing.assert_close(inter[..., perm], halves)
    assert apply_rope(x.to(torch.bfloat16), pos, 10000.0, interleaved=True).dtype == torch.bfloat16
