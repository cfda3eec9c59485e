"""Images larger than memory: lazy, chunked views of TIFF/BigTIFF/OME-TIFF and zarr/OME-Zarr.

:func:`open_image` opens a file without reading its pixels and returns a :class:`ChunkedImage`:
its shape, dtype, axes, storage chunks and pyramid levels, and :meth:`ChunkedImage.read`, which
reads one region (rows × columns, all channels) as stored. Only the storage chunks that the region
touches are decoded.

- TIFF and BigTIFF, tiled or in strips, and pyramidal OME-TIFF: through tifffile's zarr store
  (``aszarr``: each TIFF tile or strip is one chunk). An uncompressed image stored in one piece is
  memory-mapped instead, a region at a time, so it is not one giant chunk.
- zarr arrays and OME-Zarr (NGFF 0.4 on zarr v2, NGFF 0.5 on zarr v3) through ``zarr``: the axes
  come from the NGFF ``multiscales`` metadata, or from the array's dimension names (zarr v3
  ``dimension_names``, or xarray's ``_ARRAY_DIMENSIONS``); a 2D array needs none ((rows, columns)),
  and a 3D array whose last axis has 3 or 4 entries is read as RGB(A) like an RGB TIFF.

Axes are named t, z, c, y, x. A channel axis of length 1 is dropped; 3 or 4 channels are RGB(A)
(alpha is dropped where pixels are scaled, as for any image). Axes other than y, x and one channel
axis (time points, z slices) index *planes*: :attr:`ChunkedImage.planes` of them, each a 2D image;
those of length 1 are dropped too, so an NGFF ``tczyx`` store of one time point and one channel is a
(z, y, x) volume.
An axis order that cannot be told apart, or more than one channel axis, is an
:class:`~alibi_vit.images.ImageReadError` naming the axes found.

Volumes (X-ray CT, FIB-SEM, confocal stacks) are images with one plane axis, z: a multi-page TIFF
(every page a slice), a zarr/OME-Zarr with a z axis, or a folder of numbered slice files
(:func:`open_slice_folder`). :meth:`ChunkedImage.read_box` reads a (z, y, x) box of them,
:attr:`ChunkedImage.spacing` is the voxel spacing their metadata give (OME-TIFF ``PhysicalSize``,
ImageJ's ``spacing`` and resolution tags, OME-Zarr ``scale`` transforms), and
:func:`check_tiff_pages` refuses a stack whose pages differ in size or dtype, naming the first.

:func:`sample_tiles` draws a seeded random sample of whole tiles (not the whole image): the
intensity statistics of images too large to read are taken on it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .images import ImageReadError

__all__ = ["ChunkedImage", "TIFF_SUFFIXES", "ZARR_SUFFIXES", "check_tiff_pages", "is_zarr_path", "open_image",
           "open_slice_folder", "open_volume", "sample_tiles"]

TIFF_SUFFIXES = (".tif", ".tiff", ".btf", ".tf8")
ZARR_SUFFIXES = (".zarr",)
_ZARR_MARKERS = ("zarr.json", ".zarray", ".zgroup")
# tifffile's axis letters → ours: S (samples) and C are channels; Y, X space; the rest index planes.
_TIFF_AXES = {"Y": "y", "X": "x", "S": "c", "C": "c", "Z": "z", "T": "t"}
_NAMED_AXES = {"y": "y", "x": "x", "z": "z", "t": "t", "c": "c", "channel": "c", "channels": "c", "s": "c",
               "row": "y", "rows": "y", "col": "x", "cols": "x", "column": "x", "columns": "x", "time": "t"}
_SAMPLE_TILE = 512  # side of the tiles sample_tiles draws when the storage chunks are very small or large


def is_zarr_path(path) -> bool:
    """Whether ``path`` is a zarr store on disk: a folder named ``*.zarr`` or holding zarr metadata."""
    path = Path(path)
    return path.is_dir() and (path.suffix.lower() in ZARR_SUFFIXES
                              or any((path / m).is_file() for m in _ZARR_MARKERS))


class _MemmapArray:
    """A contiguous, uncompressed TIFF image read through a fresh memory map per region, so the
    mapped pages of earlier regions are not kept (they would count in the process's memory)."""

    def __init__(self, path: str, offset: int, shape, dtype):
        self.path, self.offset, self.shape, self.dtype = path, int(offset), tuple(shape), np.dtype(dtype)
        self.ndim = len(self.shape)

    def __getitem__(self, index):
        mm = np.memmap(self.path, self.dtype, "r", self.offset, self.shape)
        try:
            return np.array(mm[index])
        finally:
            del mm


@dataclass
class ChunkedImage:
    """A lazy view of one stored image; see the module docstring.

    name: what it is called in messages (the path). axes: the stored array's axes, one of t, z, c,
    y, x each (``"yx"``, ``"yxc"``, ``"zcyx"``…). levels: the stored arrays of the pyramid, level 0
    (full resolution) first. key: a string naming the stored pixels (path, size, modification time),
    for caches.
    """

    name: str
    axes: str
    levels: list
    key: str
    chunks: tuple[int, int]
    spacing: tuple[float, float, float] | None = None  # (z, y, x) voxel spacing from the metadata, if any

    def __post_init__(self):
        shape = self.levels[0].shape
        if len(self.axes) != len(shape):
            raise ImageReadError(f"{self.name}: axes {self.axes!r} do not match the array's shape {tuple(shape)}")
        self._sizes = dict(zip(self.axes, shape))
        # Axes of length 1 besides y and x (an NGFF tczyx store of one time point) index nothing: dropped.
        self.plane_axes = "".join(a for a in self.axes if a not in "yxc" and self._sizes[a] > 1)

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns) of one plane at full resolution."""
        return self._sizes["y"], self._sizes["x"]

    @property
    def channels(self) -> int:
        return self._sizes.get("c", 1)

    @property
    def planes(self) -> int:
        return int(np.prod([self._sizes[a] for a in self.plane_axes], dtype=np.int64))

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.levels[0].dtype)

    @property
    def is_volume(self) -> bool:
        """Whether this is a volume: several planes along one z axis (not time points)."""
        return self.plane_axes == "z" and self.planes > 1

    @property
    def volume_shape(self) -> tuple[int, int, int]:
        """(slices, rows, columns)."""
        return (self.planes,) + self.shape

    def read_box(self, zs: slice, rows: slice, cols: slice, channel: int | None = None) -> np.ndarray:
        """A (z, y, x) box of a volume's voxels as stored (a 2D image is one slice): of its one channel, or of
        ``channel`` of a multi-channel one."""
        if self.plane_axes not in ("", "z") or (self.channels != 1 and channel is None):
            raise ImageReadError(f"{self.name}: axes {self.axes} are not a one-channel (z, y, x) volume")
        if channel is not None and not 0 <= channel < self.channels:
            raise ImageReadError(f"{self.name}: has {self.channels} channel(s), no channel {channel}")
        index = []
        for a in self.axes:
            index.append({"z": zs, "y": rows, "x": cols, "c": channel or 0}.get(a, 0))
        try:
            box = np.asarray(self.levels[0][tuple(index)])
        except Exception as err:  # codecs and stores raise many types for a damaged chunk
            raise ImageReadError(f"{self.name}: cannot read slices {_span(zs)}, rows {_span(rows)}, columns "
                                 f"{_span(cols)} ({type(err).__name__}: {err})") from err
        kept = [a for a in self.axes if a in "zyx"]
        if "z" not in kept:
            box = box[None]
            kept = ["z"] + kept
        order = [kept.index(a) for a in "zyx"]
        return np.transpose(box, order) if order != [0, 1, 2] else box

    def level_shape(self, level: int) -> tuple[int, int]:
        sizes = dict(zip(self.axes, self.levels[level].shape))
        return sizes["y"], sizes["x"]

    def read(self, rows: slice = slice(None), cols: slice = slice(None), plane: int = 0,
             level: int = 0) -> np.ndarray:
        """Pixels of the region as stored: (h, w) for one channel, (h, w, C) for several."""
        if not 0 <= plane < self.planes:
            raise IndexError(f"{self.name}: plane {plane} of {self.planes}")
        plane_index = np.unravel_index(plane, [self._sizes[a] for a in self.plane_axes]) if self.plane_axes else ()
        index, kept = [], []
        for a in self.axes:
            if a == "y":
                index.append(rows)
            elif a == "x":
                index.append(cols)
            elif a == "c":
                index.append(slice(None) if self.channels > 1 else 0)
            else:
                index.append(int(plane_index[self.plane_axes.index(a)]) if a in self.plane_axes else 0)
                continue
            if a != "c" or self.channels > 1:
                kept.append(a)
        try:
            region = np.asarray(self.levels[level][tuple(index)])
        except Exception as err:  # codecs and stores raise many types for a damaged chunk
            raise ImageReadError(f"{self.name}: cannot read rows {_span(rows)}, columns {_span(cols)} "
                                 f"({type(err).__name__}: {err})") from err
        order = [kept.index(a) for a in "yxc" if a in kept]
        return np.transpose(region, order) if order != list(range(len(order))) else region

    def tiles(self, tile: int | None = None):
        """(rows, cols) slices of the tiles covering one plane, row-major; ``tile`` px (default the
        storage chunk)."""
        th, tw = (tile, tile) if tile else self.chunks
        h, w = self.shape
        for r in range(0, h, th):
            for c in range(0, w, tw):
                yield slice(r, min(r + th, h)), slice(c, min(c + tw, w))


def _span(s: slice) -> str:
    return f"{s.start or 0}:{'end' if s.stop is None else s.stop}"


def _file_key(path: Path, *extra) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|" + "|".join(map(str, extra))


def _check_axes(name: str, axes: str, found) -> str:
    """``axes`` must hold y and x once each and at most one channel axis; else an error naming ``found``."""
    if axes.count("c") > 1:
        raise ImageReadError(f"{name}: more than one channel axis (axes found: {found}); store one channel axis")
    if axes.count("y") != 1 or axes.count("x") != 1 or len(set(axes)) != len(axes):
        raise ImageReadError(f"{name}: no recognisable axis order (axes found: {found}); expected y and x axes, "
                             "at most one channel axis c, and t or z for planes")
    return axes


def _chunks_yx(array, axes: str) -> tuple[int, int]:
    chunks = getattr(array, "chunks", None) or array.shape
    sizes = dict(zip(axes, chunks))
    return int(sizes["y"]), int(sizes["x"])


def check_tiff_pages(tif, name: str) -> None:
    """An :class:`~alibi_vit.images.ImageReadError` naming the first page of a multi-page TIFF whose
    size or dtype differs from the first page's (a stack's slices must share both)."""
    pages = tif.pages
    if len(pages) < 2:
        return
    first = pages[0]
    want = (tuple(first.shape), first.dtype)
    for i in range(1, len(pages)):
        page = pages[i]
        if (tuple(page.shape), page.dtype) != want:
            raise ImageReadError(f"{name}: page {i} is {_describe(page.shape, page.dtype)} but page 0 is "
                                 f"{_describe(*want)}: the pages of a stack must share one size and dtype")


def _describe(shape, dtype) -> str:
    return "×".join(str(int(n)) for n in shape) + f" {np.dtype(dtype).name}"


def _resolution(page, tag: str):
    value = page.tags.get(tag)
    if value is None:
        return None
    num, den = value.value
    return den / num if num and den else None


def _tiff_spacing(tif) -> tuple[float, float, float] | None:
    """(z, y, x) voxel spacing from OME-XML PhysicalSize*, or ImageJ's spacing and resolution tags."""
    if tif.is_ome and tif.ome_metadata:
        import xml.etree.ElementTree as ET

        try:
            root = ET.fromstring(tif.ome_metadata)
        except ET.ParseError:
            root = None
        pixels = next((e for e in root.iter() if e.tag.endswith("Pixels")), None) if root is not None else None
        if pixels is not None:
            sizes = [pixels.get(f"PhysicalSize{a}") for a in "ZYX"]
            if sizes[0] is not None:
                return tuple(float(v) if v is not None else 1.0 for v in sizes)
    meta = tif.imagej_metadata or {}
    if tif.is_imagej and "spacing" in meta:
        page = tif.pages[0]
        y, x = _resolution(page, "YResolution"), _resolution(page, "XResolution")
        return float(meta["spacing"]), float(y or x or 1.0), float(x or y or 1.0)
    return None


