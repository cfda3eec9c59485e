"""Synthetic multi-phase micrographs with exact ground truth, for offline demos and tests.

These are NOT the scribble benchmark's real data (the paper's superalloy SEM micrographs): they
only make the pipeline runnable without downloads and give tests an exact answer to check.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage as ndi

__all__ = ["brightest_phase", "synthetic_dataset", "synthetic_micrograph"]


def _smooth_noise(rng, shape, sigma):
    field = ndi.gaussian_filter(rng.standard_normal(shape), sigma, mode="wrap")
    return (field - field.mean()) / (field.std() + 1e-12)


def synthetic_micrograph(size=256, phases: int = 3, seed=0, *, grain: float = 16.0, noise: float = 0.06,
                         blur: float = 1.0, illumination: float = 0.15, bit_depth: int = 12, fractions=None):
    """One (image, mask) pair: image (H, W) uint16, mask (H, W) int64 in 1..``phases``.

    Phases come from thresholding a smooth random field at its quantiles (equal area fractions, or
    ``fractions``, one per phase, summing to 1, zeros allowed: a phase absent from this image;
    blob-like grains of ~``grain`` px). Each phase has its own mean grey level and texture, the
    same in every image
    (phase 1: smooth; 2: fine speckle; 3: oriented stripes; further phases: coarser speckle), all
    multiplied by a linear illumination gradient of ±``illumination``, blurred by a Gaussian of
    ``blur`` px and given Gaussian noise of ``noise`` (relative to full scale). Intensities fill
    ``bit_depth`` bits of a 16-bit image, as many detectors do (so dividing by 65535 would be wrong).
    """
    if phases < 2:
        raise ValueError(f"phases must be at least 2, got {phases}")
    h, w = (size, size) if np.isscalar(size) else tuple(size)
    rng = np.random.default_rng(seed)
    field = _smooth_noise(rng, (h, w), grain)
    if fractions is None:
        edges = np.quantile(field, np.linspace(0, 1, phases + 1)[1:-1])
        mask = np.digitize(field, edges).astype(np.int64) + 1
    else:
        fractions = np.asarray(fractions, np.float64)
        if fractions.shape != (phases,) or (fractions < 0).any() or not np.isclose(fractions.sum(), 1):
            raise ValueError(f"fractions must be {phases} non-negative numbers summing to 1, got {fractions}")
        # Each phase a band of the field's quantiles: an empty band leaves the phase out.
        ranks = np.argsort(np.argsort(field, axis=None)).reshape(field.shape) / field.size
        mask = np.minimum(np.searchsorted(np.cumsum(fractions), ranks, side="right"), phases - 1).astype(np.int64) + 1
    # A phase is a material: its grey level and texture are the same in every image. Levels spread
    # over [0.3, 0.7] in a fixed shuffled order (so neighbouring phases are not always neighbours
    # in grey level); with illumination and noise, intensity alone separates them only roughly.
    levels = np.random.default_rng(phases).permutation(np.linspace(0.3, 0.7, phases))
    rows, cols = np.mgrid[0:h, 0:w].astype(np.float64)
    angle = rng.uniform(0, np.pi)
    stripes = np.sin(2 * np.pi * (rows * np.cos(angle) + cols * np.sin(angle)) / 6.0)
    textures = [np.zeros((h, w)), 0.08 * _smooth_noise(rng, (h, w), 0.7), 0.06 * stripes]
    textures += [0.08 * _smooth_noise(rng, (h, w), 2.5 + k) for k in range(phases - 3)]
    image = np.zeros((h, w))
    for p in range(phases):
        image = np.where(mask == p + 1, levels[p] + textures[p], image)
    direction = rng.uniform(0, 2 * np.pi)
    ramp = (rows / max(h - 1, 1) - 0.5) * np.sin(direction) + (cols / max(w - 1, 1) - 0.5) * np.cos(direction)
    image = image * (1.0 + 2 * illumination * ramp)
    image = ndi.gaussian_filter(image, blur) if blur > 0 else image
    image = image + noise * rng.standard_normal((h, w))
    top = 2 ** bit_depth - 1
    return np.clip(np.round(image * top), 0, top).astype(np.uint16), mask


def brightest_phase(phases: int = 3) -> int:
    """The phase (1-based) with the highest mean grey level in :func:`synthetic_micrograph`."""
    return int(np.argmax(np.random.default_rng(phases).permutation(np.linspace(0.3, 0.7, phases)))) + 1


def synthetic_dataset(n_train: int = 3, n_test: int = 3, size=256, phases: int = 3, seed=0, **kwargs):
    """((train images, train masks), (test images, test masks)) of :func:`synthetic_micrograph`, seeded."""
    pairs = [synthetic_micrograph(size, phases, seed=(seed, i), **kwargs) for i in range(n_train + n_test)]
    images, masks = [p[0] for p in pairs], [p[1] for p in pairs]
    return (images[:n_train], masks[:n_train]), (images[n_train:], masks[n_train:])
