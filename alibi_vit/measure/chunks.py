"""The blocks a mask is measured in: a grid of cores covering it once, each read with a halo on its far sides.

A pair of voxels ``(p, p + r·e_axis)`` is counted by the block whose *core* holds ``p``; the halo (``r``
voxels past the core on each far side, clipped at the mask's edge) holds its partner. Every pair is then
counted exactly once, so sums over blocks equal the whole-array result. Core sides are multiples of the
fraction cells, so each cell lies in one block.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import numpy as np

__all__ = ["Block", "block_side", "blocks"]

# Default core sides: a block of about 4 MB of uint8 values plus its halo keeps memory small and numpy fast.
DEFAULT_SIDE_2D = 1024
DEFAULT_SIDE_3D = 128


@dataclass(frozen=True)
class Block:
    index: tuple[int, int, int]  # position in the grid of blocks
    core: tuple[slice, slice, slice]  # (z, y, x) voxels this block counts
    read: tuple[slice, slice, slice]  # core plus the halo on the far sides, clipped to the mask

    @property
    def core_shape(self) -> tuple[int, int, int]:
        return tuple(s.stop - s.start for s in self.core)


def block_side(ndim: int, cell: int, requested: int | None = None) -> int:
    """The core side: ``requested`` (or the default) rounded up to a multiple of ``cell``."""
    side = requested or (DEFAULT_SIDE_2D if ndim == 2 else DEFAULT_SIDE_3D)
    return max(cell, -(-side // cell) * cell)


def blocks(shape: tuple[int, int, int], side: int, halo: int):
    """The :class:`Block` s covering ``shape`` (z, y, x) in raster order; a 2D mask (z = 1) has one z layer."""
    sides = (1 if shape[0] == 1 else side, side, side)
    counts = [-(-n // s) for n, s in zip(shape, sides)]
    for index in product(*(range(c) for c in counts)):
        core = tuple(slice(i * s, min((i + 1) * s, n)) for i, s, n in zip(index, sides, shape))
        read = tuple(slice(c.start, min(c.stop + halo, n)) for c, n in zip(core, shape))
        yield Block(tuple(index), core, read)


def grid_shape(shape: tuple[int, int, int], side: int) -> tuple[int, int, int]:
    sides = (1 if shape[0] == 1 else side, side, side)
    return tuple(-(-n // s) for n, s in zip(shape, sides))


def core_view(values: np.ndarray, block: Block) -> np.ndarray:
    """The core part of a block read with its halo."""
    return values[tuple(slice(0, n) for n in block.core_shape)]
