"""Display levels of an image: what the page shows at the zoom on screen, one tile at a time.

Level 0 is the image; level L + 1 halves level L (sizes rounded up, each pixel the mean of 2 × 2,
the last row or column repeated). The page asks for tiles of ``TILE``² px of the level that
matches its zoom (:func:`level_shapes`, :func:`tile_region`), so what it is sent grows with the
window, never with the image.

- An image read whole (an array): its levels are computed from it once, in memory.
- A chunked image (:class:`~alibi_vit.chunked.ChunkedImage`): a level that the file stores (an
  OME-Zarr or pyramidal OME-TIFF level of that size, or one row or column smaller) is read where
  a tile asks, only the storage chunks the tile touches. A level the file does not store is built
  tile by tile as the tiles are asked for, into a zarr store in the session folder, so each of its
  tiles is computed once: a level ``COARSE`` times or more coarser than the nearest finer level the
  file stores is read from a few rows of that level (the middle row of each block, averaged along
  the row: 1/``COARSE`` of the pixels or less), so a big file without a pyramid is shown zoomed out
  at once instead of after a read of the whole image; a finer one is built from the level below it
  (each pixel the mean of 2 × 2), when it is asked for.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np

from ..chunked import ChunkedImage
from ..trainable.writers import downsample
from .errors import SessionError
from .scheduler import request_checkpoint

__all__ = ["TILE", "Pyramid", "level_shapes", "tile_region"]

TILE = 512  # px of a display tile, at its level
COARSE = 8  # a level the file lacks, at least this many times coarser than a level it stores, is read strided
ROW_SAMPLES = 8  # pixels of a block's middle row averaged into a pixel of such a coarse level


def level_shapes(shape) -> list[tuple[int, int]]:
    """(rows, columns) of each display level: halved (rounded up) until one tile holds the level."""
    shapes = [(int(shape[0]), int(shape[1]))]
    while max(shapes[-1]) > TILE:
        h, w = shapes[-1]
        shapes.append((-(-h // 2), -(-w // 2)))
    return shapes


def tile_region(shapes, level: int, row: int, col: int) -> tuple[slice, slice]:
    """The rows and columns of tile (``row``, ``col``) of ``level``; a 404 SessionError when there is none."""
    if not 0 <= level < len(shapes):
        raise SessionError(f"no display level {level}: this image has levels 0 to {len(shapes) - 1}", status=404)
    h, w = shapes[level]
    if not (0 <= row < -(-h // TILE) and 0 <= col < -(-w // TILE)):
        raise SessionError(f"no tile ({row}, {col}) at level {level} ({w}×{h} px in tiles of {TILE})", status=404)
    return slice(row * TILE, min((row + 1) * TILE, h)), slice(col * TILE, min((col + 1) * TILE, w))


def _halve(block: np.ndarray) -> np.ndarray:
    """(h, w) or (h, w, C) → half the size, each pixel the mean of 2 × 2 (the last row/column repeated)."""
    if block.ndim == 2:
        return downsample(block[None], nearest=False)[0]
    return np.moveaxis(downsample(np.moveaxis(block, -1, 0), nearest=False), 0, -1)


def _pad_to(block: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``block`` grown to rows × cols by repeating its last row and column (a stored level one
    pixel smaller than the display level: the file rounded the halved size down)."""
    pad = [(0, rows - block.shape[0]), (0, cols - block.shape[1])] + [(0, 0)] * (block.ndim - 2)
    return np.pad(block, pad, mode="edge") if any(p[1] for p in pad) else block