def _tiff_level(series, level: int):
    """A zarr array over one pyramid level of a TIFF series. Its store reopens the file to read chunks and
    keeps it open; the file is closed when the array is dropped (else each one left is an "unclosed
    file" ResourceWarning, shown among a run's warnings)."""
    import weakref

    import zarr

    store = series.aszarr(level=level)
    array = zarr.open_array(store, mode="r")
    weakref.finalize(array, store.close)
    return array


def _open_tiff(path: Path, name: str) -> ChunkedImage:
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            found = series.axes
            axes = "".join(_TIFF_AXES.get(a, "z") for a in found)
            axes = _check_axes(name, axes, found)
            # An OME-TIFF pyramid stores reduced levels as SubIFDs (or further series): series.levels.
            if series.dataoffset is not None and len(series.levels) == 1:
                levels = [_MemmapArray(str(path), series.dataoffset, series.shape,
                                       series.dtype.newbyteorder(tif.byteorder))]
                chunks = (min(series.shape[axes.index("y")], _SAMPLE_TILE), min(series.shape[axes.index("x")],
                                                                                  _SAMPLE_TILE))
            else:
                levels = [_tiff_level(series, i) for i in range(len(series.levels))]
                chunks = _chunks_yx(levels[0], axes)
            spacing = _tiff_spacing(tif) if "z" in axes else None
    except ImageReadError:
        raise
    except Exception as err:  # tifffile raises many types for damaged files
        raise ImageReadError(f"{name}: cannot read image ({type(err).__name__}: {err})") from err
    return ChunkedImage(name, axes, levels, _file_key(path, 0), chunks, spacing)


