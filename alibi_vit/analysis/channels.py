"""Ranking a backbone's channels by how much position they carry (docs/method.md §4–§5).

The per-channel positional R² comes from :func:`alibi_vit.analysis.probe.per_channel_r2`. As the
authors' notebook does, channels are ranked once per position ramp (x, y, diagonal, radial); the
rule :func:`union_of_tops` takes the union of each ramp's top few (2 by default): a channel that
encodes the distance from the centre (radial) explains neither x nor y linearly, so a single joint
(x, y) ranking never finds it. The authors' own blanked lists are not all this rule's output: on
their stored DINOv2-S rankings (x 117 359 …, y 359 117 …, diag 117 345 …, radial 47 113 89 …) it
gives 117, 359, 345, 47, 113, while they blank 47, 117, 359 (the union of each ramp's top 1),
47, 113, 117, 359 (the top 2 of x, y and radial) and 47, 89, 113, 359 in different places.
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


def rank_per_ramp(features, ramps=RAMPS, seed: int = 0, **probe_options) -> dict[str, np.ndarray]:
    """Per-channel R² (C,) for each ramp of ``ramps`` (targets of :func:`per_channel_r2`, which gets
    ``probe_options``: fraction, repeats, min_train, fit, alpha).

    ``features``: one (B, C, h, w) batch, or a list of single-image maps (C, h, w) / (1, C, h, w) of
    any sizes (images at native size), averaged over the images with image b seeded ``seed + 7919·b``,
    exactly as a batch of equal-sized maps is.
    """
    from .probe import per_channel_r2

    if not ramps:
        raise ValueError("give at least one ramp")
    if not isinstance(features, (list, tuple)):
        return {ramp: per_channel_r2(features, ramp, seed=seed, **probe_options) for ramp in ramps}
    if not features:
        raise ValueError("no feature maps to rank")
    return {ramp: np.mean([per_channel_r2(f, ramp, seed=seed + 7919 * b, **probe_options)
                           for b, f in enumerate(features)], axis=0) for ramp in ramps}


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
