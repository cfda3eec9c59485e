"""Connected objects of each phase, labelled block by block and stitched across block borders.

Objects are face-connected (4-neighbours in 2D, 6 in 3D): two voxels of a phase that touch only at an edge or
a corner are separate objects, the conservative reading of a voxel mask. Each block is labelled with
``scipy.ndimage.label`` (:func:`block_objects`, wherever the block is measured: on a scheduler's worker too);
an object's raw moments (voxel count, sums of coordinates and of their products) and its bounding box add up
over the blocks it spans, and the labels that meet across a block face are joined
(``scipy.sparse.csgraph.connected_components``). From the merged moments come the properties
``skimage.measure.regionprops_table`` gives for a whole array (area, centroid, equivalent diameter, axis
lengths, orientation; the tests check they agree), in the mask's physical units.

An object whose bounding box reaches the edge of the measured region is flagged ``border``: it is cut, and
its size is a lower bound. An object reaching both faces along an axis spans the region along it, which is
what :mod:`.transport` reports as percolation.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ObjectLabels", "block_labels", "block_objects"]

_PRODUCTS = ((0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2))


def block_labels(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Labels ``1..n`` of the objects in a block's core ``values``, phase after phase (every voxel has one), and
    the phase of each label (index 0 unused). The same block always gets the same labels."""
    from scipy import ndimage

    labels = np.zeros(values.shape, np.int64)
    phases, count = [np.zeros(1, np.uint8)], 0
    for phase in np.flatnonzero(np.bincount(values.ravel())):
        local, n = ndimage.label(values == phase)
        np.add(labels, local + count, out=labels, where=local > 0)
        phases.append(np.full(n, phase, np.uint8))
        count += n
    return labels, np.concatenate(phases)


def block_objects(values: np.ndarray, origin, axes, intensity: np.ndarray | None = None) -> dict:
    """What one block contributes to the objects (:meth:`ObjectLabels.add`): its labels' phases and moments
    (``origin``: the block's first voxel in the mask), and its labels on its near and far face along each of
    ``axes``, to join with its neighbours'. ``intensity``: the image's values on the core, summed per label."""
    from scipy import ndimage

    labels, phases = block_labels(values)
    n = len(phases)
    local = labels.ravel()
    coords = [np.broadcast_to((np.arange(size) + o).reshape([-1 if a == i else 1 for a in range(3)]),
                              labels.shape).ravel().astype(np.float64)
              for i, (size, o) in enumerate(zip(labels.shape, origin))]
    part = {"phases": phases[1:], "count": np.bincount(local, minlength=n)[1:]}
    part["sums"] = np.stack([np.bincount(local, c, n)[1:] for c in coords], axis=1)
    part["products"] = np.stack([np.bincount(local, coords[i] * coords[j], n)[1:] for i, j in _PRODUCTS], axis=1)
    if intensity is not None:
        part["intensity"] = np.bincount(local, intensity.ravel().astype(np.float64), n)[1:]
    boxes = ndimage.find_objects(labels)
    part["low"] = np.array([[s.start + o for s, o in zip(b, origin)] for b in boxes], np.int64).reshape(-1, 3)
    part["high"] = np.array([[s.stop + o for s, o in zip(b, origin)] for b in boxes], np.int64).reshape(-1, 3)
    part["near"] = {axis: np.take(labels, 0, axis=axis) for axis in axes}
    part["far"] = {axis: np.take(labels, -1, axis=axis) for axis in axes}
    return part