def _ngff_multiscales(attrs) -> list | None:
    if "ome" in attrs and isinstance(attrs["ome"], dict):  # NGFF 0.5 (zarr v3)
        attrs = attrs["ome"]
    ms = attrs.get("multiscales")
    return ms if isinstance(ms, list) and ms else None


def _named_axes(name: str, names) -> str:
    found = ", ".join(str(n) for n in names)
    letters = []
    for n in names:
        letter = _NAMED_AXES.get(str(n).lower())
        if letter is None:
            raise ImageReadError(f"{name}: no recognisable axis order (axes found: {found}); name the axes "
                                 "t, z, c, y, x")
        letters.append(letter)
    return _check_axes(name, "".join(letters), found)


def _ngff_axes(name: str, axes) -> str:
    names = []
    for a in axes:
        if isinstance(a, str):  # NGFF 0.3 listed bare names
            names.append(a)
        elif a.get("type") == "channel":
            names.append("c")
        else:
            names.append(a.get("name", "?"))
    return _named_axes(name, names)


def _array_axes(name: str, array) -> str:
    """Axes of a zarr array without NGFF metadata: its dimension names, else told from its shape."""
    names = getattr(array.metadata, "dimension_names", None) or array.attrs.get("_ARRAY_DIMENSIONS")
    if names and all(n is not None for n in names):
        return _named_axes(name, names)
    shape = array.shape
    if len(shape) == 2:
        return "yx"
    if len(shape) == 3 and shape[-1] in (3, 4) and shape[0] not in (3, 4):
        return "yxc"
    raise ImageReadError(f"{name}: no recognisable axis order (axes found: none, shape {tuple(shape)}); give the "
                         "array OME-Zarr multiscales metadata or dimension names (t, z, c, y, x)")


