"""What the tiled engine reads: a scaled image region by region, and label images tile by tile.

An image is either in memory (an array, scaled once as a whole: :class:`ArraySource`) or stored
in chunks (a :class:`~alibi_vit.chunked.ChunkedImage`: :class:`ChunkedSource` reads and scales
only the regions asked for). Both give float32 pixels in [0, 1], (h, w) or (h, w, 3), and a
``key`` naming their pixels and scaling for the feature cache. A volume is the same with one axis
more: regions are (z, y, x) boxes of grey voxels, and ``spacing`` is its (z, y, x) voxel spacing.

The scaling of a chunked image is one black and white point pair (lo, hi) for the whole image:
the model's fitted range, or, for per-image intensity modes, points measured on a seeded sample of
the image's tiles (:func:`chunked_range`): an image too large to read has no whole-image
percentile. Pixels then map as :func:`~alibi_vit.images.scale_to_range` maps them, region by
region, so every region is scaled exactly as the whole image would be with those points.
"""

from __future__ import annotations

import numpy as np

from ..chunked import ChunkedImage, sample_tiles
from ..images import PERCENTILES, grey_values, scale_to_range
from .cache import array_digest
from .io import as_label_image

__all__ = ["ArraySource", "ChunkedSource", "chunked_range", "label_region", "labels_shape", "nonzero_along_axes"]


class ArraySource:
    """An image already scaled to [0, 1] and held whole: ``pixels`` (H, W) or (H, W, 3) float32, or
    a volume's (Z, Y, X) with ``spacing``. dtype: the stored pixels' type before scaling (None: not known)."""

    def __init__(self, pixels: np.ndarray, name: str = "image", spacing=None, dtype=None):
        self.pixels, self.name, self.spacing = pixels, name, spacing
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.shape = pixels.shape[:2] if spacing is None else pixels.shape
        self._key = None

    @property
    def key(self) -> str:
        if self._key is None:  # hashing a large image takes a moment: only when a cache asks
            self._key = array_digest(self.pixels, "scaled")
        return self._key

    def read(self, *region: slice) -> np.ndarray:
        return self.pixels[region]


class ChunkedSource:
    """One plane of a chunked image (or, with ``spacing``, a whole volume), read and scaled region by
    region with points (lo, hi).

    colour: keep colour channels ((h, w, 3), alpha dropped) rather than reduce them to luma. note:
    how the points were measured (a sample of tiles), for the user."""

    def __init__(self, image: ChunkedImage, lo: float, hi: float, colour: bool, plane: int = 0, note: str = "",
                 spacing=None):
        self.image, self.lo, self.hi, self.colour, self.plane = image, float(lo), float(hi), colour, int(plane)
        self.note = note  # how (lo, hi) were measured, when they were
        self.spacing = spacing
        self.name = image.name if image.planes == 1 or spacing is not None else f"{image.name} plane {plane}"
        self.shape = image.shape if spacing is None else image.volume_shape
        what = f"plane {plane}" if spacing is None else f"volume {tuple(spacing)}"
        self.key = f"{image.key}|{what}|range {self.lo!r} {self.hi!r}|colour {colour}"

    def read(self, *region: slice) -> np.ndarray:
        if self.spacing is None:
            pixels = self.image.read(*region, self.plane)
            return scale_to_range(pixels, self.lo, self.hi, self.name, colour=self.colour)
        box = self.image.read_box(*region)  # scaled as one (z·y, x) grey image: the same mapping per voxel
        return scale_to_range(box.reshape(-1, box.shape[-1]), self.lo, self.hi, self.name).reshape(box.shape)


def chunked_range(image: ChunkedImage, mode: str, colour: bool, seed: int = 0, plane: int | None = 0):
    """(lo, hi, note) for a per-image intensity ``mode`` of a chunked image, from a seeded sample of
    its tiles (:func:`~alibi_vit.chunked.sample_tiles`; of all planes with ``plane=None``, a volume);
    ``note`` says how many tiles were read (empty when no statistics were needed). Same rules as
    :func:`~alibi_vit.images.scale_intensity`."""
    if mode == "auto":
        mode = "percentile" if image.channels == 1 else "dtype"
    dtype = image.dtype
    if mode == "dtype" and dtype.kind in "biu":
        return 0.0, float(1 if dtype.kind == "b" else np.iinfo(dtype).max), ""
    pixels, n, total = sample_tiles(image, seed=seed, plane=plane)
    note = f"intensity statistics of {image.name} from a seeded sample of {n} of its {total} tiles"
    values = grey_values(pixels, image.name, colour and image.channels > 1)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return 0.0, 0.0, note
    lo, hi = float(values.min()), float(values.max())
    if mode == "dtype":  # floats: kept when within [0, 1], else min-max
        return (0.0, 1.0, note) if lo >= 0.0 and hi <= 1.0 else (lo, hi, note)
    if mode == "percentile":
        p_lo, p_hi = np.percentile(values, PERCENTILES)
        if p_hi > p_lo:
            lo, hi = float(p_lo), float(p_hi)
    return lo, hi, note


def labels_shape(labels, ndim: int = 2) -> tuple[int, ...]:
    """(rows, columns) of a label image, or (slices, rows, columns) of a label volume (``ndim=3``),
    given as an array or a chunked image."""
    if isinstance(labels, ChunkedImage):
        if ndim == 3:
            if labels.channels != 1 or labels.plane_axes not in ("", "z"):
                raise ValueError(f"labels {labels.name} has axes {labels.axes}: expected a (z, y, x) label volume")
            return labels.volume_shape
        if labels.channels != 1 or labels.planes != 1:
            raise ValueError(f"labels {labels.name} has {labels.channels} channels and {labels.planes} planes: "
                             "expected one 2D label image")
        return labels.shape
    shape = np.shape(labels)
    if ndim == 3:
        if len(shape) != 3:
            raise ValueError(f"labels of shape {shape}: expected a (z, y, x) label volume")
        return tuple(shape)
    if len(shape) != 2:
        as_label_image(labels)  # the clear error for RGB or 3D labels
    return shape[0], shape[1]


def label_region(labels, *region: slice, source: str) -> np.ndarray:
    """The labels of one region ((rows, cols), or a volume's (z, y, x) box) as int64, checked
    (:func:`~alibi_vit.trainable.io.as_label_image`)."""
    if isinstance(labels, ChunkedImage):
        values = labels.read_box(*region) if len(region) == 3 else labels.read(*region)
    else:
        values = np.asarray(labels)[region]
    if values.ndim == 3:  # a box of a label volume: checked as one (z·y, x) label image
        return as_label_image(values.reshape(-1, values.shape[-1]), source=source).reshape(values.shape)
    return as_label_image(values, source=source)


def nonzero_along_axes(labels: np.ndarray) -> list[np.ndarray]:
    """Per axis of an array, whether each index holds a nonzero value (NaN included) anywhere: a box whose
    indices along some axis hold none is all 0. Training skips label tiles so (two passes over a 16384²
    scribble layer instead of reading and checking its 256 tiles)."""
    axes = range(labels.ndim)
    return [labels.any(axis=tuple(b for b in axes if b != a)) for a in axes]