class Pyramid:
    """The display levels of one image (an array or a chunked image), read or built tile by tile.

    folder: where the levels a chunked image does not store are built (a zarr group; it names the
    image it belongs to, and is rebuilt when the image's file has changed)."""

    def __init__(self, image, folder: Path | None = None):
        self.image = image
        self.chunked = isinstance(image, ChunkedImage)
        shape = image.shape if self.chunked else image.shape[:2]
        self.shapes = level_shapes(shape)
        self.folder = Path(folder) if folder is not None else None
        self._arrays = [image]  # an array's levels, computed once
        self._stored = {}  # display level → stored level of a chunked image
        self._built = {}  # display level → zarr array built in ``folder``
        self._locks: dict = {}
        self._lock = threading.Lock()
        if self.chunked:
            for level, (h, w) in enumerate(self.shapes):
                for s in range(len(image.levels)):
                    sh, sw = image.level_shape(s)
                    if h - 1 <= sh <= h and w - 1 <= sw <= w:
                        self._stored[level] = s
                        break

    @property
    def built_levels(self) -> list[int]:
        """The display levels a chunked image's file does not store (built into ``folder``)."""
        return [level for level in range(len(self.shapes)) if self.chunked and level not in self._stored]

    def region(self, level: int, rows: slice, cols: slice) -> np.ndarray:
        """Pixels of a region of ``level`` as stored ((h, w) or (h, w, C)); slices within the level."""
        if not self.chunked:
            return self._array(level)[rows, cols]
        if level in self._stored:
            s = self._stored[level]
            sh, sw = self.image.level_shape(s)
            block = self.image.read(slice(rows.start, min(rows.stop, sh)), slice(cols.start, min(cols.stop, sw)),
                                    level=s)
            return _pad_to(block, rows.stop - rows.start, cols.stop - cols.start)
        array = self._level_store(level)
        for r in range(rows.start // TILE, -(-rows.stop // TILE)):
            for c in range(cols.start // TILE, -(-cols.stop // TILE)):
                self._build(level, r, c, array)
        return np.asarray(array[rows, cols])

    def _array(self, level: int) -> np.ndarray:
        with self._lock:
            while len(self._arrays) <= level:
                self._arrays.append(_halve(self._arrays[-1]))
            return self._arrays[level]

    # ---- levels built into the session folder ----------------------------------------------------
    def _level_store(self, level: int):
        import zarr

        with self._lock:
            if level in self._built:
                return self._built[level]
            if self.folder is None:
                raise ValueError("a chunked image without that pyramid level needs a folder to build it in")
            group = None
            if (self.folder / ".zgroup").is_file():
                group = zarr.open_group(str(self.folder), mode="r+")
                if group.attrs.get("source") != self.image.key:
                    group = None  # the image's file changed: its levels are built again
            if group is None:
                shutil.rmtree(self.folder, ignore_errors=True)
                group = zarr.open_group(str(self.folder), mode="w", zarr_format=2)
                group.attrs["source"] = self.image.key
            h, w = self.shapes[level]
            channels = (self.image.channels,) if self.image.channels > 1 else ()
            name = str(level)
            if name in group:
                array = group[name]
            else:  # empty chunks are written too: a chunk file on disk is a tile built
                array = group.create_array(name, shape=(h, w) + channels, chunks=(TILE, TILE) + channels,
                                           dtype=self.image.dtype, fill_value=0,
                                           chunk_key_encoding={"name": "v2", "separator": "/"},
                                           config={"write_empty_chunks": True})
            self._built[level] = array
            return array

    def _build(self, level: int, r: int, c: int, array) -> None:
        """Tile (r, c) of a built level, from the level below, unless it is on disk already."""
        done = self.folder / str(level) / str(r) / str(c)
        if done.exists():
            return
        with self._lock:
            lock = self._locks.setdefault((level, r, c), threading.Lock())
        with lock:  # a tile asked for twice at once is built once (locks are taken coarse level first)
            if done.exists():
                return
            request_checkpoint()  # the request that wants it has gone: stop (a coarse tile can take the whole image)
            rows, cols = tile_region(self.shapes, level, r, c)
            coarse = self._coarse_source(level)
            if coarse is not None:
                array[rows, cols] = self._strided(rows, cols, *coarse)
                return
            below_h, below_w = self.shapes[level - 1]
            below = self.region(level - 1, slice(2 * rows.start, min(2 * rows.stop, below_h)),
                                slice(2 * cols.start, min(2 * cols.stop, below_w)))
            array[rows, cols] = _halve(below)

    def _coarse_source(self, level: int) -> tuple[int, int] | None:
        """(finer display level the file stores, stride) when ``level`` is read strided from it (it is at
        least COARSE times coarser), else None (built from the level below)."""
        finer = max(s for s in self._stored if s < level)  # level 0, the image itself, is always stored
        stride = 1 << (level - finer)
        return (finer, stride) if stride >= COARSE else None

    def _strided(self, rows: slice, cols: slice, finer: int, stride: int) -> np.ndarray:
        """Pixels of a region of a coarse level read from the stored level ``finer``: each pixel the mean
        of ROW_SAMPLES pixels, evenly spaced, along the middle row of its stride × stride block there (one
        row in ``stride`` is read: a contiguous file or a file of strips reads no other row)."""
        level = self._stored[finer]
        sh, sw = self.image.level_shape(level)
        n_rows, n_cols = rows.stop - rows.start, cols.stop - cols.start
        step = max(1, stride // ROW_SAMPLES)
        per_block = stride // step
        y0 = min(rows.start * stride + stride // 2, sh - 1)
        x0 = min(cols.start * stride + step // 2, sw - 1)
        block = self.image.read(slice(y0, min(y0 + (n_rows - 1) * stride + 1, sh), stride),
                                slice(x0, min(cols.stop * stride, sw), step), level=level)
        block = _pad_to(block, n_rows, n_cols * per_block)  # the last block of the image: edge repeated
        samples = block.reshape((n_rows, n_cols, per_block) + block.shape[2:]).astype(np.float32)
        mean = samples.mean(axis=2)
        return mean.round().astype(block.dtype) if block.dtype.kind in "iub" else mean.astype(block.dtype)
