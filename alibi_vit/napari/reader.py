"""napari reader: TIFF/BigTIFF/OME-TIFF and zarr/OME-Zarr through :func:`alibi_vit.chunked.open_image`.

Nothing is read when a file is opened but its metadata and a small sample for the contrast limits:
every stored pyramid level becomes one level of a multiscale image layer (napari then reads only the
chunks of the level and region on screen), so a 16384² OME-Zarr mosaic shows at once. Volumes
(a z axis) get their voxel spacing as the layer's ``scale``. Contrast limits come from the data
(percentiles of the coarsest stored level, or of a seeded sample of its tiles), not from the dtype:
a 16-bit image holding 1000–3000 is not shown black.

The layer's ``metadata["alibi_vit"]`` names the file, so the widget trains and predicts on the
lazily read image (as ``alibi-vit segment`` does) instead of on what napari holds.

Only the stored levels are shown: a large image without a pyramid (a plain BigTIFF) opens as one
level, which napari reads whole to show it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..chunked import (
    TIFF_SUFFIXES,
    ChunkedImage,
    is_zarr_path,
    open_image,
    sample_tiles,
)
from ..images import ImageReadError, fit_intensity_range

__all__ = ["LevelView", "contrast_limits", "layer_data", "napari_get_reader", "read_layers"]

SAMPLE_PIXELS = 1 << 20  # pixels the contrast limits are fitted on (a level this small is read whole)
DISPLAY_PERCENTILES = (0.5, 99.5)  # the app's page scales its display the same way (per image, by its own data)
METADATA_KEY = "alibi_vit"


class LevelView:
    """One stored pyramid level with its axes in napari's order: the plane axes (t, z) as stored,
    then y, x, then the channel axis of an RGB(A) image; stored axes of length 1 are dropped.

    Indexing reads only what is asked for (the stored array's own lazy indexing, then a transpose)."""

    def __init__(self, array, axes: str, keep: str):
        self.array, self.axes = array, axes
        sizes = dict(zip(axes, array.shape))
        self.order = [axes.index(a) for a in keep]  # stored axis of each napari axis
        self.shape = tuple(int(sizes[a]) for a in keep)
        self.dtype = np.dtype(array.dtype)
        self.ndim = len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        if not isinstance(index, tuple):
            index = (index,)
        if any(i is Ellipsis for i in index):
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (self.ndim - len(index) + 1) + index[at + 1:]
        index = index + (slice(None),) * (self.ndim - len(index))
        stored = [0] * len(self.axes)  # dropped (length-1) axes: their one entry
        for i, stored_axis in zip(index, self.order):
            stored[stored_axis] = int(i) if isinstance(i, (int, np.integer)) else i
        region = np.asarray(self.array[tuple(stored)])
        kept = [a for a, i in zip(self.order, index) if not isinstance(i, (int, np.integer))]
        # `region`'s axes are the kept stored axes in stored order; napari wants them in its order.
        stored_order = sorted(kept)
        perm = [stored_order.index(a) for a in kept]
        return np.transpose(region, perm) if perm != sorted(perm) else region

    def __array__(self, dtype=None, copy=None):
        whole = self[(slice(None),) * self.ndim]
        return whole if dtype is None else whole.astype(dtype, copy=False)


def _napari_axes(image: ChunkedImage) -> str:
    """The axes napari gets: planes as stored, then y, x, then a colour channel axis (RGB(A)) or,
    for other channel counts, the channels as a leading axis napari shows with a slider."""
    sizes = dict(zip(image.axes, image.levels[0].shape))
    planes = "".join(a for a in image.axes if a not in "yxc" and sizes[a] > 1)
    if image.channels in (3, 4):
        return planes + "yxc"
    return ("c" if image.channels > 1 else "") + planes + "yx"


def layer_data(image: ChunkedImage) -> list:
    """The image's stored levels as napari reads them: the arrays themselves when their axes are
    napari's already, else :class:`LevelView` s."""
    keep = _napari_axes(image)
    if keep == image.axes:
        return list(image.levels)
    return [LevelView(level, image.axes, keep) for level in image.levels]


def contrast_limits(image: ChunkedImage) -> tuple[float, float]:
    """Black and white points for display: percentiles of the coarsest stored level when it holds at
    most a megapixel per plane (it is read whole; for a volume, a plane in the middle), else of a seeded
    random sample of its tiles. RGB(A) images of 8 bits keep 0-255."""
    if image.channels in (3, 4) and image.dtype == np.uint8:
        return 0.0, 255.0
    coarsest = len(image.levels) - 1
    h, w = image.level_shape(coarsest)
    middle = image.planes // 2
    if h * w <= SAMPLE_PIXELS:
        sample = image.read(plane=middle, level=coarsest)
    else:
        sample = sample_tiles(image, SAMPLE_PIXELS, plane=middle)[0]
    try:
        lo, hi = fit_intensity_range([sample], DISPLAY_PERCENTILES, colour=image.channels > 1)
    except ValueError:  # no finite pixel
        return 0.0, 1.0
    return (float(lo), float(hi)) if hi > lo else (float(lo), float(lo) + 1.0)


def read_layers(path) -> list[tuple]:
    """napari layer data tuples ``[(data, kwargs, "image")]`` for one TIFF or zarr path."""
    image = open_image(path)
    data = layer_data(image)
    keep = _napari_axes(image)
    spatial = keep.replace("c", "") if image.channels in (3, 4) else keep
    kwargs = {"name": Path(str(path).rstrip("/")).name, "contrast_limits": contrast_limits(image),
              "rgb": image.channels in (3, 4), "multiscale": len(data) > 1,
              "metadata": {METADATA_KEY: {"path": str(Path(path).resolve()), "volume": image.is_volume,
                                          "axes": keep}}}
    if not kwargs["multiscale"]:
        data = data[0]
    if image.spacing is not None and image.is_volume:
        scale = {"z": image.spacing[0], "y": image.spacing[1], "x": image.spacing[2]}
        kwargs["scale"] = tuple(scale.get(a, 1.0) for a in spatial)
        kwargs["metadata"][METADATA_KEY]["spacing"] = list(image.spacing)
    return [(data, kwargs, "image")]


def _reads(path: Path) -> bool:
    return is_zarr_path(path) or (path.is_file() and path.suffix.lower() in TIFF_SUFFIXES)


def napari_get_reader(path):
    """npe2's reader hook: a function that reads ``path`` when it is one TIFF or zarr store, else None
    (napari then asks its other readers)."""
    if isinstance(path, (list, tuple)):
        if len(path) != 1:
            return None
        path = path[0]
    path = Path(path)
    if not _reads(path):
        return None

    def read(p):
        p = p[0] if isinstance(p, (list, tuple)) else p
        try:
            return read_layers(p)
        except ImageReadError as err:
            # napari shows a reader's exception as a notification; the message names the file and why.
            raise ValueError(str(err)) from None

    return read
