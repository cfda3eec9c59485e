"""``VolumeSegmenter``: trainable segmentation of volumes (X-ray CT, FIB-SEM, confocal stacks) on 3D features.

The tiled engine of :class:`~alibi_vit.trainable.TrainableSegmenter` with one axis more: a volume
is cut into blocks (cores of ``tile`` voxels per axis) and each block's features are computed on
the core plus a halo of the 3D filters' reach per axis (:func:`~alibi_vit.trainable.classical3d.volume_halo`),
so they equal the whole volume's. Per voxel the features are the 3D filter bank
(:mod:`~alibi_vit.trainable.classical3d`) and, with a backbone, ViT features from slices along the
three axes (:mod:`~alibi_vit.trainable.vit3d`). Labels are a sparse label volume (0 = unlabelled),
drawn in any plane; training reads only the blocks that hold labels and computes the features of
the labelled planes only (along the axis where the labels lie in the fewest planes), so scribbles
on a few slices cost a few slices' features. Prediction runs block by block
(:meth:`predict_tiles`, and :func:`~alibi_vit.trainable.stream.segment_to_files`);
:meth:`VolumeSegmenter.plane_proba` predicts one slice in any orientation (what the app shows).

Voxel spacing (z, y, x) scales the filters' σ per axis. A volume's spacing is, in this order:
``spacing`` given to the segmenter (it overrides the files' metadata), the volume's metadata
(:attr:`~alibi_vit.chunked.ChunkedImage.spacing`), the spacing the model was trained with
(``default_spacing``, saved with it), else isotropic.
"""

from __future__ import annotations

import numpy as np

from ..chunked import ChunkedImage
from ..images import scale_intensity, scale_to_range
from .classical import pixel_major
from .classical3d import check_sigmas, check_spacing, volume_feature_names, volume_features, volume_halo
from .segmenter import STROKE_GAP, TrainableSegmenter, _area
from .sources import ArraySource, ChunkedSource, chunked_range
from .tiles import Tile, TileGrid, labelled_boxes
from .vit3d import COMBINE, TriplanarViT

__all__ = ["VOLUME_TILE", "VolumeSegmenter", "is_volume"]

PLANE_TILE = 518  # voxels per side of the blocks one slice is predicted in (one plane thick: a few MB of features)
VOLUME_TILE = 140  # voxels per block side (10 patches): ~3 M voxels, a few hundred MB of features
PLANES_FRACTION = 0.25  # labels in fewer planes than this share of a block's side: featurise those planes only


def is_volume(image) -> bool:
    """Whether ``image`` is a volume: a 3D array (not (H, W, 3|4) colour) or a chunked volume."""
    if isinstance(image, ChunkedImage):
        return image.is_volume
    shape = np.shape(image)
    return len(shape) == 3 and shape[-1] not in (3, 4)


def _flat(volume: np.ndarray) -> np.ndarray:
    """A volume as one (z·y, x) grey image: the 2D intensity functions then treat every voxel alike."""
    return volume.reshape(-1, volume.shape[-1])


