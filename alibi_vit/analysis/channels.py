"""Ranking a backbone's channels by how much position they carry (docs/method.md §4–§5).

The per-channel positional R² comes from :func:`alibi_vit.analysis.probe.per_channel_r2`. As the
authors' notebook does, channels are ranked once per position ramp (x, y, diagonal, radial) and
the channels a distillation teacher blanks (``blank_channels``) are the union of each ramp's top
few (2 by default): a channel that encodes the distance from the centre (radial) explains neither
x nor y linearly, so a single joint (x, y) ranking never finds it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RAMPS", "rank_channels", "rank_per_ramp", "union_of_tops"]

RAMPS = ("x", "y", "diag", "radial")


def rank_channels(r2) -> list[int]:
    """Channel indices from the most to the least positional (highest R² first; NaN last, ties by index)."""
    r2 = np.asarray(r2, dtype=float)
    key = np.where(np.isnan(r2), -np.inf, r2)
    return [int(c) for c in np.lexsort((np.arange(len(r2)), -key))]


def rank_per_ramp(features, ramps=RAMPS, **probe_options) -> dict[str, np.ndarray]:
    """Per-channel R² (C,) for each ramp of ``ramps`` (targets of :func:`per_channel_r2`, which gets
    ``probe_options``: fraction, repeats, seed, min_train, fit, alpha)."""
    from .probe import per_channel_r2

    if not ramps:
        raise ValueError("give at least one ramp")
    return {ramp: per_channel_r2(features, ramp, **probe_options) for ramp in ramps}


def union_of_tops(r2_by_ramp: dict, top: int = 2) -> list[int]:
    """The union of each ramp's ``top`` channels, in ramp order then rank order, without repeats."""
    if top < 1:
        raise ValueError(f"top must be at least 1, got {top}")
    chosen: list[int] = []
    for r2 in r2_by_ramp.values():
        for c in rank_channels(r2)[:top]:
            if c not in chosen:
                chosen.append(c)
    return chosen
