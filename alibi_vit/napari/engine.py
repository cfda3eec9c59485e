"""What the napari widget computes, without napari or Qt: one engine with ``alibi-vit segment``.

The widget's settings are turned into ``alibi-vit segment train`` options and parsed by that
command's own parser (:func:`parse_train_options`), and the segmenter is built from the parsed
options as the command builds it (:func:`build_segmenter`, the constructor calls of
``alibi_vit.cli.segment._train`` and ``_train_volumes``), so defaults, checks and error messages are
the command's: a model trained here is the model ``segment train`` makes from the same strokes saved
as a label image, and ``segment apply`` (or the app) runs it, and the reverse
(:meth:`~alibi_vit.trainable.TrainableSegmenter.save` / ``load``: one folder format).

Images are read as the command reads them (:func:`training_image`): a file the layer came from is
opened lazily when the command would (zarr, TIFFs over 16.8 Mpx) and read whole otherwise; a layer
without a file is its array. Predictions are generators (:func:`predict_region`,
:func:`predict_plane`, :func:`predict_whole`) that yield after each tile, so a worker thread can report
progress and stop between tiles.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "Settings",
    "area_fractions",
    "build_segmenter",
    "parse_train_options",
    "predict_plane",
    "predict_region",
    "predict_whole",
    "scribble_snapshot",
    "training_image",
    "uncertainty_u8",
]

FEATURE_MODES = ("auto", "2d", "3d")
CRF_CHOICES = ("off", "gentle", "paper", "library")
CACHE_BYTES = int(1.5 * 2**30)  # the feature cache, as the app's default --cache-gb 1.5


@dataclass
class Settings:
    """The widget's feature, classifier and CRF settings; every field is a ``segment train`` option."""

    filters: str = "compact"
    classifier: str = "random_forest"
    trees: int | None = None  # None: the classifier's default (15 trees)
    crf: str = "off"  # off, or a preset (gentle, paper, library)
    features: str = "auto"  # auto: volumes on 3D features, 2D images on 2D ones; 2d: volumes slice by slice
    backbone: str | None = None  # a timm name for ViT features, None: classical features only
    checkpoint: str | None = None
    pretrained: bool = False
    allow_random_init: bool = False
    components: int = 9
    seed: int = 0
    spacing: tuple[float, float, float] | None = None  # overrides a volume's metadata, as --spacing
    extra: list[str] = field(default_factory=list)  # further segment train options, as typed

    def options(self) -> list[str]:
        """The ``alibi-vit segment train`` options that train this model (besides --images, --labels, --out)."""
        out = ["--filters", self.filters, "--classifier", self.classifier, "--seed", str(self.seed)]
        if self.trees is not None:
            out += ["--trees", str(self.trees)]
        if self.crf != "off":
            out += ["--crf", self.crf]
        if self.features != "auto":
            out += ["--features", self.features]
        if self.backbone:
            out += ["--backbone", self.backbone, "--components", str(self.components)]
            if self.checkpoint:
                out += ["--checkpoint", self.checkpoint]
            if self.pretrained:
                out += ["--pretrained"]
            if self.allow_random_init:
                out += ["--allow-random-init"]
        if self.spacing is not None:
            out += ["--spacing", ",".join(f"{v:g}" for v in self.spacing)]
        return out + list(self.extra)

    def command(self, images: str, labels: str, out: str) -> str:
        """The shell command that trains the same model from files."""
        words = ["alibi-vit", "segment", "train", "--images", images, "--labels", labels, "--out", out]
        return shlex.join(words + self.options())


class _Refused(Exception):
    pass


class _QuietParser(argparse.ArgumentParser):
    """argparse prints and exits on a bad option; here that becomes a ValueError with its message."""

    def error(self, message):
        raise _Refused(message)


def parse_train_options(options: list[str]) -> argparse.Namespace:
    """``segment train`` options parsed by the command's own parser (its defaults and checks)."""
    from ..cli import segment

    parser = _QuietParser(prog="alibi-vit segment")
    segment.add_arguments(parser)
    try:
        return parser.parse_args(["train", "--images", "-", "--labels", "-", "--out", "-"] + list(options))
    except _Refused as err:
        raise ValueError(f"segment train options {' '.join(options)}: {err}") from None


def build_segmenter(settings: Settings, volume: bool, cache=None, device=None):
    """The segmenter ``segment train`` builds from these options, for a volume (3D features, unless
    ``features`` is 2d) or a 2D image; ``cache`` a :class:`~alibi_vit.trainable.cache.FeatureCache`
    kept between retrainings (it changes no result)."""
    from ..cli import segment

    args = parse_train_options(settings.options())
    features = segment._feature_modes(args)
    if features == "3d" and not volume:
        raise ValueError("3D features are for volumes: this image is 2D (choose auto or 2d)")
    on_3d = volume and features != "2d"
    if on_3d and args.crf:
        raise ValueError("the dense CRF is for 2D images; volumes on 3D features take none (choose CRF off, "
                         "or 2d features)")
    if not on_3d and args.spacing is not None:
        raise ValueError("--spacing is for volumes on 3D features")
    return segment.segmenter_from_args(args, on_3d, segment.backbone_kwargs(args), cache=cache,
                                       device=device or args.device)


def training_image(path: str | None, array, volume: bool):
    """The image as ``segment`` reads it: from its file when the layer came from one (a volume or a
    zarr store or large TIFF lazily, a smaller image whole, as stored), else the layer's array."""
    if path is None:
        return np.asarray(array)
    from ..chunked import open_volume
    from ..cli.segment import _image_format
    from ..images import read_array

    if volume:
        return open_volume(path)
    view = _image_format(Path(path), "auto")[1]
    return view if view is not None else read_array(path)


