"""Size distributions of a region held in memory: chord lengths along each axis, and local thickness.

Chords are the runs of one phase along a line; runs that touch the ends of the line are cut by the region's
edge and left out (as porespy's ``apply_chords`` does by default). They are counted here with a difference
along each axis (a few lines of numpy, checked against porespy in the tests), so they need no extra library.

Local thickness (porespy's ``filters.local_thickness``) gives each voxel of a phase the radius of the largest
ball inside the phase that covers it; its volume-weighted histogram is the phase's pore or particle size
distribution. porespy works on the voxel grid, so the voxels must be cubic (square): anisotropic spacing is
refused rather than measured wrong.
"""

from __future__ import annotations

import numpy as np

from .masks import MeasureError

__all__ = ["CHORD_BYTES_PER_VOXEL", "THICKNESS_BYTES_PER_VOXEL", "chord_lengths", "local_thickness", "size_histogram"]

CHORD_BYTES_PER_VOXEL = 6  # the phase indicator, its padded copy and the int8 differences
THICKNESS_BYTES_PER_VOXEL = 40  # porespy's distance transform (float64), its float result and boolean masks
THICKNESS_BASE_BYTES = 400e6  # porespy's import (numba, pandas, VTK)
MEASURE_EXTRA = 'pip install "alibi-vit[measure]"'


def chord_lengths(values: np.ndarray, phase: int, axis: int) -> np.ndarray:
    """Lengths (voxels) of the runs of ``phase`` along ``axis`` of ``values`` (z, y, x) not touching the ends."""
    lines = np.moveaxis(values == phase, axis, -1).reshape(-1, values.shape[axis])
    padded = np.zeros((lines.shape[0], lines.shape[1] + 2), np.int8)
    padded[:, 1:-1] = lines
    steps = np.diff(padded, axis=1)
    _, starts = np.nonzero(steps == 1)
    _, stops = np.nonzero(steps == -1)  # row-major order pairs each run's start with its stop
    inside = (starts > 0) & (stops < lines.shape[1])
    return (stops - starts)[inside]


def local_thickness(values: np.ndarray, phase: int, spacing) -> np.ndarray:
    """porespy's local thickness (radius, voxels) of ``phase`` at each of its voxels, as a flat array."""
    axes = [a for a in range(3) if values.shape[a] > 1]
    if len({spacing[a] for a in axes}) > 1:
        raise MeasureError(f"local thickness needs cubic voxels; the spacing is {tuple(spacing[a] for a in axes)} "
                           "(resample the mask, or measure without 'thickness')")
    porespy = import_porespy("local thickness")
    indicator = np.squeeze(values == phase, axis=0) if values.shape[0] == 1 else values == phase
    if not indicator.any() or indicator.all():  # no phase, or no boundary to fit a ball against
        return np.zeros(0)
    radii = porespy.filters.local_thickness(indicator)
    return np.asarray(radii)[indicator]


def import_porespy(what: str):
    try:
        import porespy
    except ImportError:
        raise MeasureError(f"{what} needs porespy, which is not installed: {MEASURE_EXTRA}") from None
    return porespy


def size_histogram(sizes: np.ndarray, weights: np.ndarray | None = None, bins: int = 40,
                   step: float | None = None) -> dict:
    """A histogram of ``sizes`` (physical units), optionally weighted (e.g. by volume): edges and shares.
    ``step``: sizes come in multiples of it (chords, local thickness), so bins are centred on them, 40 at most."""
    sizes = np.asarray(sizes, float)
    if not len(sizes):
        return {"edges": [], "share": [], "mean": float("nan"), "peak": float("nan")}
    high = float(sizes.max())
    if step:
        step *= max(1, int(np.ceil(high / step / bins)))
        edges = np.arange(-step / 2, high + step, step)
    else:
        edges = np.linspace(0, high * 1.0001 if high > 0 else 1, bins + 1)
    counts, edges = np.histogram(sizes, edges, weights=weights)
    share = counts / counts.sum()
    peak = int(np.argmax(counts))
    mean = float(np.average(sizes, weights=weights))
    return {"edges": edges.tolist(), "share": share.tolist(), "mean": mean,
            "peak": float((edges[peak] + edges[peak + 1]) / 2)}