def _metadata_key(path: Path) -> str:
    marks = [path / m for m in _ZARR_MARKERS if (path / m).is_file()]
    stamp = max((m.stat().st_mtime_ns for m in marks), default=0)
    return f"{path.resolve()}|zarr|{stamp}"


def _open_zarr(source, name: str) -> ChunkedImage:
    import zarr

    try:
        node = zarr.open(source, mode="r") if not isinstance(source, (zarr.Array, zarr.Group)) else source
    except Exception as err:
        raise ImageReadError(f"{name}: cannot open as zarr ({type(err).__name__}: {err})") from err
    key = _metadata_key(Path(source)) if isinstance(source, (str, os.PathLike)) else f"zarr|{id(node)}"
    if isinstance(node, zarr.Array):
        axes = _array_axes(name, node)
        return ChunkedImage(name, axes, [node], key, _chunks_yx(node, axes))
    multiscales = _ngff_multiscales(node.attrs)
    if multiscales is None:
        arrays = [k for k, _ in node.arrays()]
        raise ImageReadError(f"{name}: a zarr group without OME-Zarr multiscales metadata (arrays: "
                             f"{', '.join(arrays) or 'none'}); open one of its arrays, or add the metadata")
    ms = multiscales[0]
    try:
        levels = [node[d["path"]] for d in ms["datasets"]]
    except (KeyError, TypeError) as err:
        raise ImageReadError(f"{name}: its OME-Zarr multiscales metadata names a missing dataset ({err})") from err
    axes = _ngff_axes(name, ms["axes"]) if "axes" in ms else _array_axes(name, levels[0])
    return ChunkedImage(name, axes, levels, key, _chunks_yx(levels[0], axes), _ngff_spacing(ms, axes))


