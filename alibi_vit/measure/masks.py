"""Masks to measure: what a path holds (a 2D mask, a stack, a zarr/OME-Zarr mosaic or volume), read by box.

A :class:`MaskSource` is always seen as ``(z, y, x)``: a 2D mask is one slice (``ndim == 2``). PNG and
small images are read whole; TIFF and zarr stores through :mod:`alibi_vit.chunked`, lazily, so a box reads
only the storage chunks it touches. Class values must be integers (0..255: one value per phase); a float
image or an RGB image is refused with a message naming the file, as is an empty one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "MASK_SUFFIXES",
    "MAX_PHASES",
    "MaskSource",
    "MeasureError",
    "array_source",
    "find_masks",
    "is_probability_map",
    "open_intensity",
    "open_mask",
    "open_probabilities",
    "parse_memory",
    "parse_region",
    "parse_spacing",
]

MASK_SUFFIXES = (".png", ".tif", ".tiff", ".bmp")
MAX_PHASES = 256  # class values 0..255: more is an instance-label image, not a phase mask


class MeasureError(ValueError):
    """Bad input to a measurement (a file, an option); the command prints it as one line."""


@dataclass
class MaskSource:
    """A mask (or a probability map) seen as a ``(z, y, x)`` array, read box by box.

    name: the path, for messages and output names. ndim: 2 for an image, 3 for a volume. spacing: per
    ``(z, y, x)`` axis, in ``unit``. origin: where ``region`` starts in the stored array.
    """

    name: str
    shape: tuple[int, int, int]
    dtype: np.dtype
    ndim: int
    reader: object = field(repr=False)
    spacing: tuple[float, float, float] = (1.0, 1.0, 1.0)
    origin: tuple[int, int, int] = (0, 0, 0)
    storage_chunks: tuple[int, int, int] | None = None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def axes(self) -> str:
        return "zyx"[3 - self.ndim:]

    def read(self, box: tuple[slice, slice, slice]) -> np.ndarray:
        """The ``(z, y, x)`` values of ``box`` (relative to the region)."""
        shifted = tuple(slice(o + s.start, o + s.stop) for o, s in zip(self.origin, box))
        return np.asarray(self.reader(shifted))

    def with_region(self, region: tuple[slice, slice, slice] | None) -> MaskSource:
        """This mask restricted to ``region`` (``(z, y, x)`` slices already checked against the shape)."""
        if region is None:
            return self
        origin = tuple(o + s.start for o, s in zip(self.origin, region))
        shape = tuple(s.stop - s.start for s in region)
        return MaskSource(self.name, shape, self.dtype, self.ndim, self.reader, self.spacing, origin,
                          self.storage_chunks)


def array_source(array, spacing=None, name: str = "array") -> MaskSource:
    """A mask already in memory (a 2D image or a (z, y, x) volume of integer class values) as a source;
    ``spacing`` as for :func:`open_mask`."""
    array = np.asarray(array)
    if array.ndim not in (2, 3) or array.dtype.kind not in "uib" or 0 in array.shape:
        raise MeasureError(f"{name}: expected a non-empty 2D or 3D array of integers, got {array.dtype} {array.shape}")
    volume = array[None] if array.ndim == 2 else array
    source = MaskSource(name, volume.shape, volume.dtype, array.ndim if volume.shape[0] > 1 else 2, _whole(volume))
    source.spacing = _spacing_for(source, spacing, None)
    return source


class _Whole:
    """Reads boxes of an array in memory (pickled with it, for a scheduler's workers)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __call__(self, box):
        return self.array[box]


class _Stored:
    """Reads (z, y, x) boxes of a TIFF or zarr store, opened on first use: it pickles as its path, so that a
    scheduler's workers each open the store themselves. ``channel``: the channel read from a multi-channel store."""

    def __init__(self, path: Path, channel: int | None = None, image=None):
        self.path, self.channel, self._image = Path(path), channel, image

    def __getstate__(self):
        return {"path": self.path, "channel": self.channel, "_image": None}

    def __call__(self, box):
        if self._image is None:
            from ..chunked import open_image

            self._image = open_image(self.path)
        return self._image.read_box(*box, channel=self.channel)


def _whole(array: np.ndarray) -> _Whole:
    return _Whole(array)


def _read_plain(path: Path) -> np.ndarray:
    """A PNG/BMP (or other small image) as an array of its stored values; palette PNGs give their indices."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return np.asarray(image)
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise MeasureError(f"{path}: cannot read the image ({type(err).__name__}: {err})") from None


def _open_stored(path: Path, what: str = "a mask holds one class value per pixel"):
    """``(reader, (z, y, x) shape, dtype, spacing or None, storage chunks)`` of a TIFF or zarr store."""
    from ..chunked import TIFF_SUFFIXES, open_image, open_volume
    from ..images import ImageReadError

    try:
        image = open_image(path)
        if image.plane_axes == "z" and path.suffix.lower() in TIFF_SUFFIXES:
            open_volume(path)  # a stack whose pages differ in size or type is refused, naming the first
    except ImageReadError as err:
        raise MeasureError(str(err)) from None
    if image.channels != 1:
        raise MeasureError(f"{path}: has {image.channels} channels (axes {image.axes}); {what}")
    if image.plane_axes not in ("", "z"):
        raise MeasureError(f"{path}: planes along axes {image.plane_axes!r} (time points?); a mask is one image "
                           "or one volume of z slices")
    shape = image.volume_shape if image.plane_axes == "z" else (1,) + image.shape
    chunks = (1 if shape[0] == 1 else min(shape[0], 64),) + tuple(image.chunks)
    return _Stored(path, image=image), shape, image.dtype, image.spacing, chunks


def _open_any(path: Path, what: str = "a mask holds one class value per pixel"):
    from ..chunked import TIFF_SUFFIXES, is_zarr_path

    if not path.exists():
        raise MeasureError(f"{path}: no such file or zarr folder")
    if is_zarr_path(path) or path.suffix.lower() in TIFF_SUFFIXES:
        return _open_stored(path, what)
    if path.is_dir():
        raise MeasureError(f"{path}: a folder that is not a zarr store (name its mask files, or the folder in MASKS)")
    array = _read_plain(path)
    if array.ndim == 3:
        raise MeasureError(f"{path}: has {array.shape[2]} colour channels; {what} (store it as a single-channel "
                           "or palette image)")
    return _whole(array[None]), (1,) + array.shape, array.dtype, None, None


def open_mask(path, spacing=None) -> MaskSource:
    """The mask at ``path``. ``spacing``: one number, or one per axis (``y, x`` or ``z, y, x``), overriding
    the file's metadata; a wrong number of values is a :class:`MeasureError`."""
    path = Path(path)
    reader, shape, dtype, stored_spacing, chunks = _open_any(path)
    dtype = np.dtype(dtype)
    if dtype.kind not in "uib":
        raise MeasureError(f"{path}: values are {dtype} (not integers); a mask holds one integer class value per "
                           "pixel (probability maps go to --probabilities)")
    if 0 in shape:
        raise MeasureError(f"{path}: the mask is empty (shape {tuple(shape[1:] if shape[0] == 1 else shape)})")
    ndim = 2 if shape[0] == 1 else 3
    source = MaskSource(str(path), tuple(int(s) for s in shape), dtype, ndim, reader, storage_chunks=chunks)
    source.spacing = _spacing_for(source, spacing, stored_spacing)
    return source


def _spacing_for(source: MaskSource, given, stored) -> tuple[float, float, float]:
    if given is None:
        if stored is not None and source.ndim == 3:
            return tuple(float(s) for s in stored)
        return (1.0, 1.0, 1.0)
    given = tuple(float(v) for v in given)
    if len(given) == 1:
        return (given[0],) * 3
    if len(given) != source.ndim:
        raise MeasureError(f"{source.name}: --spacing has {len(given)} values but the mask has {source.ndim} axes "
                           f"({','.join(source.axes.upper())}); give {source.ndim} values or one")
    return ((1.0,) + given) if source.ndim == 2 else given


def open_probabilities(paths: list[Path], mask: MaskSource) -> dict[int, MaskSource]:
    """Per-class probability maps ``{class value: source}`` of the same shape as ``mask`` (float values): files
    ``<name>_proba_<class>.tif`` of one class each, or a multi-channel ``<name>_proba.ome.zarr`` whose channels
    name their classes (as ``segment apply --proba`` writes them)."""
    maps = {}
    for path in paths:
        path = Path(path)
        for value, reader, shape, dtype, chunks in _probability_channels(path):
            if tuple(shape) != mask.shape[-3:] and tuple(shape) != mask.shape:
                raise MeasureError(f"{path}: shape {tuple(shape)} differs from the mask's {mask.shape}")
            maps[value] = MaskSource(str(path), tuple(shape), np.dtype(dtype), mask.ndim, reader, mask.spacing,
                                     storage_chunks=chunks)
    return maps


def is_probability_map(path) -> bool:
    """Whether ``path`` is named as ``segment apply --proba`` names probabilities: ``<name>_proba_<class>.*`` or
    ``<name>_proba.ome.zarr``."""
    path = Path(path)
    return "_proba_" in path.name or _stem(path).endswith("_proba")


def _probability_channels(path: Path):
    """``(class value, reader, shape, dtype, chunks)`` of each class a probability file holds."""
    match = re.search(r"_proba(?:_(\d+))?$", _stem(path))
    if not match:
        raise MeasureError(f"{path}: a probability map is named <name>_proba_<class>.tif or <name>_proba.ome.zarr "
                           "(as 'segment apply --proba' writes them)")
    if match.group(1) is not None:
        reader, shape, dtype, _, chunks = _open_any(path, "a per-class probability map has one channel")
        return [(int(match.group(1)), reader, shape, dtype, chunks)]
    from ..chunked import open_image
    from ..images import ImageReadError

    if not path.exists():
        raise MeasureError(f"{path}: no such file or zarr folder")
    try:
        image = open_image(path)
        import zarr

        classes = dict(zarr.open_group(str(path), mode="r").attrs).get("alibi_vit", {}).get("channel_classes")
    except (ImageReadError, FileNotFoundError, ValueError, TypeError) as err:
        raise MeasureError(f"{path}: cannot read the probabilities ({err})") from None
    if not classes or len(classes) != image.channels:
        raise MeasureError(f"{path}: does not say which class each of its {image.channels} channels holds "
                           "(alibi_vit.channel_classes); give the per-class <name>_proba_<class> files instead")
    shape = image.volume_shape if image.plane_axes == "z" else (1,) + image.shape
    chunks = (1 if shape[0] == 1 else min(shape[0], 64),) + tuple(image.chunks)
    return [(int(c), _Stored(path, channel=k, image=image), shape, image.dtype, chunks)
            for k, c in enumerate(classes)]


def open_intensity(path, mask: MaskSource) -> MaskSource:
    """The grey image a mask segments (same shape), for the objects' mean intensity."""
    path = Path(path)
    reader, shape, dtype, _, chunks = _open_any(path, "give a single-channel image for object intensities")
    if tuple(shape) != mask.shape:
        raise MeasureError(f"{path}: shape {tuple(shape)} differs from the mask's {mask.shape} ({mask.name})")
    return MaskSource(str(path), tuple(shape), np.dtype(dtype), mask.ndim, reader, mask.spacing, storage_chunks=chunks)


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".ome.zarr", ".zarr", ".ome.tiff", ".ome.tif", ".tiff", ".tif", ".png", ".bmp"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def mask_stem(path) -> str:
    """The name outputs are named after: ``a_mask.png`` → ``a``, ``b.ome.zarr`` → ``b``."""
    stem = _stem(Path(path))
    return stem.removesuffix("_mask")


def find_masks(items) -> list[Path]:
    """The mask paths named: files, zarr folders, and the mask files directly inside other folders
    (``*_mask.*`` when there are any, else every PNG/TIFF/BMP file and zarr store)."""
    from ..chunked import is_zarr_path

    found = []
    for item in map(Path, items):
        if not item.exists():
            raise MeasureError(f"{item}: no such file or folder")
        if item.is_file() or is_zarr_path(item):
            found.append(item)
            continue
        inside = sorted(p for p in item.iterdir()
                        if (p.is_file() and p.suffix.lower() in MASK_SUFFIXES) or is_zarr_path(p))
        inside = [p for p in inside if not is_probability_map(p) and "_objects" not in p.name]
        masks = [p for p in inside if _stem(p).endswith("_mask")]
        if not (masks or inside):
            raise MeasureError(f"{item}: holds no mask (PNG, TIFF, BMP or zarr)")
        found += masks or inside
    return found


def parse_spacing(text: str) -> tuple[float, ...]:
    """``--spacing``: one positive number, or ``Y,X`` / ``Z,Y,X``."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise MeasureError(f"--spacing expects numbers such as 0.5 or 2,0.5,0.5, got {text!r}") from None
    if not 1 <= len(values) <= 3 or not all(np.isfinite(v) and v > 0 for v in values):
        raise MeasureError(f"--spacing expects 1 to 3 positive numbers (Z,Y,X), got {text!r}")
    return values


def parse_region(text: str | None, source: MaskSource) -> tuple[slice, slice, slice] | None:
    """``--region z0:z1,y0:y1,x0:x1`` (``y0:y1,x0:x1`` for a 2D mask; empty bounds mean the edge) as slices
    of ``source``'s ``(z, y, x)`` array."""
    if not text:
        return None
    parts = text.split(",")
    if len(parts) != source.ndim:
        raise MeasureError(f"--region {text!r}: expected {source.ndim} ranges "
                           f"({','.join(f'{a}0:{a}1' for a in source.axes)}) for {source.name}")
    sizes = source.shape[3 - source.ndim:]
    slices = []
    for part, size, axis in zip(parts, sizes, source.axes):
        match = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", part)
        if not match:
            raise MeasureError(f"--region {text!r}: {part!r} is not a range START:STOP")
        start = int(match.group(1) or 0)
        stop = int(match.group(2)) if match.group(2) else size
        if not 0 <= start < stop <= size:
            raise MeasureError(f"--region {text!r}: {axis} range {start}:{stop} is empty or outside 0:{size}")
        slices.append(slice(start, stop))
    return ((slice(0, 1),) if source.ndim == 2 else ()) + tuple(slices)


def parse_memory(text: str) -> int:
    """``2GB``, ``512MiB``, ``1.5G`` or a number of bytes → bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*", text)
    if not match:
        raise MeasureError(f"--max-memory expects a size such as 2GB or 512MiB, got {text!r}")
    power = " KMGT".index(match.group(2).upper() or " ")
    return int(float(match.group(1)) * (1024 if match.group(3) else 1000) ** power)