def volume_slices(image) -> list[np.ndarray]:
    """The slices of a volume as separate 2D images (what ``--features 2d`` trains on)."""
    from ..chunked import ChunkedImage

    if isinstance(image, ChunkedImage):
        return list(image.read_box(slice(None), slice(None), slice(None)))
    return list(np.asarray(image))


def fit(seg, image, labels: np.ndarray, volume: bool):
    """Train ``seg`` on one image (or volume) and its scribbles (0 = unlabelled), as ``segment train``
    does; a volume under a 2D segmenter is trained slice by slice, every slice (its grey values fit
    the intensity range), as the command does with --features 2d."""
    labels = np.asarray(labels)
    if volume and seg.dims == 2:
        seg.fit(volume_slices(image), list(labels.astype(np.int64, copy=False)))
    else:
        seg.fit([image], [labels])
    return seg


def scribble_snapshot(data) -> np.ndarray | None:
    """A copy of a scribble layer's data, None when it holds no stroke. Only the box around the strokes is
    copied: the rest of a mosaic-sized layer stays zeros the system has not allocated (a 16384² layer is
    268 MB). A copy, so strokes drawn while a Train runs go to the next one."""
    from ..trainable.sources import nonzero_along_axes

    data = np.asarray(data)
    occupied = nonzero_along_axes(data)
    if not all(o.any() for o in occupied):
        return None
    box = tuple(slice(int(np.argmax(o)), len(o) - int(np.argmax(o[::-1]))) for o in occupied)
    out = np.zeros(data.shape, data.dtype)
    out[box] = data[box]
    return out


def _part(core, region):
    part = tuple(slice(max(c.start, r.start), min(c.stop, r.stop)) for c, r in zip(core, region))
    return part if all(p.start < p.stop for p in part) else None


def predict_region(seg, image, region):
    """Probabilities of a region ((rows, cols) slices) of a 2D image: yields ``(part, proba)`` for each
    featurisation tile the region overlaps (its part in image coordinates, (h, w, K) float32), the
    classifier's raw output (no CRF: it looks past the region).

    On classical features only the part is featurised, with the filters' reach around it (its values are
    the whole tile's there): a view across four tiles costs its own pixels, not the four tiles'. The cache
    keeps the parts, so a retraining on the same view reads them back."""
    seg._check_fitted()
    with seg._call():  # the scratch state one predict call holds (a ViT's neighbouring windows)
        src = seg.source(image)
        region = tuple(slice(*s.indices(n)[:2]) for s, n in zip(region, src.shape))
        own_part = seg.vit is None and seg._feature_fn is None
        for tile in seg.tile_grid(src).covering(region):
            part = _part(tile.core, region)
            if part is None:
                continue
            if own_part:
                box = tuple(slice(p.start - c.start, p.stop - c.start) for p, c in zip(part, tile.core))
                yield part, seg.tile_proba(src, tile.part(box, (seg.halo,) * 2, src.shape))
            else:
                yield part, seg.tile_proba(src, tile, part)


def predict_whole(seg, image):
    """Probabilities of a whole 2D image, tile by tile: yields ``(done, total, None)`` after each tile,
    then ``(total, total, proba)`` with the whole (H, W, K) float32 array and, when the segmenter has
    one, the dense CRF applied: what :meth:`~alibi_vit.trainable.TrainableSegmenter.predict_proba` (and
    so ``segment apply``) computes, with a chance to stop after every tile."""
    from ..trainable.crf import dense_crf_tiled
    from ..trainable.segmenter import CRF_OVERLAP
    from ..trainable.sources import ArraySource

    seg._check_fitted()
    with seg._call():
        src = seg.source(image)
        tiles = list(seg.tile_grid(src))
        proba = np.empty(tuple(src.shape) + (len(seg.classes_),), np.float32)
        for i, tile in enumerate(tiles):
            proba[tile.core] = seg.tile_proba(src, tile)
            yield i + 1, len(tiles), None
        if seg.crf:  # as predict_proba: the CRF over the whole image, in overlapping tiles
            pixels = src.pixels if isinstance(src, ArraySource) else src.read(slice(None), slice(None))
            proba = dense_crf_tiled(proba, pixels, seg.tile, CRF_OVERLAP, seg.crf, **seg.crf_params)
    yield len(tiles), len(tiles), proba


def predict_plane(seg, image, axis: int, index: int):
    """Probabilities of one slice of a volume, perpendicular to ``axis`` (0: z, 1: y, 2: x) at ``index``: from that
    plane's features with a volume model (:meth:`~alibi_vit.trainable.VolumeSegmenter.plane_proba`), or of that
    slice as a 2D image with a 2D model."""
    if seg.dims == 3:
        return seg.plane_proba(image, axis, index)
    from ..chunked import ChunkedImage

    box = tuple(slice(index, index + 1) if a == axis else slice(None) for a in range(3))
    plane = image.read_box(*box) if isinstance(image, ChunkedImage) else np.asarray(image[box])
    return seg.predict_proba([np.take(plane, 0, axis=axis)])[0]


def uncertainty_u8(proba: np.ndarray) -> np.ndarray:
    """1 − max probability as uint8 (0 certain, 255 for 1; at most 255·(1 − 1/K))."""
    return np.round((1.0 - proba.max(-1)) * 255).astype(np.uint8)


def area_fractions(mask: np.ndarray, classes) -> dict[int, tuple[int, float]]:
    """Per class value: (pixels, fraction of the pixels predicted) of a mask (0 = not predicted)."""
    values, counts = np.unique(mask[mask > 0], return_counts=True)
    counted = dict(zip(values.tolist(), counts.tolist()))
    total = max(sum(counted.values()), 1)
    return {int(c): (int(counted.get(int(c), 0)), counted.get(int(c), 0) / total) for c in classes}