def _ngff_spacing(ms: dict, axes: str) -> tuple[float, float, float] | None:
    """(z, y, x) spacing of level 0: its ``scale`` transform times the multiscale's own, if any."""
    if "z" not in axes:
        return None
    scale = np.ones(len(axes))
    for transforms in (ms["datasets"][0].get("coordinateTransformations", []), ms.get("coordinateTransformations", [])):
        for t in transforms or []:
            if t.get("type") == "scale" and len(t.get("scale", [])) == len(axes):
                scale *= np.asarray(t["scale"], float)
    if np.allclose(scale, 1.0):
        return None
    return tuple(float(scale[axes.index(a)]) for a in "zyx")


def open_image(source) -> ChunkedImage:
    """A :class:`ChunkedImage` over a TIFF/BigTIFF/OME-TIFF file, a zarr/OME-Zarr folder, or a zarr
    array or group already opened; nothing is read but metadata. Any other file, or an unreadable
    one, is an :class:`~alibi_vit.images.ImageReadError` naming it."""
    # zarr is imported only where needed (0.3-0.9 s): a zarr object passed in means it is imported already,
    # and a contiguous TIFF is read by memory map.
    zarr = sys.modules.get("zarr")
    if zarr is not None and isinstance(source, (zarr.Array, zarr.Group)):
        return _open_zarr(source, f"zarr {getattr(source, 'name', '')}".strip())
    path = Path(source)
    if is_zarr_path(path):
        return _open_zarr(str(path), str(path))
    if not path.is_file():
        raise ImageReadError(f"{path}: no such image file or zarr folder")
    if path.suffix.lower() in TIFF_SUFFIXES:
        return _open_tiff(path, str(path))
    raise ImageReadError(f"{path}: not a TIFF or zarr image; PNG and JPEG files are read whole")


def open_volume(source) -> ChunkedImage:
    """A volume (:attr:`ChunkedImage.is_volume`): a multi-page TIFF whose pages share one size and
    dtype (:func:`check_tiff_pages`), a zarr/OME-Zarr with a z axis, a folder of numbered slices
    (:func:`open_slice_folder`), or a zarr array already opened. Anything else is an
    :class:`~alibi_vit.images.ImageReadError` naming what it is."""
    path = None if not isinstance(source, (str, os.PathLike)) else Path(source)
    if path is not None and path.is_dir() and not is_zarr_path(path):
        return open_slice_folder(path)
    if path is not None and path.is_file() and path.suffix.lower() in TIFF_SUFFIXES:
        import tifffile

        try:
            with tifffile.TiffFile(path) as tif:
                if not tif.is_ome:  # an OME-TIFF's pages are described by its XML
                    check_tiff_pages(tif, str(path))
        except ImageReadError:
            raise
        except Exception as err:  # tifffile raises many types for damaged files
            raise ImageReadError(f"{path}: cannot read image ({type(err).__name__}: {err})") from err
    image = open_image(source)
    if not image.is_volume:
        what = "one 2D image" if image.planes == 1 else f"{image.planes} planes along axes {image.plane_axes}"
        raise ImageReadError(f"{image.name} is {what} (axes {image.axes}), not a volume of z slices")
    if image.channels != 1:
        raise ImageReadError(f"{image.name} has {image.channels} channels (axes {image.axes}): volumes are segmented "
                             "in grey; store one channel")
    return image


SLICE_SUFFIXES = (".tif", ".tiff", ".png", ".bmp")
_PIL_DTYPES = {"1": "bool", "L": "uint8", "P": "uint8", "I;16": "uint16", "I;16B": "uint16", "I": "int32",
               "F": "float32"}


def _slice_number(path: Path):
    """Sort key of a slice file: the last number in its name (``img_0012.tif`` → 12), then the name."""
    import re

    numbers = re.findall(r"\d+", path.stem)
    return (int(numbers[-1]) if numbers else -1, path.name)


def _slice_header(path: Path) -> tuple[tuple[int, ...], str]:
    """(shape, dtype name) of one slice file, from its header only."""
    if path.suffix.lower() in (".tif", ".tiff"):
        import tifffile

        with tifffile.TiffFile(path) as tif:
            if len(tif.pages) != 1:
                raise ImageReadError(f"{path}: a slice file must hold one page, it holds {len(tif.pages)}")
            return tuple(tif.pages[0].shape), tif.pages[0].dtype.name
    from PIL import Image

    with Image.open(path) as img:
        if img.mode not in _PIL_DTYPES:
            raise ImageReadError(f"{path}: a {img.mode} image; the slices of a volume must be grey")
        return (img.height, img.width), _PIL_DTYPES[img.mode]


