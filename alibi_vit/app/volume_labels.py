"""Label volumes held and stored sparsely: only the ``BLOCK``³ blocks that hold a label.

Scribbles in a volume cover a few slices of it: a 512³ label volume is 134 MB as one array, while
the strokes of a session touch a few dozen 64³ blocks. :class:`SparseVolumeLabels` keeps the blocks
with a non-zero label and is replaced on change, never written in place (:meth:`painted` returns a
new one sharing the untouched blocks), so a reader (training on another thread) always sees one
consistent label volume. It reads like a (z, y, x) array (``shape``, ``dtype``, ``labels[zs, ys,
xs]``), so :class:`~alibi_vit.chunked.ChunkedImage` wraps it and training reads it block by block.

A stroke drawn on a slice is painted into the plane it was drawn on: XY (perpendicular to z, axis
0), XZ (axis 1, rows = z, columns = x) or YZ (axis 2, rows = z, columns = y): the 2D footprint
gets a third axis of length 1 at the slice's index.

On disk the label volume is one zarr array (uint8, 0 = unlabelled, chunks of ``BLOCK``³, axes
named z, y, x) of which only the blocks holding a label exist: what ``segment train`` reads as the
labels of a volume. Each change rewrites the blocks it touched.
"""

from __future__ import annotations

import numpy as np

from .labels import BlockLabels

__all__ = ["BLOCK", "SparseVolumeLabels", "plane_index"]

BLOCK = 64  # voxels per block side: a stroke on one slice touches a row of blocks (64 × 512² = 16 MB at most)


def plane_index(axis: int, index: int, rows=slice(None), cols=slice(None)) -> tuple:
    """The (z, y, x) index of rows × cols of the slice ``index`` perpendicular to ``axis``."""
    if axis not in (0, 1, 2):
        raise ValueError(f"axis must be 0 (XY), 1 (XZ) or 2 (YZ), got {axis!r}")
    out = [rows, cols]
    out.insert(axis, index)
    return tuple(out)


class SparseVolumeLabels(BlockLabels):
    """A (Z, Y, X) uint8 label volume of which only the ``BLOCK``³ blocks holding a label are kept.

    ``blocks`` maps a block's (z, y, x) index to its array; a block that is all 0 is not kept.
    Treat it as immutable: :meth:`painted` makes the changed copy. ``any``, ``counts`` and
    ``write`` and ``export`` as for 2D labels (:class:`~alibi_vit.app.labels.BlockLabels`)."""

    dtype = np.dtype(np.uint8)
    ndim = 3
    axes = "zyx"

    def __init__(self, shape, blocks: dict | None = None):
        self.shape = tuple(int(n) for n in shape)
        self.chunks = (BLOCK,) * 3
        self.blocks: dict[tuple[int, int, int], np.ndarray] = dict(blocks or {})

    def __getitem__(self, index) -> np.ndarray:
        """The labels of a box ``labels[zs, ys, xs]`` (slices with step 1, or integers, which drop
        their axis), as a new array."""
        box, keep = [], []
        for i, n in zip(index, self.shape):
            if isinstance(i, (int, np.integer)):
                i = int(i) + n if i < 0 else int(i)
                box.append(slice(i, i + 1))
                keep.append(False)
            else:
                box.append(slice(*i.indices(n)[:2]))
                keep.append(True)
        out = np.zeros(tuple(max(s.stop - s.start, 0) for s in box), np.uint8)
        for key, block in self.blocks.items():
            own = self._box(key)
            lo = [max(a.start, b.start) for a, b in zip(own, box)]
            hi = [min(a.stop, b.stop) for a, b in zip(own, box)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            out[tuple(slice(low - b.start, h - b.start) for low, h, b in zip(lo, hi, box))] = \
                block[tuple(slice(low - a.start, h - a.start) for low, h, a in zip(lo, hi, own))]
        return out[tuple(slice(None) if k else 0 for k in keep)]

    def __array__(self, dtype=None, copy=None):
        whole = self[slice(None), slice(None), slice(None)]
        return whole if dtype is None else whole.astype(dtype)

    def plane(self, axis: int, index: int) -> np.ndarray:
        """The labels of one slice (rows, cols) perpendicular to ``axis``."""
        return self[plane_index(axis, index)]

    def painted(self, axis: int, index: int, pieces, value: int) -> "SparseVolumeLabels":
        """A copy with ``value`` painted (0 erases) on the slice ``index`` perpendicular to ``axis``
        where the boolean masks of ``pieces`` [(row, column, mask)] in that slice's coordinates are
        set; blocks left all 0 are dropped."""
        if not 0 <= index < self.shape[axis]:
            raise ValueError(f"slice {index} is outside the volume's {self.shape[axis]} along axis {axis}")
        out = SparseVolumeLabels(self.shape, self.blocks)
        for row, col, mask in pieces:
            origin = list(plane_index(axis, index, row, col))
            mask3 = np.expand_dims(mask, axis)
            ends = [o + m for o, m in zip(origin, mask3.shape)]
            ranges = [range(o // BLOCK, -(-e // BLOCK)) for o, e in zip(origin, ends)]
            for key in ((a, b, c) for a in ranges[0] for b in ranges[1] for c in ranges[2]):
                own = self._box(key)
                part = mask3[tuple(slice(max(s.start - o, 0), s.stop - o) for s, o in zip(own, origin))]
                if not part.any():
                    continue
                block = out.blocks.get(key)
                block = np.zeros(tuple(s.stop - s.start for s in own), np.uint8) if block is None else block.copy()
                start = [max(o - s.start, 0) for o, s in zip(origin, own)]
                block[tuple(slice(s, s + n) for s, n in zip(start, part.shape))][part] = value
                if block.any():
                    out.blocks[key] = block
                else:
                    out.blocks.pop(key, None)
        return out
