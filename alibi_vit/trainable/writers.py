"""Writing results tile by tile: OME-Zarr with a multiscale pyramid, or tiled pyramidal BigTIFF.

:class:`ZarrOutput` is a zarr array written one tile (one chunk) at a time; with ``pyramid`` it is
an OME-Zarr image (NGFF 0.4: zarr v2, axes ``c`` (when there are several channels), ``z`` (a
volume, with its voxel spacing as the scale), ``y``, ``x``) whose reduced levels
:meth:`ZarrOutput.finish` builds from level 0, block by block (each level half the size of the one
above in y and x: class masks keep every second pixel, as label images must; overlays and
probabilities average 2×2 pixels; a volume keeps its slices). Masks carry NGFF ``image-label``
colours (the overlays' palette), so viewers such as napari show the classes in the same colours.

Each chunk is written to a temporary file that then replaces the chunk (zarr's local store does
this), so a write that fails, for example on a full disk, leaves every chunk already written valid.
:func:`zarr_to_tiff` copies a finished pyramid into a tiled, pyramidal OME-TIFF (BigTIFF; reduced
levels as SubIFDs), written under a temporary name and renamed when complete; a volume's level 0
becomes a multi-page TIFF stack instead (:func:`zarr_to_tiff_stack`), page by page. A failed write
is an :class:`OutputError` naming the file and the reason.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

__all__ = ["OutputError", "ZarrOutput", "downsample", "output_error", "zarr_to_tiff", "zarr_to_tiff_stack"]

TIFF_TILE = 512  # px; TIFF tiles are multiples of 16


class OutputError(OSError):
    """An output that could not be written (a full disk, a read-only folder)."""


def output_error(path, err: OSError) -> OutputError:
    """The :class:`OutputError` of a failed write of ``path``: its name and the reason, on one line."""
    reason = err.strerror or str(err) or type(err).__name__
    return OutputError(f"cannot write {path}: {reason}; outputs written before stay valid")


def downsample(block: np.ndarray, nearest: bool) -> np.ndarray:
    """(…, h, w) → (…, ⌈h/2⌉, ⌈w/2⌉): every second pixel, or the mean of 2×2 (edges repeated)."""
    if nearest:
        return block[..., ::2, ::2]
    if block.ndim != 3:
        lead = block.shape[:-2]
        small = downsample(block.reshape((-1,) + block.shape[-2:]), nearest)
        return small.reshape(lead + small.shape[-2:])
    c, h, w = block.shape
    padded = np.pad(block, ((0, 0), (0, h % 2), (0, w % 2)), mode="edge").astype(np.float32)
    mean = padded.reshape(c, -1, 2, padded.shape[2] // 2, 2).mean(axis=(2, 4))
    return mean.round().astype(block.dtype) if block.dtype.kind in "iu" else mean.astype(block.dtype)


class ZarrOutput:
    """An (H, W) or (H, W, C) result, or a volume's (Z, Y, X) or (Z, Y, X, C), written tile by tile
    into a zarr store at ``path``.

    chunk: the chunk side in px (the tiles written should be chunk-aligned, so no chunk is written
    twice). pyramid: write an OME-Zarr image (reduced levels by :meth:`finish`) rather than a bare
    array. nearest: downsample by taking pixels (labels) rather than averaging. colours: (K + 1, 3)
    uint8 palette stored as NGFF image-label colours for class values 1..K. spacing: a volume's
    (z, y, x) voxel spacing, stored as the scale of level 0. channel_classes: the class value each channel
    holds the probability of (probabilities), stored as ``alibi_vit.channel_classes`` and as NGFF ``omero``
    channel labels ``class K`` for viewers, in ``channel_colours`` (a palette as ``colours``) when given.
    """

    def __init__(self, path, shape, dtype, chunk: int, channels: int = 1, *, pyramid: bool = True,
                 nearest: bool = False, colours=None, name: str | None = None, spacing=None, channel_classes=None,
                 channel_colours=None):
        import zarr

        self.path, self.shape, self.channels = Path(path), tuple(int(n) for n in shape), int(channels)
        self.chunk, self.pyramid, self.nearest = int(chunk), pyramid, nearest
        self.spacing = tuple(float(v) for v in spacing) if spacing is not None else (1.0,) * len(self.shape)
        self.name = name or self.path.name
        try:
            if self.path.exists():
                shutil.rmtree(self.path) if self.path.is_dir() else self.path.unlink()
            self.group = zarr.open_group(str(self.path), mode="w", zarr_format=2)
            self.levels = [self._create("0", self.shape, dtype)]
            if pyramid:
                self._write_metadata(colours)
            else:  # a bare array: how many of its axes are spatial, for reopen
                self.group.attrs["spatial_axes"] = len(self.shape)
            if channel_classes is not None:
                self._write_channel_classes([int(c) for c in channel_classes], channel_colours)
        except OSError as err:
            raise output_error(self.path, err) from err
        self._colours = colours

    @classmethod
    def reopen(cls, path) -> "ZarrOutput":
        """A store that an earlier ZarrOutput created (here, or in another process), open for writing
        tiles: its chunk size, channels, pyramid, sampling and colours as it was created with."""
        import zarr

        self = cls.__new__(cls)
        self.path = Path(path)
        try:
            self.group = zarr.open_group(str(self.path), mode="r+", zarr_format=2)
        except Exception as err:  # zarr raises several types for a store that is not there
            raise OutputError(f"cannot open {self.path} ({type(err).__name__}: {err})") from err
        level0 = self.group["0"]
        multiscales = self.group.attrs.get("multiscales")
        spatial = (sum(a["type"] == "space" for a in multiscales[0]["axes"]) if multiscales
                   else int(self.group.attrs.get("spatial_axes", 2)))
        self.channels = level0.shape[0] if level0.ndim == spatial + 1 else 1
        self.shape, self.chunk = tuple(level0.shape[-spatial:]), int(level0.chunks[-1])
        scale = multiscales[0]["datasets"][0]["coordinateTransformations"][0]["scale"] if multiscales else []
        self.spacing = tuple(float(v) for v in scale[-spatial:]) if multiscales else (1.0,) * spatial
        self.pyramid = multiscales is not None
        self.nearest = bool(multiscales) and multiscales[0].get("type") == "nearest"
        self.name = multiscales[0].get("name", self.path.name) if multiscales else self.path.name
        self.levels = [level0]
        label = self.group.attrs.get("image-label")
        self._colours = None
        if label:
            colours = np.zeros((len(label["colors"]) + 1, 3), np.uint8)
            for entry in label["colors"]:
                colours[entry["label-value"]] = entry["rgba"][:3]
            self._colours = colours
        return self

    def _create(self, name: str, shape, dtype):
        lead = (self.channels,) if self.channels > 1 else ()
        return self.group.create_array(name, shape=lead + tuple(shape), chunks=lead + (self.chunk,) * len(shape),
                                       dtype=dtype, fill_value=0,
                                       chunk_key_encoding={"name": "v2", "separator": "/"})

    def _write_metadata(self, colours) -> None:
        spatial = "zyx"[-len(self.shape):]
        axes = ([{"name": "c", "type": "channel"}] if self.channels > 1 else []) + \
               [{"name": a, "type": "space"} for a in spatial]
        lead = [1.0] if self.channels > 1 else []
        reduced = lambda i: [self.spacing[a] * (2.0 ** i if a >= len(self.shape) - 2 else 1.0)  # noqa: E731
                             for a in range(len(self.shape))]  # y and x halve per level, z stays
        datasets = [{"path": str(i), "coordinateTransformations": [{"type": "scale", "scale": lead + reduced(i)}]}
                    for i in range(len(self.levels))]
        attrs = {"multiscales": [{"version": "0.4", "name": self.name, "axes": axes, "datasets": datasets,
                                  "type": "nearest" if self.nearest else "mean"}]}
        if colours is not None:
            colours = np.asarray(colours, np.uint8)
            attrs["image-label"] = {"version": "0.4", "colors": [
                {"label-value": v, "rgba": [int(x) for x in colours[v]] + [255]} for v in range(1, len(colours))]}
        self.group.attrs.update(attrs)

    def _write_channel_classes(self, classes: list[int], colours) -> None:
        if len(classes) != self.channels:
            raise ValueError(f"{self.path}: {len(classes)} channel classes for {self.channels} channels")
        hexes = [("%02X%02X%02X" % tuple(int(v) for v in colours[c][:3])) if colours is not None and c < len(colours)
                 else "FFFFFF" for c in classes]
        self.group.attrs.update({
            "alibi_vit": {"channel_classes": classes},
            "omero": {"version": "0.4", "channels": [
                {"label": f"class {c}", "color": h, "active": True, "window": {"min": 0, "max": 1, "start": 0, "end": 1}}
                for c, h in zip(classes, hexes)]}})

    @property
    def array(self):
        """Level 0 (full resolution), channels first."""
        return self.levels[0]

    def write(self, core, block: np.ndarray) -> None:
        """Write ``block`` ((h, w) or (h, w, C); a volume's (d, h, w) or (d, h, w, C)) at ``core``:
        (rows, cols) or (z, rows, cols) slices of level 0."""
        data = np.moveaxis(block, -1, 0) if self.channels > 1 else block
        index = ((slice(None),) if self.channels > 1 else ()) + tuple(core)
        try:
            self.array[index] = data
        except OSError as err:
            raise output_error(self.path, err) from err

    def read(self, *region: slice) -> np.ndarray:
        """(h, w) or (h, w, C) (a volume's (d, h, w) or (d, h, w, C)) of level 0: the store read back
        (by later passes, or to convert)."""
        data = np.asarray(self.array[((slice(None),) if self.channels > 1 else ()) + region])
        return np.moveaxis(data, 0, -1) if self.channels > 1 else data

    def finish(self) -> Path:
        """Build the reduced levels (until one chunk holds a level) and record them in the metadata."""
        if not self.pyramid:
            return self.path
        try:
            while max(self.levels[-1].shape[-2:]) > self.chunk:
                below = self.levels[-1]
                h, w = below.shape[-2:]
                depth = self.shape[0] if len(self.shape) == 3 else 1
                level = self._create(str(len(self.levels)), self.shape[:-2] + (-(-h // 2), -(-w // 2)), below.dtype)
                step = 2 * self.chunk
                for z in range(0, depth, self.chunk):  # a volume's slices, a chunk of them at a time
                    zs = (slice(z, z + self.chunk),) if len(self.shape) == 3 else ()
                    lead = (slice(None),) * (self.channels > 1) + zs
                    for r in range(0, h, step):
                        for c in range(0, w, step):
                            block = np.asarray(below[lead + (slice(r, r + step), slice(c, c + step))])
                            small = downsample(block, self.nearest)
                            level[lead + (slice(r // 2, r // 2 + small.shape[-2]),
                                          slice(c // 2, c // 2 + small.shape[-1]))] = small
                self.levels.append(level)
            self._write_metadata(self._colours)
        except OSError as err:
            raise output_error(self.path, err) from err
        return self.path


def zarr_to_tiff(source: ZarrOutput, path, *, photometric: str = "minisblack") -> list[Path]:
    """Copy a finished pyramid into tiled, pyramidal OME-TIFF (BigTIFF) at ``path``, block by block.

    ``path`` may be a list of one path per channel: each channel then goes to its own file, rather
    than one file of C samples per pixel (RGB overlays). Returns the files written."""
    import tifffile

    levels = source.levels
    planes = isinstance(path, (list, tuple))
    channels = source.channels if not planes else 1
    outputs = []
    for ch, target in enumerate(path if planes else [path]):
        target = Path(target)

        def tiles(level, ch=ch):
            h, w = level.shape[-2:]
            for r in range(0, h, TIFF_TILE):
                for c in range(0, w, TIFF_TILE):
                    if source.channels == 1:
                        block = np.asarray(level[r:r + TIFF_TILE, c:c + TIFF_TILE])
                    elif planes:
                        block = np.asarray(level[ch, r:r + TIFF_TILE, c:c + TIFF_TILE])
                    else:
                        block = np.moveaxis(np.asarray(level[:, r:r + TIFF_TILE, c:c + TIFF_TILE]), 0, -1)
                    pad = [(0, TIFF_TILE - block.shape[0]), (0, TIFF_TILE - block.shape[1])] + \
                          [(0, 0)] * (block.ndim - 2)
                    yield np.pad(block, pad)

        def write(part):
            with tifffile.TiffWriter(part, bigtiff=True, ome=True) as tif:
                for i, level in enumerate(levels):
                    shape = tuple(level.shape[-2:]) + ((channels,) if channels > 1 else ())
                    options = dict(shape=shape, dtype=level.dtype, tile=(TIFF_TILE, TIFF_TILE),
                                   photometric=photometric, compression="zlib")
                    if i == 0:
                        tif.write(tiles(level), subifds=len(levels) - 1, **options)
                    else:
                        tif.write(tiles(level), subfiletype=1, **options)

        outputs.append(_write_then_rename(target, write))
    return outputs


def _write_then_rename(target: Path, write) -> Path:
    """``write(part)`` a file beside ``target``, then rename it to ``target``: a reader never sees a
    half-written file. A failed write removes the part and raises :class:`OutputError`."""
    part = target.with_name(target.name + ".part")
    try:
        write(part)
        os.replace(part, target)
    except OSError as err:
        part.unlink(missing_ok=True)
        raise output_error(target, err) from err
    return target


def zarr_to_tiff_stack(source: ZarrOutput, path, *, ome: bool = False) -> list[Path]:
    """Copy a volume's level 0 into a multi-page TIFF stack at ``path`` (a page per slice, zlib;
    BigTIFF when it needs it, or always with ``ome``: an OME-TIFF with the voxel spacing), page by
    page. ``path`` may be a list of one path per channel (probabilities: a stack per class)."""
    import tifffile

    level = source.array
    planes = isinstance(path, (list, tuple))
    outputs = []
    for ch, target in enumerate(path if planes else [path]):
        shape = tuple(level.shape[-3:])

        def pages(ch=ch):
            for z in range(shape[0]):
                yield np.asarray(level[ch, z] if source.channels > 1 else level[z])

        nbytes = int(np.prod(shape)) * np.dtype(level.dtype).itemsize
        options = dict(shape=shape, dtype=level.dtype, photometric="minisblack", compression="zlib")
        if ome:
            options["metadata"] = {"axes": "ZYX", **{f"PhysicalSize{a}": v for a, v in zip("ZYX", source.spacing)}}
        def write(part, options=options, pages=pages):
            with tifffile.TiffWriter(part, bigtiff=ome or nbytes > 2 ** 31, ome=ome) as tif:
                tif.write(pages(), **options)

        outputs.append(_write_then_rename(Path(target), write))
    return outputs
