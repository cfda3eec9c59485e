"""Human-like scribbles generated from a ground-truth mask, for the scribble benchmark (docs/method.md §7).

A scribble is a smooth random stroke inside one region of a class, kept away from the region's
border; every pixel it labels has its true class, so the benchmark measures the features and the
classifier, not labelling errors.
"""

from __future__ import annotations

import numpy as np

__all__ = ["scribbles"]


def _stroke(allowed: np.ndarray, depth: np.ndarray, rng, length: int, width: int) -> np.ndarray:
    """One stroke: a random walk with momentum that turns away from the allowed area's edge.

    It starts at an allowed pixel drawn with probability proportional to its depth (distance to
    the region's border), as a person starts in the middle of a region, and ends after ``length``
    steps or when no turn of up to ±180° keeps it inside.
    """
    h, w = allowed.shape
    ys, xs = np.nonzero(allowed)
    weights = depth[ys, xs].astype(np.float64)
    i = rng.choice(len(ys), p=weights / weights.sum()) if weights.sum() > 0 else rng.integers(len(ys))
    pos = np.array([ys[i], xs[i]], np.float64)
    heading = rng.uniform(0, 2 * np.pi)
    out = np.zeros_like(allowed)
    r = width // 2

    def inside(p):
        y, x = int(round(p[0])), int(round(p[1]))
        return 0 <= y < h and 0 <= x < w and allowed[y, x]

    for _ in range(length):
        y, x = int(round(pos[0])), int(round(pos[1]))
        out[max(y - r, 0):y + r + 1, max(x - r, 0):x + r + 1] = True
        heading += rng.normal(0, 0.25)  # gentle curvature, like a hand-drawn line
        for turn in (0, 1, -1, 2, -2, 3, -3, 4, -4, 5, -5, 6):  # steer away from the edge, 30° at a time
            step = (np.sin(heading + turn * np.pi / 6), np.cos(heading + turn * np.pi / 6))
            if inside(pos + step):
                heading += turn * np.pi / 6
                pos += step
                break
        else:
            break
    return out & allowed  # the brush's width never leaves the allowed area


def _roomy(area: np.ndarray, width: int) -> np.ndarray:
    """``area`` without its connected pieces smaller than the brush (width² px).

    A stroke is clipped to the allowed area, so one that starts in a piece of a few pixels (the
    cores of small round grains, which are just deeper than the margin) labels those pixels only:
    a dot, not a line, and it samples the grain's very centre only."""
    from scipy import ndimage as ndi  # on use: the segmentation commands import this module, not scipy

    pieces, n = ndi.label(area)
    if n == 0:
        return area
    sizes = np.bincount(pieces.ravel())
    keep = sizes >= width * width
    keep[0] = False
    return keep[pieces]


def scribbles(mask, per_class: int = 1, rng=None, *, length: int | None = None, width: int = 3,
              margin: int | None = None, min_pixels: int = 0, max_strokes: int = 30) -> np.ndarray:
    """(H, W) int64 labels: ``per_class`` strokes of each class present in ``mask``, 0 elsewhere.

    mask: (H, W) ground truth, 0 = no class (never scribbled), 1..K = classes.
    rng: a ``numpy.random.Generator`` or seed (None: fresh entropy); the result is reproducible
        from a seed.
    length: steps of the random walk, default half the image's shorter side (at least 10).
    width: brush width in px (default 3).
    margin: minimum distance in px from a stroke pixel to the class region's border, default
        ``width + 2``, within pieces of at least the brush's area (``width``² px). Where a class
        has no such room (cracks, small precipitates, grains only just wider than twice the
        margin), strokes keep to its pixels at least half its largest distance inside (down to the
        region itself), so every present class gets strokes, not dots, along thin regions.
    min_pixels: after its ``per_class`` strokes, a class with fewer labelled pixels than this gets
        more strokes (at most ``max_strokes`` in all), as a person dots several small precipitates.
    Strokes start deep inside regions more often than near their borders (see ``_stroke``).
    Every labelled pixel equals ``mask`` there.
    """
    mask = np.asarray(mask)
    if mask.ndim != 2 or mask.dtype.kind not in "uib":
        raise ValueError(f"mask must be a 2D integer image, got shape {mask.shape} dtype {mask.dtype}")
    if per_class < 0 or min_pixels < 0:
        raise ValueError(f"per_class and min_pixels must be >= 0, got {per_class} and {min_pixels}")
    rng = np.random.default_rng(rng)
    length = max(10, min(mask.shape) // 2) if length is None else int(length)
    margin = width + 2 if margin is None else int(margin)
    labels = np.zeros(mask.shape, np.int64)
    from scipy import ndimage as ndi

    for cls in np.unique(mask):
        if cls == 0:
            continue
        # Distance to the nearest pixel of another class (the image edge does not count as border).
        dist = ndi.distance_transform_edt(mask == cls)
        allowed = _roomy(dist > margin, width)
        if not allowed.any():
            allowed = dist >= max(1.0, dist.max() / 2)
        for n in range(max(per_class, max_strokes if min_pixels else 0)):
            if n >= per_class and (labels == cls).sum() >= min_pixels:
                break
            labels[_stroke(allowed, dist, rng, length, width)] = cls
    return labels
