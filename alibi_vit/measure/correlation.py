"""Two-point correlation S2(r) of each phase along each axis, up to a radius, block by block.

S2_k(r·e) is the probability that two points r apart along axis e both lie in phase k: S2(0) is the
fraction φ, and S2 falls to φ² beyond the structure's correlation length. It is counted exactly over every
pair of voxels inside the mask (no periodic wrap): a block counts the pairs whose first voxel is in its core,
so the sum over blocks is the whole-array count. Lines are packed 64 voxels to a word so that each shift
costs an AND and a population count per word.

Along axes only: for an isotropic structure every direction gives the same curve (their spread is a check),
and for a textured one the axes are what differs. porespy's FFT estimator gives the radial average of the
whole array at once, but holds several float copies of it (12 GB at 256³).
"""

from __future__ import annotations

import numpy as np

__all__ = ["PairCorrelation", "pair_counts"]


def _packed(indicator: np.ndarray, axis: int) -> tuple[np.ndarray, int]:
    """``indicator`` (bool, 3D) with ``axis`` first and the bits of another axis packed into uint64 words."""
    pack = 2 if axis != 2 else 1
    moved = np.moveaxis(indicator, (axis, pack), (0, 2))
    bits = np.packbits(moved, axis=2)
    pad = (-bits.shape[2]) % 8
    if pad:
        bits = np.concatenate([bits, np.zeros(bits.shape[:2] + (pad,), np.uint8)], axis=2)
    return np.ascontiguousarray(bits).view(np.uint64), moved.shape[0]


def pair_counts(values: np.ndarray, core_shape: tuple[int, int, int], axes, radius: int,
                phases) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """A block's pairs ``(p, p + r·e_axis)`` with ``p`` in its core, r = 0..radius: how many lie in the mask
    (``(3, radius + 1)``) and how many have both voxels in each of ``phases``. ``values``: the block with a halo
    of ``radius`` on its far sides."""
    pairs = np.zeros((3, radius + 1), np.int64)
    both = {int(phase): np.zeros((3, radius + 1), np.int64) for phase in phases}
    for axis in axes:
        # The first voxel of a pair is in the core on every axis; the second may be in the halo along ``axis``.
        span = [slice(0, c) for c in core_shape]
        span[axis] = slice(0, values.shape[axis])
        along = values[tuple(span)]
        others = int(np.prod([c for a, c in enumerate(core_shape) if a != axis]))
        for r in range(radius + 1):
            n = min(core_shape[axis], along.shape[axis] - r)
            if n > 0:
                pairs[axis, r] += n * others
        for phase, counts in both.items():
            words, length = _packed(along == phase, axis)
            for r in range(radius + 1):
                n = min(core_shape[axis], length - r)
                if n <= 0:
                    break
                counts[axis, r] += int(np.bitwise_count(words[:n] & words[r:r + n]).sum(dtype=np.int64))
    return pairs, both


class PairCorrelation:
    """Pair counts ``both[phase][axis, r]`` and ``pairs[axis, r]`` for r = 0..radius, summed over blocks."""

    def __init__(self, ndim: int, radius: int):
        self.ndim, self.radius = ndim, radius
        self.axes = (0, 1, 2) if ndim == 3 else (1, 2)
        self.pairs = np.zeros((3, radius + 1), np.int64)
        self.both: dict[int, np.ndarray] = {}

    def add(self, counts: tuple[np.ndarray, dict[int, np.ndarray]]) -> None:
        """Add one block's :func:`pair_counts`."""
        pairs, both = counts
        self.pairs += pairs
        for phase, n in both.items():
            self.both.setdefault(phase, np.zeros((3, self.radius + 1), np.int64))
            self.both[phase] += n

    def summary(self, spacing: tuple[float, float, float]) -> list[dict]:
        """Rows (phase, axis, r in voxels, distance, S2) and, when every axis has the same spacing, the mean over
        axes (axis ``mean``)."""
        rows = []
        same_spacing = len({spacing[a] for a in self.axes}) == 1
        for phase, counts in sorted(self.both.items()):
            curves = {}
            for axis in self.axes:
                valid = self.pairs[axis] > 0
                curve = np.where(valid, counts[axis] / np.maximum(self.pairs[axis], 1), np.nan)
                curves[axis] = curve
                rows += [{"phase": phase, "axis": "zyx"[axis], "r": r, "distance": r * spacing[axis],
                          "s2": float(curve[r])} for r in range(self.radius + 1) if valid[r]]
            if same_spacing:
                mean = np.nanmean([curves[a] for a in self.axes], axis=0)
                rows += [{"phase": phase, "axis": "mean", "r": r, "distance": r * spacing[self.axes[0]],
                          "s2": float(mean[r])} for r in range(self.radius + 1) if np.isfinite(mean[r])]
        return rows
