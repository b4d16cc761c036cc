"""Rotary position embedding, computed on the fly from positions (no cached tables, no state).

DeepSeek-V3.2 uses two layouts: MLA rotates interleaved pairs ``(x[2i], x[2i+1])``; the lightning
indexer rotates halves ``(x[i], x[i + d/2])``. Both rotate pair ``i`` by ``pos * theta**(-2i/d)``,
in float32, and return the input dtype. A position's result depends only on that position.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotation angles: positions [T] -> ([T, dim/2], [T, dim/2]) float32."""
    inv_freq = theta ** -(torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)  # [d/2]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, *, interleaved: bool) -> torch.Tensor:
    """Rotate x [T, H, d] by the angles of positions [T]; returns [T, H, d] in x's dtype."""
    d = x.shape[-1]
    cos, sin = rope_cos_sin(positions, d, theta)  # [T, d/2]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, d/2]
    xf = x.to(torch.float32)
    if interleaved:
        pairs = xf.unflatten(-1, (d // 2, 2))  # [T, H, d/2, 2]
        x0, x1 = pairs[..., 0], pairs[..., 1]  # [T, H, d/2]
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)  # [T, H, d]
    else:
        x0, x1 = xf[..., : d // 2], xf[..., d // 2 :]  # [T, H, d/2]
        out = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # [T, H, d]
    return out.to(x.dtype)
