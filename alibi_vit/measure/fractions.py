"""Phase fractions, their confidence intervals and the representative-volume check.

Voxels are counted per phase in a grid of small *cells* (one pass, block by block). Everything else comes
from that grid, which is tiny even for a 16384² mosaic:

- the fraction of each phase;
- its sampling error from tile-to-tile variation: the cells are grouped into tiles, the tiles resampled
  (a block bootstrap) and the standard error of the ratio estimator given; this is the error of taking this
  image as the material, valid when tiles are larger than the structure's correlation length;
- from a probability map, the classifier's view: the expected fraction (mean probability) and the spread
  if pixels erred independently (a lower bound: a classifier's errors come in patches);
- the representative-volume check: the mean and spread of the fraction over windows of growing side.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FractionCounts", "cell_counts", "cell_probability", "cell_side", "settles", "tile_side"]

BOOTSTRAP_DRAWS = 2000
SETTLED_RELATIVE_STD = 0.05  # a window "represents" the phase when fractions across windows vary by under 5 %


def cell_side(ndim: int, shape: tuple[int, int, int]) -> int:
    """Side of the counting cells: 64 px in 2D, 16 voxels in 3D, smaller for small masks (≥ 8 cells a side)."""
    side = 64 if ndim == 2 else 16
    smallest = min(shape[3 - ndim:])
    while side > 1 and smallest < 8 * side:
        side //= 2
    return side


def tile_side(ndim: int, shape: tuple[int, int, int], cell: int, requested: int | None = None) -> int:
    """Side of the bootstrap tiles: ``requested`` rounded to cells, else the largest giving ≥ 4 tiles a side."""
    if requested:
        return max(cell, round(requested / cell) * cell)
    smallest = min(shape[3 - ndim:])
    return cell * max(1, smallest // (4 * cell))


def _reduce_cells(values: np.ndarray, cell_z: int, cell: int) -> np.ndarray:
    """Sums of ``values`` (z, y, x) over cells (partial cells at the far edges included)."""
    for axis, side in enumerate((cell_z, cell, cell)):
        values = np.add.reduceat(values, np.arange(0, values.shape[axis], side), axis=axis)
    return values


def cell_counts(values: np.ndarray, cell_z: int, cell: int) -> dict[int, np.ndarray]:
    """Voxels of each phase present in a block's core ``values``, per cell: what :meth:`FractionCounts.add` takes."""
    present = np.flatnonzero(np.bincount(values.ravel(), minlength=1))
    return {int(phase): _reduce_cells((values == phase).astype(np.int32), cell_z, cell) for phase in present}


def cell_probability(proba: np.ndarray, cell_z: int, cell: int) -> tuple[np.ndarray, float]:
    """A block's probability sums per cell and its sum of p(1 - p): what :meth:`FractionCounts.add_probability` takes."""
    proba = proba.astype(np.float64)
    return _reduce_cells(proba, cell_z, cell), float(np.sum(proba * (1 - proba)))