class ObjectLabels:
    """The objects of a mask from its blocks' :func:`block_objects`, added in any order: each block's labels
    become provisional labels after those of the blocks added before it, and labels that meet across a block
    face are joined once both blocks are in. ``grid``: the blocks per (z, y, x) axis."""

    def __init__(self, shape: tuple[int, int, int], ndim: int, grid: tuple[int, int, int]):
        self.shape, self.ndim, self.grid = shape, ndim, tuple(grid)
        self.axes = (0, 1, 2) if ndim == 3 else (1, 2)
        self.count = 0  # provisional labels so far (label 0 is background)
        self.offsets: dict[tuple, int] = {}  # block index → its provisional labels' offset
        self.parts: list[dict] = []
        self.waiting: dict[tuple, np.ndarray] = {}  # (side, block index, axis) → a face's labels, until its neighbour
        self.joins: list[np.ndarray] = []
        # Per provisional label: its phase, and its place in raster order (block rank, label in block), which
        # numbers the objects the same whatever order the blocks came in.
        self._phase_of = np.zeros(1024, np.uint8)
        self._order_key = np.zeros(1024, np.int64)

    @property
    def phase_of(self) -> np.ndarray:
        return self._phase_of[: self.count + 1]

    def _grow(self, n: int) -> None:
        if self.count + n + 1 > len(self._phase_of):
            size = max(2 * len(self._phase_of), self.count + n + 1)
            self._phase_of = np.concatenate([self._phase_of, np.zeros(size - len(self._phase_of), np.uint8)])
            self._order_key = np.concatenate([self._order_key, np.zeros(size - len(self._order_key), np.int64)])

    def add(self, index: tuple[int, int, int], part: dict) -> None:
        """Add block ``index``'s :func:`block_objects`."""
        n, offset = len(part["phases"]), self.count
        self._grow(n)
        self._phase_of[offset + 1: offset + n + 1] = part["phases"]
        rank = int(np.ravel_multi_index(index, self.grid))
        self._order_key[offset + 1: offset + n + 1] = (rank << 32) + np.arange(1, n + 1)
        self.offsets[tuple(index)], self.count = offset, offset + n
        faces = {"near": part.pop("near"), "far": part.pop("far")}
        part["labels"] = np.arange(offset + 1, offset + n + 1)
        self.parts.append(part)
        for axis in self.axes:
            for side, step, other in (("near", -1, "far"), ("far", 1, "near")):
                neighbour = tuple(i + step * (a == axis) for a, i in enumerate(index))
                if not 0 <= neighbour[axis] < self.grid[axis]:
                    continue
                mine = faces[side][axis] + offset
                theirs = self.waiting.pop((other, neighbour, axis), None)
                if theirs is None:
                    self.waiting[(side, tuple(index), axis)] = mine
                else:
                    self._join(mine, theirs)

    def _join(self, mine: np.ndarray, theirs: np.ndarray) -> None:
        pairs = np.stack([mine.ravel(), theirs.ravel()], axis=1)
        pairs = pairs[self.phase_of[pairs[:, 0]] == self.phase_of[pairs[:, 1]]]
        self.joins.append(np.unique(pairs, axis=0))

    def block_ids(self, values: np.ndarray, index) -> np.ndarray:
        """The provisional labels of block ``index``'s core ``values`` (after :meth:`add`), for the instance labels."""
        return block_labels(values)[0] + self.offsets[tuple(index)]

    def resolve(self, spacing, min_size: int = 0) -> tuple[dict, np.ndarray]:
        """The objects' table (columns as arrays) and the map from provisional labels to object ids
        (0 for objects under ``min_size`` voxels)."""
        from scipy import sparse
        from scipy.sparse import csgraph

        self.waiting.clear()
        n = self.count + 1
        joins = np.concatenate(self.joins) if self.joins else np.zeros((0, 2), np.int64)
        graph = sparse.coo_matrix((np.ones(len(joins)), (joins[:, 0], joins[:, 1])), shape=(n, n))
        _, component = csgraph.connected_components(graph, directed=False)
        labels = np.concatenate([p["labels"] for p in self.parts]) if self.parts else np.zeros(0, np.int64)
        owner = component[labels]
        # Components numbered in raster order of their first voxel's block and label: the same ids whatever
        # order the blocks were added in.
        firsts = np.full(n, np.iinfo(np.int64).max, np.int64)
        np.minimum.at(firsts, owner, self._order_key[labels])
        order = np.argsort(firsts, kind="stable")
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n)
        owner = rank[owner]
        m = int(owner.max()) + 1 if len(owner) else 0

        def total(key):
            values = np.concatenate([p[key] for p in self.parts])
            if values.ndim == 1:
                return np.bincount(owner, values, m)
            return np.stack([np.bincount(owner, values[:, k], m) for k in range(values.shape[1])], axis=1)

        count, sums, products = total("count"), total("sums"), total("products")
        low = np.full((m, 3), np.iinfo(np.int64).max)
        high = np.zeros((m, 3), np.int64)
        np.minimum.at(low, owner, np.concatenate([p["low"] for p in self.parts]))
        np.maximum.at(high, owner, np.concatenate([p["high"] for p in self.parts]))
        phase = np.zeros(m, np.int64)
        phase[owner] = self.phase_of[labels]
        present = count > 0
        kept = present & (count >= max(min_size, 1))
        ids = np.zeros(m, np.int64)
        ids[kept] = np.arange(1, kept.sum() + 1)
        mapping = np.zeros(n, np.int64)
        mapping[labels] = ids[owner]
        table = _properties(count[kept], sums[kept], products[kept], low[kept], high[kept], phase[kept],
                            self.shape, self.ndim, np.asarray(spacing, float))
        if self.parts and "intensity" in self.parts[0]:
            table["intensity_mean"] = total("intensity")[kept] / count[kept]
        table["id"] = np.arange(1, kept.sum() + 1)
        table["dropped_small"] = int((present & ~kept).sum())
        return table, mapping