class VolumeSegmenter(TrainableSegmenter):
    """Voxel classifier trained from sparse label volumes; see the module docstring.

    Arguments as :class:`~alibi_vit.trainable.TrainableSegmenter`, except: ``sigmas`` are the 3D
    filters' (default :data:`~alibi_vit.trainable.classical3d.VOLUME_SIGMAS`, in units of the
    finest voxel side); ``tile`` is the block side in voxels (default 140); ``spacing`` (z, y, x)
    overrides every volume's own; ``vit_combine`` how the three orientations' ViT features are
    combined (:data:`~alibi_vit.trainable.vit3d.COMBINE`). Volumes are grey (one channel), and the
    dense CRF and user feature functions are for 2D images only.
    """

    dims = 3

    def __init__(self, backbone=None, classifier=None, crf=False, *, spacing=None, tile: int = VOLUME_TILE,
                 vit_combine: str = "mean", filters: str = "volume", colour: str = "grey", feature_fn=None,
                 **kwargs):
        if crf:
            raise ValueError("the dense CRF is for 2D images; for volumes use the modal filter (modal=N)")
        if feature_fn is not None:
            raise ValueError("feature_fn (a user feature function) is for 2D images; volumes take the 3D filters")
        if filters != "volume":
            raise ValueError(f"volumes have one filter set, 'volume' (the 3D bank), not {filters!r}")
        if vit_combine not in COMBINE:
            raise ValueError(f"vit_combine must be one of {', '.join(COMBINE)}, got {vit_combine!r}")
        kwargs.pop("sigma_scale", None)
        if classifier is not None:
            kwargs["classifier"] = classifier
        super().__init__(backbone, crf=False, tile=tile, filters=filters, colour="grey", **kwargs)
        self.spacing = None if spacing is None else check_spacing(spacing)
        self.default_spacing = None  # the training volumes' spacing (saved): for volumes without metadata
        self.vit_combine = vit_combine
        self.triplanar = None if self.vit is None else TriplanarViT(
            self.vit, vit_combine, lambda: self.cache if self.cache is not None else self._scratch)

    def _set_filters(self, filters, sigmas, sigma_scale) -> None:
        self.filters, self.sigmas, self.sigma_scale = "volume", check_sigmas(sigmas), 1.0
        self.halo = None  # per volume: it depends on the spacing (halo_of)

    def config(self) -> dict:
        return {**super().config(), "spacing": None if self.default_spacing is None else list(self.default_spacing),
                "vit_combine": self.vit_combine}

    @classmethod
    def _config_kwargs(cls, cfg: dict) -> dict:
        return {"vit_combine": cfg.get("vit_combine", "mean")}

    def _restore(self, cfg: dict) -> None:
        self.default_spacing = None if cfg.get("spacing") is None else check_spacing(cfg["spacing"])

    # ---- volumes in ----------------------------------------------------------------------------
    def _feature_names(self, channels: int) -> list[str]:
        names = volume_feature_names(self.sigmas)
        if self.triplanar is not None:
            names += self.triplanar.feature_names(self.n_components)
        return names

    def check_channels(self, image, source: str = "volume"):
        """A clear ValueError unless ``image`` is a grey volume (a 3D array or a chunked volume)."""
        if isinstance(image, ChunkedImage):
            if not image.is_volume:
                what = "a 2D image" if image.planes == 1 else f"{image.planes} planes along {image.plane_axes}"
                raise ValueError(f"{source} is {what} (axes {image.axes}) but the model segments volumes (3D "
                                 "features): give a volume, or use a model trained on 2D images")
            if image.channels != 1:
                raise ValueError(f"{source} has {image.channels} channels (axes {image.axes}): volumes are grey")
            return image
        image = np.asarray(image)
        if not is_volume(image):
            raise ValueError(f"{source} has shape {image.shape}: a 2D image, but the model segments volumes (3D "
                             "features); give a (z, y, x) volume, or use a model trained on 2D images")
        if image.dtype.kind not in "uifb":
            raise ValueError(f"{source} has dtype {image.dtype}: expected integers or floats")
        if min(image.shape) < 1:
            raise ValueError(f"{source} is empty (shape {image.shape})")
        return image

    def spacing_of(self, image) -> tuple[float, float, float]:
        """The spacing a volume is featurised with (see the module docstring)."""
        if self.spacing is not None:
            return self.spacing
        own = getattr(image, "spacing", None) if isinstance(image, ChunkedImage) else None
        return check_spacing(own or self.default_spacing)

    def scale(self, image, source: str = "volume") -> np.ndarray:
        """A volume as the float32 (z, y, x) in [0, 1] its features are computed on."""
        image = self.check_channels(image, source)
        if self.intensity != "training":
            return scale_intensity(_flat(image), self.intensity, source=source).reshape(image.shape)
        lo, hi = self._training_range()
        self._warn_dtype(image.dtype, source)
        return scale_to_range(_flat(image), lo, hi, source).reshape(image.shape)

    def source(self, image, name: str = "volume"):
        if isinstance(image, (ArraySource, ChunkedSource)):
            return image
        spacing = self.spacing_of(image)
        if not isinstance(image, ChunkedImage):
            return ArraySource(self.scale(image, name), name, spacing)
        self.check_channels(image, name)
        if self.intensity == "training":
            lo, hi = self._training_range()
            self._warn_dtype(image.dtype, name)
            return ChunkedSource(image, lo, hi, False, spacing=spacing)
        lo, hi, note = chunked_range(image, self.intensity, False, self.seed, plane=None)
        return ChunkedSource(image, lo, hi, False, note=note, spacing=spacing)

    def _prepare(self, images, source="volume", fit: bool = False) -> list:
        from .segmenter import _as_list

        images = [im if isinstance(im, (ArraySource, ChunkedSource)) else
                  self.check_channels(im, im.name if isinstance(im, ChunkedImage) else f"{source} {i}")
                  for i, im in enumerate(_as_list(images, "volumes", 3))]
        if fit:
            self.channels_ = 1
            dtypes = {np.dtype(im.dtype).name for im in images}
            self.intensity_dtype = dtypes.pop() if len(dtypes) == 1 and self.intensity == "training" else None
            if self.intensity == "training" and self.fixed_intensity_range is None:
                self.intensity_range, self.intensity_note = self._fit_range(
                    [im if isinstance(im, ChunkedImage) else _flat(im) for im in images])
            spacings = {self.spacing_of(im) for im in images}
            self.default_spacing = spacings.pop() if len(spacings) == 1 else None
        return [self.source(im, im.name if isinstance(im, ChunkedImage) else f"{source} {i}")
                for i, im in enumerate(images)]

    # ---- features -----------------------------------------------------------------------------
    def halo_of(self, src) -> tuple[int, int, int]:
        """Voxels per axis around a block that its features read (the 3D filters' reach)."""
        return volume_halo(self.sigmas, src.spacing)

    def tile_grid(self, src) -> TileGrid:
        return TileGrid(src.shape, self.tile, self.halo_of(src))

    def _classical_tile(self, src, tile: Tile, axis: int = 0, planes=None) -> list[np.ndarray]:
        inner = tile.inner
        block_planes = None if planes is None else [inner[axis].start + p for p in planes]
        return volume_features(src.read(*tile.outer), self.sigmas, src.spacing, inner=inner, axis=axis,
                               planes=block_planes)

    def _tile_features(self, src, tile: Tile, axis: int = 0, planes=None) -> np.ndarray:
        """(z, y, x, F) features of a block's core (or of its ``planes`` along ``axis``: indices
        within the core), pixel-major: the 3D filters, then the ViT's."""
        planes_3d = self._classical_tile(src, tile, axis, planes)
        if self.triplanar is not None:
            planes_3d += list(self.triplanar.features(src, tile.core, axis, planes))
        shape = planes_3d[0].shape
        flat = pixel_major([p.reshape(-1, shape[-1]) for p in planes_3d])  # (z·y, x, F) without a stacking copy
        return flat.reshape(shape + (flat.shape[-1],))

    def _labelled_rows(self, src, tile: Tile, sel: np.ndarray) -> np.ndarray:
        """Features of the labelled voxels: of the planes holding labels only, along the axis where
        they lie in the fewest planes, when that is a small share of the block."""
        used = [np.flatnonzero(sel.any(axis=tuple(b for b in range(3) if b != a))) for a in range(3)]
        axis = int(np.argmin([len(u) for u in used]))
        if len(used[axis]) > PLANES_FRACTION * sel.shape[axis]:
            return self._tile_features(src, tile)[sel]
        # In each of those planes, boxes around the strokes (as for 2D images), each one plane thick with the
        # filters' reach around it: its features are the block's there, at a fraction of the block's plane (not
        # with ViT features: their windows work per block).
        halos = self.halo_of(src)
        boxes = []
        for k in used[axis] if self.triplanar is None else []:
            for box2d, owned2d in labelled_boxes(np.take(sel, k, axis=axis), STROKE_GAP):
                box = list(box2d)
                box.insert(axis, slice(int(k), int(k) + 1))
                boxes.append((tuple(box), np.expand_dims(owned2d, axis)))
        parts = [tile.part(box, halos, src.shape) for box, _ in boxes]
        side = tile.outer[axis].stop - tile.outer[axis].start
        planes_cost = min(len(used[axis]) * (1 + 2 * halos[axis]), side) * (_area(tile.outer) // side)
        if not parts or sum(_area(p.outer) for p in parts) >= planes_cost:  # boxes would cost as much
            feats = self._tile_features(src, tile, axis, used[axis])
            return feats[np.take(sel, used[axis], axis=axis)]  # sel is empty off those planes: same C order
        return self._rows_in_boxes(sel, boxes, parts, lambda part: self._tile_features(src, part, axis, [0]))

    def _fit_pca(self, sources, labels, labelled) -> None:
        """The ViT PCA, on slices through the labelled voxels of each orientation."""
        from .sources import label_region

        per_source = {}
        for i, tile, _ in labelled:
            y = label_region(labels[i], *tile.core, source=f"labels {i}") > 0
            planes = per_source.setdefault(i, ([], [], []))
            for a in range(3):
                hit = np.flatnonzero(y.any(axis=tuple(b for b in range(3) if b != a)))
                planes[a].extend((hit + tile.core[a].start).tolist())
        self.triplanar.fit_pca([(sources[i], [sorted(set(p)) for p in planes]) for i, planes in per_source.items()])

    def predict_proba(self, images, scaled: bool = False, on_progress=None) -> list[np.ndarray]:
        """Per volume a (Z, Y, X, K) float32 array of class probabilities (held whole: for large
        volumes use :func:`~alibi_vit.trainable.stream.segment_to_files`); ``scaled``: the volumes
        are :meth:`scale`'s output already."""
        from .segmenter import _as_list

        if scaled:
            images = [ArraySource(np.asarray(x, np.float32), "volume", self.spacing_of(x))
                      for x in _as_list(images, "volumes", 3)]
        return super().predict_proba(images, False, on_progress)

    # ---- one slice ----------------------------------------------------------------------------
    def plane_proba(self, image, axis: int, index: int) -> np.ndarray:
        """(rows, cols, K) class probabilities of one slice of a volume: the slice perpendicular to
        ``axis`` (0: an XY slice at z = ``index``; 1: XZ; 2: YZ), from the features of that plane
        only. Raw classifier output (no modal filter)."""
        self._check_fitted()
        with self._call():
            src = self.source(image)
            if not 0 <= index < src.shape[axis]:
                raise IndexError(f"slice {index} of axis {axis} is outside the volume's {src.shape[axis]}")
            # Blocks one plane thick along the axis: only the plane's halo is read and filtered there. In the plane
            # they are at least PLANE_TILE wide: a plane of 512² in one block instead of 16 (their halos cost more
            # than their cores), with the same values (the halo is the filters' reach).
            side = max(self.tile, PLANE_TILE)
            grid = TileGrid(src.shape, [1 if a == axis else side for a in range(3)], self.halo_of(src))
            region = [slice(None)] * 3
            region[axis] = slice(index, index + 1)
            shape = tuple(n for a, n in enumerate(src.shape) if a != axis)
            out = np.empty(shape + (len(self.classes_),), np.float32)
            for tile in grid.covering(tuple(region)):
                feats = self._tile_features(src, tile, axis, [index - tile.core[axis].start])
                p = self.model_.predict_proba(np.ascontiguousarray(feats.reshape(-1, feats.shape[-1]),
                                                                   dtype=self.feature_dtype))
                core2d = tuple(c for a, c in enumerate(tile.core) if a != axis)
                out[core2d] = p.reshape(tuple(c.stop - c.start for c in core2d) + (-1,))
            return out