class _SliceFolderArray:
    """(z, y, x) voxels of numbered slice files, read a slice at a time (the last few kept)."""

    KEEP = 32  # decoded slices kept: the boxes of one row of tiles read the same slices again

    def __init__(self, files: list[Path], shape, dtype):
        self.files, self.shape, self.dtype = files, (len(files),) + tuple(shape), np.dtype(dtype)
        self.ndim = 3
        self.chunks = (1,) + tuple(shape)
        self._kept: dict[int, np.ndarray] = {}

    def _slice(self, z: int) -> np.ndarray:
        if z not in self._kept:
            from .images import read_array

            if len(self._kept) >= self.KEEP:
                self._kept.pop(next(iter(self._kept)))
            self._kept[z] = np.asarray(read_array(self.files[z]))
        return self._kept[z]

    def __getitem__(self, index):
        zs, rows, cols = index
        if isinstance(zs, (int, np.integer)):
            return self._slice(int(zs))[rows, cols]
        return np.stack([self._slice(z)[rows, cols] for z in range(*zs.indices(self.shape[0]))])


def open_slice_folder(folder) -> ChunkedImage:
    """A volume from a folder of numbered slice files (TIFF, PNG, BMP; sorted by the last number in
    their names), read lazily. Slices that differ in size or dtype are an
    :class:`~alibi_vit.images.ImageReadError` naming the first that differs."""
    folder = Path(folder)
    files = sorted((p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SLICE_SUFFIXES),
                   key=_slice_number)
    if len(files) < 2:
        raise ImageReadError(f"{folder}: a folder of slices needs at least two image files "
                             f"({', '.join(SLICE_SUFFIXES)}), it has {len(files)}")
    try:
        headers = [_slice_header(p) for p in files]
    except ImageReadError:
        raise
    except Exception as err:  # tifffile and PIL raise many types for damaged files
        raise ImageReadError(f"{folder}: cannot read a slice's header ({type(err).__name__}: {err})") from err
    (shape, dtype), first = headers[0], files[0].name
    if len(shape) != 2:
        raise ImageReadError(f"{folder / first}: a slice of shape {shape}; the slices of a volume must be grey")
    for path, (other, kind) in zip(files[1:], headers[1:]):
        if (other, kind) != (shape, dtype):
            raise ImageReadError(f"{folder}: slice {path.name} is {_describe(other, kind)} but {first} is "
                                 f"{_describe(shape, dtype)}: the slices of a volume must share one size and dtype")
    stamp = max(p.stat().st_mtime_ns for p in files)
    key = f"{folder.resolve()}|slices {len(files)}|{stamp}"
    return ChunkedImage(str(folder), "zyx", [_SliceFolderArray(files, shape, dtype)], key, tuple(shape))


def sample_tiles(image: ChunkedImage, max_pixels: int = 1 << 20, seed: int = 0, plane: int | None = 0,
                 tile: int | None = None):
    """(pixels, tiles read, tiles in all): a seeded random sample of whole tiles of one plane (of
    every plane with ``plane=None``), read until at least ``max_pixels`` pixels are in hand (all
    tiles when the image is smaller).

    ``pixels`` is (1, N) as stored, or (1, N, C) for several channels: an image one row high, so
    the statistics functions of :mod:`alibi_vit.images` take it as they are. Tiles are the storage
    chunks (or ``tile`` px squares; 512 px when the chunks are smaller than 64 or larger than 2048 px)."""
    ch, cw = image.chunks
    if tile is None and not (64 <= min(ch, cw) and max(ch, cw) <= 2048):
        tile = _SAMPLE_TILE
    planes = range(image.planes) if plane is None else [plane]
    tiles = [(p, rows, cols) for p in planes for rows, cols in image.tiles(tile)]
    order = np.random.default_rng(seed).permutation(len(tiles))
    parts, count = [], 0
    for i in order:
        p, rows, cols = tiles[i]
        region = image.read(rows, cols, p)
        parts.append(region.reshape((1, -1) + region.shape[2:]))
        count += region.shape[0] * region.shape[1]
        if count >= max_pixels:
            break
    return np.concatenate(parts, axis=1), len(parts), len(tiles)
