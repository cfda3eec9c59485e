"""Geometry of the 2D wrapped, normalised ALiBi bias (docs/method.md §2).

Tokens are ``[prefix tokens..., P(0,0), P(0,1), ..., P(h-1,w-1)]``. For two patches the
distance is Euclidean over row/column offsets, each offset optionally wrapped around the
grid (a torus), and optionally divided by the largest distance the grid admits so that one
model works at any resolution. The bias is minus that distance; any pair involving a prefix
token gets zero. Every backend of :func:`kernels.alibi_attention` computes exactly this.

``metric="manhattan"`` (a baseline; the default and the paper's choice is ``"euclidean"``)
measures ``d = dy + dx`` with the same per-axis wrap instead of ``sqrt(dy² + dx²)``; its largest
distance is ``⌊h/2⌋ + ⌊w/2⌋`` with wrap and ``(h-1) + (w-1)`` without.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = ["METRICS", "alibi_bias", "bias_lookup", "check_attention_inputs", "check_grid", "check_metric",
           "device_bias_lookup", "max_distance", "patch_distances"]

METRICS = ("euclidean", "manhattan")


def check_grid(grid_size) -> tuple[int, int]:
    """Validate a ``(h, w)`` patch grid and return it as a tuple of two positive ints."""
    try:
        h, w = (int(s) for s in grid_size)
    except (TypeError, ValueError):
        raise ValueError(f"grid_size must be a pair (h, w) of positive integers, got {grid_size!r}") from None
    if h <= 0 or w <= 0:
        raise ValueError(f"grid_size must be positive, got (h, w) = ({h}, {w})")
    return h, w


def check_metric(metric) -> str:
    """Validate a distance metric name (one of ``METRICS``) and return it."""
    if metric not in METRICS:
        raise ValueError(f"unknown distance metric {metric!r}; choose one of {', '.join(METRICS)}")
    return metric


def check_attention_inputs(q, k, v, grid_size, num_prefix_tokens, slopes) -> tuple[tuple[int, int], int]:
    """What every attention path needs of its inputs: 4D (batch, heads, N, head_dim) q, k, v of one shape, dtype
    and device; a valid grid and prefix with ``N = num_prefix_tokens + h·w``; slopes None or (heads,) on q's
    device. Returns ``((h, w), num_prefix_tokens)``; anything else is a ValueError naming it."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4D tensor (batch, heads, tokens, head_dim), got {shape}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k, v must share one dtype and one device")
    h, w = check_grid(grid_size)
    if isinstance(num_prefix_tokens, bool) or int(num_prefix_tokens) != num_prefix_tokens or num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens must be a non-negative integer, got {num_prefix_tokens!r}")
    n = q.shape[2]
    if n != num_prefix_tokens + h * w:
        raise ValueError(
            f"token count {n} does not match the grid: num_prefix_tokens + h*w = "
            f"{num_prefix_tokens} + {h}*{w} = {num_prefix_tokens + h * w}")
    if slopes is not None:
        if not isinstance(slopes, torch.Tensor) or slopes.shape != (q.shape[1],):
            shape = tuple(slopes.shape) if isinstance(slopes, torch.Tensor) else type(slopes).__name__
            raise ValueError(f"slopes must be a tensor of shape (heads,) = ({q.shape[1]},), got {shape}")
        if slopes.device != q.device:
            raise ValueError(f"slopes are on {slopes.device} but q is on {q.device}")
    return (h, w), int(num_prefix_tokens)


def _combine(dy: torch.Tensor, dx: torch.Tensor, metric: str) -> torch.Tensor:
    """Per-axis offsets (already wrapped) to distances, float64."""
    if metric == "manhattan":
        return (dy + dx).to(torch.float64)
    return torch.sqrt((dy * dy + dx * dx).to(torch.float64))


