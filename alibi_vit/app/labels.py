"""Label images of big images, held and stored sparsely: only the blocks that hold a label.

A label image of a 16384² image would take 268 MB as one array (and as one PNG per stroke);
scribbles cover a tiny part of it. :class:`SparseLabels` keeps the label image as blocks of
``BLOCK``² px, only those with a non-zero label, and is replaced on change, never written in place
(:meth:`SparseLabels.painted` returns a new one sharing the untouched blocks), so a reader holding
one always sees a consistent label image. It reads like an array (``shape``, ``dtype``,
``chunks``, ``labels[rows, cols]``), so :class:`~alibi_vit.chunked.ChunkedImage` can wrap it and the
tiled engine reads labels tile by tile from it as from a stored label image.

On disk it is a zarr array (``labels/<id>.zarr`` in the session folder: uint8, 0 = unlabelled,
chunks of ``BLOCK``² px) of which only the blocks that hold a label exist; each change rewrites
the blocks it touched (each chunk file is replaced atomically).

:func:`pooled_labels` gives the labels at a display level (each pixel the largest label value of
its 2^level × 2^level block, so a thin stroke stays visible when zoomed out), for a dense label
array or a sparse one (block by block: never the whole label image at once).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

__all__ = ["BLOCK", "BlockLabels", "SparseLabels", "pooled_labels"]

BLOCK = 512  # px: the blocks labels are held in, and the chunks of their zarr store (= the display tile)


class BlockLabels:
    """What label images kept as blocks share (:class:`SparseLabels`, and the volumes'
    :class:`~alibi_vit.app.volume_labels.SparseVolumeLabels`): ``blocks`` maps a block's index to
    its array, a block all 0 is not kept, and ``write(path)`` stores them as a zarr array."""

    blocks: dict
    shape: tuple
    chunks: tuple  # the block's size per axis (= the zarr store's chunks)
    axes: str  # the axis names, stored with the zarr array

    def _box(self, key) -> tuple[slice, ...]:
        """The slices of the block at ``key`` (its index per axis)."""
        return tuple(slice(k * b, min((k + 1) * b, n)) for k, b, n in zip(key, self.chunks, self.shape))

    def write(self, path: Path, before: "BlockLabels | None" = None) -> None:
        """Write the blocks that differ from ``before`` (all, without it) into the zarr store at
        ``path`` (uint8, chunks of one block, its axes named); a block gone since ``before`` is
        written as zeros (zarr then removes its file)."""
        import zarr

        path = Path(path)
        if before is None or not path.exists():
            store = zarr.create_array(str(path), shape=self.shape, chunks=self.chunks, dtype=np.uint8, fill_value=0,
                                      zarr_format=2, overwrite=True, chunk_key_encoding={"name": "v2", "separator": "/"})
            store.attrs["_ARRAY_DIMENSIONS"] = list(self.axes)  # so readers know the axes (chunked.open_image)
            keys = list(self.blocks)
        else:
            store = zarr.open_array(str(path), mode="r+")
            keys = [k for k in set(self.blocks) | set(before.blocks) if self.blocks.get(k) is not before.blocks.get(k)]
        for key in keys:
            block = self.blocks.get(key)
            store[self._box(key)] = block if block is not None else 0

    def any(self) -> bool:
        return bool(self.blocks)

    def counts(self) -> np.ndarray:
        """Pixels per label value 0..255 (0 counts only the pixels of the blocks kept)."""
        total = np.zeros(256, np.int64)
        for block in self.blocks.values():
            total += np.bincount(block.ravel(), minlength=256)
        return total

    def export(self, path: Path) -> Path:
        """A complete zarr label store at ``path`` (written beside it, then renamed)."""
        path = Path(path)
        partial = path.with_name(f".{path.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            self.write(partial)
            shutil.rmtree(path, ignore_errors=True)
            partial.rename(path)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return path


class SparseLabels(BlockLabels):
    """An (H, W) uint8 label image of which only the ``BLOCK``² blocks holding a label are stored.

    ``blocks`` maps (block row, block column) to its (≤ BLOCK, ≤ BLOCK) array; a block that is
    all 0 is not kept. Treat it as immutable: :meth:`painted` makes the changed copy."""

    dtype = np.dtype(np.uint8)
    ndim = 2
    axes = "yx"

    def __init__(self, shape, blocks: dict | None = None):
        self.shape = (int(shape[0]), int(shape[1]))
        self.chunks = (BLOCK, BLOCK)
        self.blocks: dict[tuple[int, int], np.ndarray] = dict(blocks or {})

    def _block_slices(self, r: int, c: int) -> tuple[slice, slice]:
        return self._box((r, c))

    def _keys_in(self, rows: slice, cols: slice):
        return [(r, c) for (r, c) in self.blocks
                if r * BLOCK < rows.stop and rows.start < (r + 1) * BLOCK
                and c * BLOCK < cols.stop and cols.start < (c + 1) * BLOCK]

    def __getitem__(self, index) -> np.ndarray:
        """The labels of a region, ``labels[rows, cols]`` (slices with step 1), as a new array."""
        rows, cols = (slice(*s.indices(n)[:2]) for s, n in zip(index, self.shape))
        out = np.zeros((max(rows.stop - rows.start, 0), max(cols.stop - cols.start, 0)), np.uint8)
        for r, c in self._keys_in(rows, cols):
            br, bc = self._block_slices(r, c)
            r0, r1 = max(br.start, rows.start), min(br.stop, rows.stop)
            c0, c1 = max(bc.start, cols.start), min(bc.stop, cols.stop)
            out[r0 - rows.start:r1 - rows.start, c0 - cols.start:c1 - cols.start] = \
                self.blocks[r, c][r0 - br.start:r1 - br.start, c0 - bc.start:c1 - bc.start]
        return out

    def __array__(self, dtype=None, copy=None):
        whole = self[slice(None), slice(None)]
        return whole if dtype is None else whole.astype(dtype)

    def painted(self, pieces, value: int) -> "SparseLabels":
        """A copy with ``value`` painted where the boolean masks of ``pieces`` [(row, column, mask)]
        are set (0 erases); blocks left all 0 are dropped."""
        out = SparseLabels(self.shape, self.blocks)
        for row, col, mask in pieces:
            rows, cols = slice(row, row + mask.shape[0]), slice(col, col + mask.shape[1])
            for r in range(row // BLOCK, -(-rows.stop // BLOCK)):
                for c in range(col // BLOCK, -(-cols.stop // BLOCK)):
                    br, bc = self._block_slices(r, c)
                    part = mask[max(br.start - row, 0):br.stop - row, max(bc.start - col, 0):bc.stop - col]
                    if not part.any():
                        continue
                    block = out.blocks.get((r, c))
                    block = np.zeros((br.stop - br.start, bc.stop - bc.start), np.uint8) if block is None \
                        else block.copy()
                    r0, c0 = max(row - br.start, 0), max(col - bc.start, 0)
                    block[r0:r0 + part.shape[0], c0:c0 + part.shape[1]][part] = value
                    if block.any():
                        out.blocks[r, c] = block
                    else:
                        out.blocks.pop((r, c), None)
        return out


def _max_pool(block: np.ndarray, factor: int) -> np.ndarray:
    """The largest value of each ``factor``² block (edges padded with 0)."""
    if factor == 1:
        return block
    h, w = block.shape
    padded = np.pad(block, ((0, -h % factor), (0, -w % factor)))
    return padded.reshape(padded.shape[0] // factor, factor, padded.shape[1] // factor, factor).max(axis=(1, 3))


def pooled_labels(labels, level: int, rows: slice, cols: slice) -> np.ndarray:
    """The labels at display ``level`` (factor 2^level) in the region ``rows`` × ``cols`` of that
    level: each pixel the largest label value of its block. ``labels``: an (H, W) array or
    :class:`SparseLabels` (pooled block by block)."""
    f = 1 << level
    if not isinstance(labels, SparseLabels):
        return _max_pool(np.asarray(labels)[rows.start * f:rows.stop * f, cols.start * f:cols.stop * f], f)
    out = np.zeros((rows.stop - rows.start, cols.stop - cols.start), np.uint8)
    region = slice(rows.start * f, rows.stop * f), slice(cols.start * f, cols.stop * f)
    for r, c in labels._keys_in(*region):  # BLOCK is a multiple of f up to level 9: blocks pool whole
        small = _max_pool(labels.blocks[r, c], f)
        top, left = r * BLOCK // f - rows.start, c * BLOCK // f - cols.start
        t0, l0 = max(top, 0), max(left, 0)
        t1, l1 = min(top + small.shape[0], out.shape[0]), min(left + small.shape[1], out.shape[1])
        if t1 > t0 and l1 > l0:
            out[t0:t1, l0:l1] = np.maximum(out[t0:t1, l0:l1], small[t0 - top:t1 - top, l0 - left:l1 - left])
    return out
