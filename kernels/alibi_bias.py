"""Geometry of the 2D wrapped, normalised ALiBi bias (SPEC.md §2).

Tokens are ``[prefix tokens..., P(0,0), P(0,1), ..., P(h-1,w-1)]``. For two patches the
distance is Euclidean over row/column offsets, each offset optionally wrapped around the
grid (a torus), and optionally divided by the largest distance the grid admits so that one
model works at any resolution. The bias is minus that distance; any pair involving a prefix
token gets zero. Every backend of :func:`kernels.alibi_attention` computes exactly this.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = ["alibi_bias", "check_grid", "max_distance", "patch_distances"]


def check_grid(grid_size) -> tuple[int, int]:
    """Validate a ``(h, w)`` patch grid and return it as a tuple of two positive ints."""
    try:
        h, w = (int(s) for s in grid_size)
    except (TypeError, ValueError):
        raise ValueError(f"grid_size must be a pair (h, w) of positive integers, got {grid_size!r}") from None
    if h <= 0 or w <= 0:
        raise ValueError(f"grid_size must be positive, got (h, w) = ({h}, {w})")
    return h, w


def max_distance(grid_size, wrap: bool = True) -> float:
    """Largest patch-to-patch distance on the grid: the normaliser ``d_max`` of SPEC.md §2."""
    h, w = check_grid(grid_size)
    if wrap:
        return math.hypot(h // 2, w // 2)
    return math.hypot(h - 1, w - 1)


def patch_distances(grid_size, *, wrap: bool = True, normalize: bool = True,
                    device=None, dtype=torch.float32) -> torch.Tensor:
    """Distances ``d`` (or ``d̂`` when normalised) between all patch pairs, shape (h·w, h·w)."""
    h, w = check_grid(grid_size)
    idx = torch.arange(h * w, device=device)
    row, col = idx // w, idx % w
    dy = (row[:, None] - row[None, :]).abs()
    dx = (col[:, None] - col[None, :]).abs()
    if wrap:
        dy = torch.minimum(dy, h - dy)
        dx = torch.minimum(dx, w - dx)
    dist = torch.sqrt((dy * dy + dx * dx).to(torch.float64))
    if normalize:
        d_max = max_distance((h, w), wrap)
        # A 1×1 grid has d_max = 0: every distance is 0 there, and so is d̂.
        dist = dist / d_max if d_max > 0 else torch.zeros_like(dist)
    return dist.to(dtype)


def alibi_bias(grid_size, num_prefix_tokens: int, *, wrap: bool = True, normalize: bool = True,
               device=None, dtype=torch.float32) -> torch.Tensor:
    """The (N, N) bias matrix ``B`` of SPEC.md §2 with ``N = num_prefix_tokens + h·w``.

    ``B = -d̂`` between patches and 0 for every pair involving a prefix token. No slope is
    applied. Materialising this is O(N²): the fused backends never do.
    """
    h, w = check_grid(grid_size)
    if int(num_prefix_tokens) != num_prefix_tokens or num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens must be a non-negative integer, got {num_prefix_tokens!r}")
    p = int(num_prefix_tokens)
    n = p + h * w
    bias = torch.zeros(n, n, device=device, dtype=dtype)
    bias[p:, p:] = -patch_distances((h, w), wrap=wrap, normalize=normalize, device=device, dtype=dtype)
    return bias


@lru_cache(maxsize=16)
def cached_alibi_bias(grid_size: tuple[int, int], num_prefix_tokens: int, wrap: bool, normalize: bool,
                      device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """:func:`alibi_bias` built once per (grid, prefix, options, device, dtype) and shared by all layers."""
    return alibi_bias(grid_size, num_prefix_tokens, wrap=wrap, normalize=normalize, device=device, dtype=dtype)