class FractionCounts:
    """Voxels per phase per cell, accumulated block by block; probability sums likewise when given."""

    def __init__(self, shape: tuple[int, int, int], ndim: int, cell: int):
        self.shape, self.ndim, self.cell = shape, ndim, cell
        self.cell_z = 1 if ndim == 2 else cell
        self.grid = tuple(-(-n // s) for n, s in zip(shape, (self.cell_z, cell, cell)))
        self.counts = np.zeros(self.grid + (0,), np.int64)
        self.proba_sums: dict[int, np.ndarray] = {}
        self.proba_variance: dict[int, float] = {}

    def _cells_of(self, core: tuple[slice, slice, slice]):
        return tuple(slice(s.start // c, -(-s.stop // c)) for s, c in zip(core, (self.cell_z, self.cell, self.cell)))

    def add(self, core: tuple[slice, slice, slice], counts: dict[int, np.ndarray]) -> None:
        """Add one block's :func:`cell_counts` (``core``: where the block lies, on the cell grid)."""
        top = max(counts)
        if top >= self.counts.shape[-1]:
            grown = np.zeros(self.grid + (top + 1,), np.int64)
            grown[..., : self.counts.shape[-1]] = self.counts
            self.counts = grown
        cells = self._cells_of(core)
        for phase, cell_values in counts.items():
            self.counts[cells + (phase,)] += cell_values

    def add_probability(self, phase: int, core: tuple[slice, slice, slice], sums: np.ndarray, variance: float) -> None:
        """Add one block's :func:`cell_probability` of ``phase``."""
        if phase not in self.proba_sums:
            self.proba_sums[phase] = np.zeros(self.grid)
            self.proba_variance[phase] = 0.0
        self.proba_sums[phase][self._cells_of(core)] += sums
        self.proba_variance[phase] += variance

    @property
    def phases(self) -> list[int]:
        return [int(p) for p in np.flatnonzero(self.counts.sum(axis=(0, 1, 2)))]

    def _group(self, grid: np.ndarray, side_cells: int, whole_only: bool) -> np.ndarray:
        """Cell sums grouped into windows of ``side_cells`` cells a side: (windows, ...) of sums."""
        steps = (1 if self.ndim == 2 else side_cells, side_cells, side_cells)
        if whole_only:  # drop the partial windows at the far edges (and windows over partial cells)
            full = [(n // (c * s)) * s for n, c, s in zip(self.shape, (self.cell_z, self.cell, self.cell), steps)]
            grid = grid[: full[0], : full[1], : full[2]]
            if 0 in grid.shape[:3]:
                return np.zeros((0,) + grid.shape[3:])
        for axis, step in enumerate(steps):
            grid = np.add.reduceat(grid, np.arange(0, grid.shape[axis], step), axis=axis)
        return grid.reshape((-1,) + grid.shape[3:])

    def summary(self, tile: int, seed: int = 0) -> dict:
        """Per phase: fraction, tile standard error and bootstrap interval, the probability view, and the
        representative-volume series; see the module docstring."""
        totals = self.counts.sum(axis=(0, 1, 2))
        voxels = int(totals.sum())
        tiles = self._group(self.counts, tile // self.cell, whole_only=False)
        tile_voxels = tiles.sum(axis=1).astype(float)
        rng = np.random.default_rng(seed)
        draws = rng.integers(0, len(tiles), (BOOTSTRAP_DRAWS, len(tiles)))
        phases = {}
        for phase in self.phases:
            fraction = totals[phase] / voxels
            n_tiles = len(tiles)
            if n_tiles > 1:  # the ratio estimator's standard error (tiles of unequal size at the edges)
                weights = tile_voxels / tile_voxels.mean()
                residual = tiles[:, phase] / tile_voxels - fraction
                se = float(np.sqrt(np.sum((weights * residual) ** 2) / (n_tiles * (n_tiles - 1))))
                boot = tiles[draws, phase].sum(axis=1) / tile_voxels[draws].sum(axis=1)
                low, high = (float(v) for v in np.percentile(boot, [2.5, 97.5]))
            else:
                se, low, high = float("nan"), float("nan"), float("nan")
            entry = {"phase": phase, "voxels": int(totals[phase]), "fraction": float(fraction),
                     "tile_se": se, "tile_ci95_low": low, "tile_ci95_high": high, "tiles": n_tiles, "tile_side": tile}
            if phase in self.proba_sums:
                soft = float(self.proba_sums[phase].sum() / voxels)
                spread = float(np.sqrt(self.proba_variance[phase]) / voxels)
                entry.update(proba_fraction=soft, proba_ci95_low=soft - 1.96 * spread,
                             proba_ci95_high=soft + 1.96 * spread, proba_minus_hard=soft - float(fraction))
            phases[phase] = entry
        return {"voxels": voxels, "phases": phases, "windows": self.window_series()}

    def window_series(self) -> list[dict]:
        """The representative-volume check: for window sides of 1, 2, 4, … cells, the mean and standard
        deviation of each phase's fraction over the whole windows of that side that fit."""
        rows, side_cells = [], 1
        smallest = min(self.grid[3 - self.ndim:])
        while side_cells <= smallest:
            windows = self._group(self.counts, side_cells, whole_only=True)
            if len(windows):
                sizes = windows.sum(axis=1, keepdims=True)
                fractions = windows / sizes
                for phase in self.phases:
                    rows.append({"phase": phase, "window_side": side_cells * self.cell, "windows": len(windows),
                                 "mean": float(fractions[:, phase].mean()),
                                 "std": float(fractions[:, phase].std(ddof=1)) if len(windows) > 1 else 0.0})
            side_cells *= 2
        return rows


def settles(window_rows: list[dict], phase: int, fraction: float) -> dict:
    """The smallest window side over which the phase's fraction varies by under 5 % of itself (with at
    least 4 windows to tell), or None when no window size is that steady."""
    for row in window_rows:
        if row["phase"] == phase and row["windows"] >= 4 and fraction > 0 and row["std"] <= SETTLED_RELATIVE_STD * fraction:
            return {"rve_side": row["window_side"], "settled": True}
    return {"rve_side": None, "settled": False}
