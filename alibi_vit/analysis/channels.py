"""Ranking a backbone's channels by how much position they carry (README.md "Method" §4–§5).

The per-channel positional R² comes from :func:`alibi_vit.analysis.probe.per_channel_r2`; the
top of the ranking is the channel list a distillation teacher blanks (``blank_channels``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["rank_channels"]


def rank_channels(r2) -> list[int]:
    """Channel indices from the most to the least positional (highest R² first; NaN last, ties by index)."""
    r2 = np.asarray(r2, dtype=float)
    key = np.where(np.isnan(r2), -np.inf, r2)
    return [int(c) for c in np.lexsort((np.arange(len(r2)), -key))]
