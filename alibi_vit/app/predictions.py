"""One model's prediction of one image, block by block, at every display level: what the overlay
shows while it fills in.

The app predicts an image in *blocks*: each featurisation tile of the segmenter cut into n × n
blocks of at least 60 px, as small as its size allows (:func:`blocks_per_tile`), so the blocks on
screen are classified first without classifying the rest of their tiles (a tile's features are
computed once, through the feature cache, for all its blocks). A
:class:`PredictionStore` keeps, per display level (:mod:`~alibi_vit.app.pyramid`), the class mask
(0 where nothing is predicted yet) and the uncertainty (1 − max probability, 255 = 1 − 1/K, the
most uncertain K classes allow), plus which blocks are done and their pixel count per class.

Level L holds every 2^L-th pixel of level 0 in both directions (labels stay labels, as in the
streamed writers' masks), so writing a block sets its pixels at every level at once, and a
level's pixel is final as soon as the block that holds it is. Arrays live in memory for images
read whole, and in a zarr store in the session's cache folder for big images, so memory holds a
few blocks whatever the image size.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from ..trainable.tiles import TileGrid
from .pyramid import TILE, level_shapes

__all__ = ["MIN_BLOCK", "PredictionStore", "blocks_per_tile"]


MIN_BLOCK = 60  # px: smaller blocks would classify less beyond the view, at more bookkeeping per block


def blocks_per_tile(tile: int) -> int:
    """Blocks per side of a featurisation tile: the most that divide it into blocks of at least
    ``MIN_BLOCK`` px (a 518-px tile: 7 blocks of 74 px; 1036: 14 of 74; 252: 4 of 63), 1 for a
    smaller tile."""
    return max(n for n in range(1, tile // MIN_BLOCK + 1) if tile % n == 0) if tile >= MIN_BLOCK else 1


class PredictionStore:
    """The prediction of one image (``shape``) by model ``model`` (``crf``: with the dense CRF),
    classes ``classes``, in blocks of a featurisation ``tile``; arrays in memory, or in a zarr store
    in ``folder`` (replaced)."""

    def __init__(self, shape, tile: int, classes, model: int, crf, folder: Path | None = None):
        self.shape = (int(shape[0]), int(shape[1]))
        self.classes = np.asarray(classes, np.int64)
        self.model, self.crf, self.folder = model, crf, folder
        self.block = tile // blocks_per_tile(tile)
        self.grid = TileGrid(self.shape, self.block)
        self.done = np.zeros(self.grid.counts, bool)
        self.counts = np.zeros(self.grid.counts + (len(self.classes),), np.int64)
        self.shapes = level_shapes(self.shape)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        self.mask = [self._array(f"mask_{i}", s) for i, s in enumerate(self.shapes)]
        self.uncertainty = [self._array(f"uncertainty_{i}", s) for i, s in enumerate(self.shapes)]

    def _array(self, name: str, shape):
        if self.folder is None:
            return np.zeros(shape, np.uint8)
        import zarr

        return zarr.create_array(str(self.folder / name), shape=shape, chunks=(TILE, TILE), dtype=np.uint8,
                                 fill_value=0, zarr_format=2, chunk_key_encoding={"name": "v2", "separator": "/"})

    # ---- which blocks -----------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return bool(self.done.all())

    @property
    def predicted(self) -> float:
        """The share of the image's pixels predicted so far."""
        sizes = np.outer(*(np.asarray(c) for c in self.grid.chunks))
        return float(sizes[self.done].sum() / sizes.sum())

    def pending(self, core, region=None) -> tuple[slice, slice] | None:
        """The smallest block-aligned region of ``core`` (a featurisation tile's (rows, cols)) holding
        every block not yet predicted (that overlaps ``region``, when given), or None."""
        blocks = [t for t in self.grid.covering(core) if not self.done[t.index]
                  and (region is None or t.intersects(region))]
        if not blocks:
            return None
        return (slice(min(t.core[0].start for t in blocks), max(t.core[0].stop for t in blocks)),
                slice(min(t.core[1].start for t in blocks), max(t.core[1].stop for t in blocks)))

    # ---- writing and reading --------------------------------------------------------------------
    def write(self, part, proba: np.ndarray) -> None:
        """Store the class probabilities ``proba`` (h, w, K) of the block-aligned region ``part``
        ((rows, cols) of level 0): mask and uncertainty at every level, counts, blocks done."""
        (r0, r1), (c0, c1) = ((s.start, s.stop) for s in part)
        k = proba.shape[-1]
        mask = self.classes[proba.argmax(-1)].astype(np.uint8)
        u = np.clip((1.0 - proba.max(-1)) / (1.0 - 1.0 / k), 0, 1)
        uncertainty = (u * 255).round().astype(np.uint8)
        for level, (mask_l, unc_l) in enumerate(zip(self.mask, self.uncertainty)):
            f = 1 << level
            i0, i1, j0, j1 = -(-r0 // f), -(-r1 // f), -(-c0 // f), -(-c1 // f)
            if i1 <= i0 or j1 <= j0:
                continue
            rows, cols = slice(i0 * f - r0, None, f), slice(j0 * f - c0, None, f)
            mask_l[i0:i1, j0:j1] = mask[rows, cols]
            unc_l[i0:i1, j0:j1] = uncertainty[rows, cols]
        for t in self.grid.covering(part):
            sub = mask[t.core[0].start - r0:t.core[0].stop - r0, t.core[1].start - c0:t.core[1].stop - c0]
            self.counts[t.index] = [(sub == c).sum() for c in self.classes]
            self.done[t.index] = True

    def read(self, kind: str, level: int, rows: slice, cols: slice) -> np.ndarray:
        """The ``"mask"`` or ``"uncertainty"`` of a region of a display level (0 where not predicted)."""
        return np.asarray((self.mask if kind == "mask" else self.uncertainty)[level][rows, cols])

    def fractions(self) -> tuple[np.ndarray, int]:
        """(pixels per class, pixels predicted) over the blocks done."""
        counts = self.counts[self.done].sum(axis=0) if self.done.any() else np.zeros(len(self.classes), np.int64)
        return counts, int(counts.sum())

    def remove(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
