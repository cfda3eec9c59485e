"""ViT features of volumes: the backbone on slices along the three axes, combined per voxel (docs/method.md §7).

A 2D backbone sees a volume as three stacks of slices: XY slices (one per z), XZ slices (one per
y) and YZ slices (one per x). Each slice goes through the 2D path of
:mod:`~alibi_vit.trainable.vit` unchanged: the same fixed grid of windows, patch features,
standardisation and PCA (one PCA for all three orientations, fitted on slices of each through the
labelled voxels), bilinear upsampling to the slice's pixels. A voxel so gets one feature vector
per orientation, from the three slices through it, and they are combined by ``combine``:

- ``"mean"`` (default): the average of the three, ``n_components`` features;
- ``"concat"``: the three side by side, 3·``n_components`` features;
- ``"xy"``: the XY slices only (what a slice-by-slice segmentation sees), ``n_components``.

Why ``mean`` is the default: it keeps the 2D path's feature count (the classifier sees as many ViT
features beside the 3D filters as beside the 2D ones) and treats the three orientations alike, so
a voxel's features do not depend on which axis the volume was stored along, while a structure
seen edge-on in one orientation still shifts the average. ``concat`` keeps the orientations apart
at three times the features; ``xy`` is the slice-by-slice baseline. The choice is not yet backed
by a measurement with pretrained weights (the project's machines had none when volumes were
added): ``python benchmarks/bench_volumes.py accuracy --backbone NAME --checkpoint FILE`` scores
the three on the volume benchmark.

Each slice's projected patch map (``n_components`` values per patch: a 512² slice holds 50 KB) is
computed once, from the whole slice, and cached; a block's features are its slices' maps
upsampled over the block. So a block's features equal the whole volume's, whatever the block.
Slices are taken in voxels as stored: with anisotropic voxels XZ and YZ slices look stretched to
the backbone.
"""

from __future__ import annotations

import numpy as np

from .cache import array_digest

__all__ = ["COMBINE", "TriplanarViT", "slice_axes"]

COMBINE = ("mean", "concat", "xy")
ORIENTATION_NAMES = ("xy", "xz", "yz")  # the slice through a voxel perpendicular to axis 0, 1, 2
PCA_SLICES = 8  # slices per orientation whose patches fit the PCA


def slice_axes(axis: int) -> tuple[int, int]:
    """The two volume axes that are a slice's rows and columns, for slices perpendicular to ``axis``."""
    return tuple(a for a in range(3) if a != axis)