def _properties(count, sums, products, low, high, phase, shape, ndim, spacing) -> dict:
    axes = [0, 1, 2] if ndim == 3 else [1, 2]
    count = count.astype(float)
    mean = sums / count[:, None]
    cov = np.zeros((len(count), 3, 3))
    for k, (i, j) in enumerate(_PRODUCTS):
        cov[:, i, j] = cov[:, j, i] = (products[:, k] / count - mean[:, i] * mean[:, j]) * spacing[i] * spacing[j]
    cov = cov[:, axes][:, :, axes]
    eigen = np.clip(np.linalg.eigvalsh(cov), 0, None) if len(count) else np.zeros((0, len(axes)))
    voxel = float(np.prod(spacing[axes]))
    size = count * voxel
    table = {"phase": phase, "voxels": count.astype(np.int64), "size": size}
    if ndim == 2:
        table["equivalent_diameter"] = np.sqrt(4 * size / np.pi)
        table["axis_major_length"] = 4 * np.sqrt(eigen[:, -1])
        table["axis_minor_length"] = 4 * np.sqrt(eigen[:, 0])
        # Angle of the major axis to the row axis (regionprops' convention), radians in [-π/2, π/2].
        c_yy, c_xx, c_yx = cov[:, 0, 0], cov[:, 1, 1], cov[:, 0, 1]
        table["orientation"] = np.where(c_yy == c_xx, np.where(c_yx > 0, np.pi / 4, -np.pi / 4),
                                        0.5 * np.arctan2(2 * c_yx, c_yy - c_xx))
    else:
        table["equivalent_diameter"] = np.cbrt(6 * size / np.pi)
        table["axis_major_length"] = np.sqrt(20 * eigen[:, -1])
        table["axis_minor_length"] = np.sqrt(20 * eigen[:, 0])
    table["aspect_ratio"] = np.divide(table["axis_major_length"], table["axis_minor_length"],
                                      out=np.full(len(count), np.inf), where=table["axis_minor_length"] > 0)
    for a in axes:
        table[f"centroid_{'zyx'[a]}"] = mean[:, a] * spacing[a]
    for a in axes:
        table[f"bbox_{'zyx'[a]}0"], table[f"bbox_{'zyx'[a]}1"] = low[:, a], high[:, a]
    table["border"] = np.any([(low[:, a] == 0) | (high[:, a] == shape[a]) for a in axes], axis=0) \
        if len(count) else np.zeros(0, bool)
    for a in axes:
        table[f"spans_{'zyx'[a]}"] = (low[:, a] == 0) & (high[:, a] == shape[a])
    return table
