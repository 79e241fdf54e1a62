"""2-D average pooling of a square patch grid, the pooled drafting view (IbED Sec. 5.1).

Pooling happens on the vision features *before* the projector, preserving the 2-D layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mmspec.errors import MMSpecError


def valid_pool_sizes(grid: int) -> list[int]:
    """Token counts N = s*s per image reachable from a grid x grid patch grid (s divides grid)."""
    return [s * s for s in range(grid, 0, -1) if grid % s == 0]


def pool_patch_grid(patches: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """patches [n_img, grid*grid, C] (row-major) -> [n_img, n_tokens, C] by 2-D average pooling."""
    n_img, n_patches, c = patches.shape
    grid = math.isqrt(n_patches)
    if grid * grid != n_patches:
        raise MMSpecError(f"pooling needs a square patch grid, got {n_patches} patches per image")
    side = math.isqrt(n_tokens)
    if side * side != n_tokens or grid % side:
        raise MMSpecError(
            f"pooled:{n_tokens} is not reachable from a {grid}x{grid} patch grid; "
            f"choose one of pooled:{valid_pool_sizes(grid)}"
        )
    if side == grid:
        return patches
    x = patches.reshape(n_img, grid, grid, c).permute(0, 3, 1, 2)  # [n_img, C, grid, grid]
    x = F.avg_pool2d(x, kernel_size=grid // side)  # [n_img, C, side, side]
    return x.permute(0, 2, 3, 1).reshape(n_img, side * side, c)


def pool_grid_to(patches: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """patches [n, grid*grid, C] (row-major square grids) -> [n, s*s, C], s = round(sqrt(n_tokens))
    clipped to [1, grid], by adaptive average pooling: any n_tokens, for families whose P view
    takes any size (the exact windows of :func:`pool_patch_grid` when s divides the grid)."""
    n, n_patches, c = patches.shape
    grid = math.isqrt(n_patches)
    if grid * grid != n_patches:
        raise MMSpecError(f"pooling needs a square patch grid, got {n_patches} patches per image")
    side = max(1, min(grid, round(math.sqrt(n_tokens))))
    x = patches.reshape(n, grid, grid, c).permute(0, 3, 1, 2)  # [n, C, grid, grid]
    x = F.adaptive_avg_pool2d(x, (side, side))  # [n, C, side, side]
    return x.permute(0, 2, 3, 1).reshape(n, side * side, c)