class TriplanarViT:
    """Per-voxel ViT features of a volume source from a fitted :class:`~alibi_vit.trainable.vit.ViTFeatures`.

    cache(): the :class:`~alibi_vit.trainable.cache.FeatureCache` for the slices' patch maps (the
    segmenter's), or None."""

    def __init__(self, vit, combine: str, cache):
        if combine not in COMBINE:
            raise ValueError(f"combine must be one of {', '.join(COMBINE)}, got {combine!r}")
        self.vit, self.combine, self._cache = vit, combine, cache

    @property
    def axes(self) -> tuple[int, ...]:
        return (0,) if self.combine == "xy" else (0, 1, 2)

    def n_features(self, n_components: int) -> int:
        return n_components * (3 if self.combine == "concat" else 1)

    def feature_names(self, n_components: int) -> list[str]:
        if self.combine == "concat":
            return [f"vit_{o}_pc{i}" for o in ORIENTATION_NAMES for i in range(n_components)]
        return [f"vit_pc{i}" for i in range(n_components)]

    def _patch(self) -> int:
        return int(self.vit.model.patch_embed.patch_size[0])

    def raw_map(self, src, axis: int, index: int, keep: bool = False) -> np.ndarray:
        """(C, gh, gw) backbone patch features of one whole slice: from the cache, else computed (and
        with ``keep`` stored: they are 40 times the size of the projected map)."""
        rows_axis, cols_axis = slice_axes(axis)
        shape = (src.shape[rows_axis], src.shape[cols_axis])
        p = self._patch()

        def read(rows, cols):
            region = [slice(None)] * 3
            region[axis], region[rows_axis], region[cols_axis] = slice(index, index + 1), rows, cols
            return np.squeeze(src.read(*region), axis=axis)

        def compute():
            from .vit import patch_map  # (PyTorch, imported where ViT features are asked for)

            gh, gw = -(-shape[0] // p), -(-shape[1] // p)
            return patch_map(self.vit.model, read, shape, slice(0, gh), slice(0, gw), tile=self.vit.tile,
                             overlap=self.vit.overlap, device=self.vit.device)

        cache, key = self._cache(), f"vit3d raw|{src.key}|{axis}|{index}"
        if cache is None:
            return compute()
        if keep:
            return cache.get(key, compute)
        return cache.get(key, lambda: None) if key in cache else compute()

    def _projected(self, src, axis: int, index: int) -> np.ndarray:
        """(n_components, gh, gw) projected patch map of one slice (cached)."""
        compute = lambda: self.vit.project(self.raw_map(src, axis, index))  # noqa: E731
        cache = self._cache()
        key = f"vit3d pca|{src.key}|{axis}|{index}|{array_digest(self.vit.components_, self.vit.mean_)}"
        return compute() if cache is None else cache.get(key, compute)

    def fit_pca(self, src_planes) -> None:
        """Fit the standardisation and PCA on the patches of slices through the labelled voxels:
        ``src_planes`` is [(source, [indices along z, y, x of labelled planes] per axis)]; at most
        :data:`PCA_SLICES` evenly spaced ones per orientation and volume."""
        rows = []
        for src, planes in src_planes:
            for axis in self.axes:
                found = np.asarray(sorted(planes[axis]))
                if not len(found):
                    continue
                pick = found[np.unique(np.linspace(0, len(found) - 1, min(PCA_SLICES, len(found))).round().astype(int))]
                for index in pick:
                    m = self.raw_map(src, axis, int(index), keep=True)
                    rows.append(m.reshape(m.shape[0], -1).T)
        self.vit.fit_patch_matrix(np.concatenate(rows))

    def features(self, src, core, axis: int = 0, planes=None) -> np.ndarray:
        """(F, *shape) features of the voxels of ``core`` ((z, y, x) slices), or only its ``planes``
        (indices within the core along ``axis``)."""
        from .vit import upsample_patches  # (PyTorch, imported where ViT features are asked for)

        p = self._patch()
        span = [np.arange(c.start, c.stop) for c in core]
        if planes is not None:
            span[axis] = span[axis][np.asarray(planes)]
        shape = tuple(len(s) for s in span)
        out = None
        for orient in self.axes:
            rows_axis, cols_axis = slice_axes(orient)
            r, c = span[rows_axis], span[cols_axis]
            block = np.empty((self.vit.n_components,) + shape, np.float32)
            for i, index in enumerate(span[orient]):
                z = self._projected(src, orient, int(index))
                gh, gw = z.shape[1:]
                a0, b0 = max(r[0] // p - 1, 0), max(c[0] // p - 1, 0)
                a1, b1 = min(r[-1] // p + 2, gh), min(c[-1] // p + 2, gw)
                up = upsample_patches(z[:, a0:a1, b0:b1], p, (a0, b0), slice(r[0], r[-1] + 1),
                                      slice(c[0], c[-1] + 1))
                up = up[:, r - r[0]][:, :, c - c[0]]  # the rows and columns wanted (all, or some planes)
                index_out = [slice(None)] * 4
                index_out[1 + orient] = i
                block[tuple(index_out)] = up
            if out is None:
                out = block
            elif self.combine == "concat":
                out = np.concatenate([out, block])
            else:
                out += block
        return out / len(self.axes) if self.combine == "mean" else out