def max_distance(grid_size, wrap: bool = True, metric: str = "euclidean") -> float:
    """Largest patch-to-patch distance on the grid: the normaliser ``d_max`` of docs/method.md §2.

    ``metric="manhattan"``: ``⌊h/2⌋ + ⌊w/2⌋`` with wrap, ``(h-1) + (w-1)`` without.
    """
    h, w = check_grid(grid_size)
    if check_metric(metric) == "manhattan":
        return float(h // 2 + w // 2) if wrap else float((h - 1) + (w - 1))
    if wrap:
        return math.hypot(h // 2, w // 2)
    return math.hypot(h - 1, w - 1)


def patch_distances(grid_size, *, wrap: bool = True, normalize: bool = True,
                    device=None, dtype=torch.float32, metric: str = "euclidean") -> torch.Tensor:
    """Distances ``d`` (or ``d̂`` when normalised) between all patch pairs, shape (h·w, h·w)."""
    h, w = check_grid(grid_size)
    check_metric(metric)
    idx = torch.arange(h * w, device=device)
    row, col = idx // w, idx % w
    dy = (row[:, None] - row[None, :]).abs()
    dx = (col[:, None] - col[None, :]).abs()
    if wrap:
        dy = torch.minimum(dy, h - dy)
        dx = torch.minimum(dx, w - dx)
    dist = _combine(dy, dx, metric)
    if normalize:
        d_max = max_distance((h, w), wrap, metric)
        # A 1×1 grid has d_max = 0: every distance is 0 there, and so is d̂.
        dist = dist / d_max if d_max > 0 else torch.zeros_like(dist)
    return dist.to(dtype)


def alibi_bias(grid_size, num_prefix_tokens: int, *, wrap: bool = True, normalize: bool = True,
               device=None, dtype=torch.float32, metric: str = "euclidean") -> torch.Tensor:
    """The (N, N) bias matrix ``B`` of docs/method.md §2 with ``N = num_prefix_tokens + h·w``.

    ``B = -d̂`` between patches and 0 for every pair involving a prefix token. No slope is
    applied. Materialising this is O(N²): the fused backends never do.
    """
    h, w = check_grid(grid_size)
    if int(num_prefix_tokens) != num_prefix_tokens or num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens must be a non-negative integer, got {num_prefix_tokens!r}")
    p = int(num_prefix_tokens)
    n = p + h * w
    bias = torch.zeros(n, n, device=device, dtype=dtype)
    bias[p:, p:] = -patch_distances((h, w), wrap=wrap, normalize=normalize, device=device, dtype=dtype,
                                    metric=metric)
    return bias


def bias_lookup(grid_size, num_prefix_tokens: int, *, wrap: bool = True, normalize: bool = True,
                table: bool = True, metric: str = "euclidean"):
    """Per-token codes from which the fused kernel derives ``B`` tile by tile, without an (N, N) array.

    Returns ``(codes, values, q_pad, k_pad, bias_norm)`` on the CPU, codes int64 of shape (2, N).

    ``table=True``: a difference table. Query ``i`` gets ``codes[0, i] = C + row_i·(2w-1) + col_i``
    and key ``j`` gets ``codes[1, j] = row_j·(2w-1) + col_j`` with ``C = (h-1)(2w-1) + (w-1)``, so
    ``values[codes[0, i] - codes[1, j]] = B_ij``: ``values`` (float64) is the (2h-1)×(2w-1) array
    of ``-d̂`` over row/column offsets (wrap and normalisation applied), followed by ``2C+2`` zeros
    that the prefix codes ``q_pad`` (queries) and ``k_pad`` (keys) land in against any token;
    ``bias_norm`` is 1. ``table=False``: codes are (row, col) per token, row -1 for prefix
    tokens, ``values`` is unused, and ``bias_norm`` is the ``1/d_max`` the kernel applies to ``-d``.

    ``metric="manhattan"`` fills the table with ``-(|dy| + |dx|)/d_max`` instead; ``table=False``
    (the kernel's Euclidean ``sqrt`` mode) has no Manhattan form and is a ValueError then.
    """
    h, w = check_grid(grid_size)
    if check_metric(metric) != "euclidean" and not table:
        raise ValueError(f"the {metric} metric needs the difference table (table=True): the coordinate codes "
                         "serve the kernel's Euclidean sqrt mode only")
    prefix = int(num_prefix_tokens)
    n = prefix + h * w
    p = torch.arange(h * w, dtype=torch.int64)
    row, col = p // w, p % w
    d_max = max_distance((h, w), wrap, metric)
    # 1×1 grid: d_max = 0 and d̂ is defined as 0.
    norm = (1.0 / d_max if d_max > 0 else 0.0) if normalize else 1.0
    codes = torch.empty(2, n, dtype=torch.int64)
    if table:
        w2 = 2 * w - 1
        center = (h - 1) * w2 + (w - 1)
        q_pad, k_pad = 3 * center + 1, -(center + 1)
        codes[0, :prefix], codes[1, :prefix] = q_pad, k_pad
        codes[0, prefix:] = center + row * w2 + col
        codes[1, prefix:] = row * w2 + col
        dy = torch.arange(-(h - 1), h, dtype=torch.float64).abs()
        dx = torch.arange(-(w - 1), w, dtype=torch.float64).abs()
        if wrap:
            dy = torch.minimum(dy, h - dy)
            dx = torch.minimum(dx, w - dx)
        if metric == "manhattan":
            core = -(dy[:, None] + dx[None, :]).flatten() * norm
        else:
            core = -(dy[:, None] ** 2 + dx[None, :] ** 2).sqrt().flatten() * norm
        values = torch.cat([core, torch.zeros(2 * center + 2, dtype=torch.float64)])
        return codes, values, int(q_pad), int(k_pad), 1.0
    codes[0, :prefix], codes[1, :prefix] = -1, 0
    codes[0, prefix:], codes[1, prefix:] = row, col
    # q_pad/k_pad are unused: the kernel treats row -1 as a prefix token.
    return codes, torch.zeros(1, dtype=torch.float64), 0, 0, float(norm)


# The fused kernels load codes in whole tiles without a mask: rows are padded to a multiple of this,
# the largest tile any launch config uses.
CODE_PAD = 128


@lru_cache(maxsize=64)
def device_bias_lookup(h: int, w: int, prefix: int, wrap: bool, normalize: bool, table: bool, device: torch.device,
                       metric: str = "euclidean"):
    """:func:`bias_lookup` in the fused kernel's form on ``device``, built once per grid and options:
    ``(codes, table, bias_norm, pair_table)`` with codes int32 of shape (4, ⌈N / CODE_PAD⌉·CODE_PAD) and the
    tables fp32.

    The codes of tokens past N repeat the prefix tokens' (``q_pad``, ``k_pad``: zero bias, or row -1
    in sqrt mode), so the kernels load whole tiles without masks; in table mode the key row holds
    ``-b_j`` (pre-negated), so the kernels' gathers add a query and a key code.

    Key pairs (table mode; the forward and dQ kernels): keys ``2t`` and ``2t+1`` differ in their
    (negated) codes by ``δ_t = b_2t - b_2t+1``, one of a few values (-1 inside an image row, others at
    row ends and prefix/padding boundaries). ``pair_table`` holds, for each distinct ``δ`` (index
    ``p``) and each table index ``c``, the two values ``(values[c], values[c + δ])`` at flat position
    ``2·(p·L + c)`` (L = len(values); 0 where ``c + δ`` leaves the table), and row 2 of ``codes``
    holds ``2·(p_t·L - b_2t) + e`` for key ``j = 2t + e``. So ``pair_table[2·a_i + codes[2, j]]`` is
    ``B_ij`` and keys 2t, 2t+1 read adjacent, 8-byte aligned entries: one 8-byte load gives the bias of
    two adjacent keys. The same for query pairs (the dK/dV kernel, whose tiles are keys × queries):
    after the key-pair entries, ``pair_table`` holds ``(values[c], values[c + a_2t+1 - a_2t])`` pairs and
    row 3 of ``codes`` the query-pair codes (offset past the key-pair entries):
    ``pair_table[codes[3, i] - 2·b_j] = B_ij``. In sqrt mode rows 2 and 3 are zeros and ``pair_table`` is
    a single zero."""
    codes, values, q_pad, k_pad, bias_norm = bias_lookup((h, w), prefix, wrap=wrap, normalize=normalize, table=table,
                                                         metric=metric)
    if codes.abs().max() >= 2**31 or values.numel() >= 2**31:
        raise ValueError(f"grid {h}x{w} is too large for int32 bias codes")
    n = codes.shape[1]
    padded = torch.zeros(4, -(-n // CODE_PAD) * CODE_PAD, dtype=torch.int64)
    padded[:2, :n] = codes
    pair_table = torch.zeros(1, dtype=torch.float64)
    if table:
        padded[0, n:], padded[1, n:] = q_pad, k_pad
        padded[1] = -padded[1]
        length = values.numel()
        tables, base = [], 0
        for side in (1, 0):  # key pairs (forward, dQ), then query pairs (dK/dV)
            first, delta = padded[side, 0::2], padded[side, 1::2] - padded[side, 0::2]
            deltas, pattern = torch.unique(delta, return_inverse=True)
            second = torch.arange(length)[None, :] + deltas[:, None]
            inside = (second >= 0) & (second < length)
            tables.append(torch.stack([values.expand(len(deltas), length),
                                       torch.where(inside, values[second.clamp(0, length - 1)], 0.0)], dim=-1).flatten())
            padded[3 - side] = (base + 2 * (pattern * length + first)).repeat_interleave(2) + torch.arange(2).repeat(
                len(first))
            base += tables[-1].numel()
        if base >= 2**31:
            raise ValueError(f"grid {h}x{w} is too large for int32 bias codes")
        pair_table = torch.cat(tables)
    else:
        padded[0, n:], padded[1, n:] = -1, 0
    return (padded.to(device=device, dtype=torch.int32), values.to(device=device, dtype=torch.float32), bias_norm,
            pair_table.to(device=device, dtype=torch.float32))


@lru_cache(maxsize=16)
def cached_alibi_bias(grid_size: tuple[int, int], num_prefix_tokens: int, wrap: bool, normalize: bool,
                      device: torch.device, dtype: torch.dtype, metric: str = "euclidean") -> torch.Tensor:
    """:func:`alibi_bias` built once per (grid, prefix, options, device, dtype) and shared by all layers."""
    return alibi_bias(grid_size, num_prefix_tokens, wrap=wrap, normalize=normalize, device=device, dtype=dtype,
                      metric=metric)
