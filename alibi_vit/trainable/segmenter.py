"""``TrainableSegmenter``: Weka/ilastik-style pixel classification on classical ⊕ ViT features.

The method: docs/method.md §7.

Images go in as arrays ((H, W) of any integer or float dtype, or RGB) or as chunked images too
large for memory (:class:`~alibi_vit.chunked.ChunkedImage`: TIFF/BigTIFF/OME-TIFF, zarr/OME-Zarr),
and are scaled to [0, 1] by ``intensity`` (by default black and white points fitted once on the
training images and stored with the model); label images use the Weka/ilastik convention:
0 = unlabelled, 1..K = classes.

The tiled engine: every image is cut into tiles (:class:`~alibi_vit.trainable.tiles.TileGrid`,
cores of ``tile`` px) and each tile's features are computed on the core plus a halo of
:func:`~alibi_vit.trainable.classical.halo` px (the filter bank's reach), so they equal the whole
image's exactly; ViT features come from a fixed grid of backbone windows in image coordinates
(:func:`~alibi_vit.trainable.vit.patch_map`), so they too equal the whole image's. Training reads
only the tiles that hold labels, and featurises only boxes around the labels in them (classical features
without a cache: strokes are sparse); prediction runs tile by tile
(:meth:`TrainableSegmenter.predict_tiles`, and :mod:`~alibi_vit.trainable.stream`, which writes
results as it goes). Memory depends on the tile size and the number of features, not the image's size.
"""

from __future__ import annotations

import importlib
import json
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm.auto import tqdm

from .classical import (classical_feature_names, classical_features_torch, classical_planes, filter_set, halo,
                        pixel_major)
from .classifier import (CLASSIFIERS, DEFAULT_CLASSIFIER, fit_classifier, import_in_background,
                         load_classifier_in_background)
from .crf import CRF_DEFAULTS, CRF_PRESETS, dense_crf_tiled
from ..chunked import ChunkedImage, sample_tiles
from ..images import INTENSITY_MODES, fit_intensity_range, scale_colour, scale_to_range
from ..runtime import thread_budget
from .cache import FeatureCache
from .io import as_grayscale, to_unit_float
from .sources import ArraySource, ChunkedSource, chunked_range, label_region, labels_shape, nonzero_along_axes
from .tiles import Tile, TileGrid, labelled_boxes

if TYPE_CHECKING:  # torch is imported where a backbone needs it
    import torch.nn as nn

__all__ = ["INTENSITY", "TrainableSegmenter", "modal_filter", "resolve_feature_fn", "sample_quotas"]

FORMAT_VERSION = 2  # 2: intensity "training" with its fitted range stored; 1 (per-image modes only) still loads
READABLE_FORMATS = (1, 2)
# "training": black/white points fitted on the pooled training pixels, stored, applied unchanged;
# the others scale each image by itself (alibi_vit.images).
INTENSITY = ("training",) + INTENSITY_MODES
COLOUR = ("channels", "grey")
# crf=True means this preset, the one chosen on the labelled micrograph set (docs/segmentation.md); it was "paper"
# before, and models saved with a preset name keep theirs.
DEFAULT_CRF_PRESET = "gentle"
DEFAULT_CRF = False  # the CRF setting of a segmenter made without one
CRF_OVERLAP = 128  # px of context on each side of a CRF tile
CHANNEL_NAMES = ("r", "g", "b")
PATCH_ALIGN = 14  # tile sizes are multiples of DINOv2's patch, so a tile's patch range is whole patches
STROKE_GAP = 64  # labelled pixels within about twice this share one featurised box (about a halo: two boxes cost more)
PREDICT_BAND = 256  # rows of a tile made pixel-major and classified at a time, without a cache
VIT_WINDOW_BYTES = 256 << 20  # without a cache: backbone windows kept for the neighbouring tiles of one call
DEFAULT_FILTERS = "compact"  # chosen on the labelled micrograph set's training split (docs/segmentation.md)


_KINDS: dict[int, type] = {}  # segmenter class by the dimensions of its images (2: this module's; 3: volumes)


def default_device() -> str:
    """"cuda" when torch sees a GPU, else "cpu"; without importing torch (seconds) where no GPU driver is
    installed: Linux without NVIDIA's (/proc/driver/nvidia), AMD's (/dev/kfd) or WSL2's GPU (/dev/dxg) driver
    has no GPU torch can use, so the classical features' CPU path there starts without PyTorch."""
    import os
    import sys

    drivers = ("/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
    if "torch" not in sys.modules and sys.platform.startswith("linux") and not any(map(os.path.exists, drivers)):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _area(region) -> int:
    return int(np.prod([s.stop - s.start for s in region], dtype=np.int64))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def sample_quotas(counts, cap: int) -> np.ndarray:
    """How many pixels of each class to keep so that at most ``cap`` are kept in all, stratified:
    every class gets an equal share, and what a small class cannot use goes to the larger ones
    (water-filling). A class with fewer pixels than its share keeps them all."""
    counts = np.asarray(counts, np.int64)
    keep = np.zeros_like(counts)
    budget, left = int(cap), len(counts)
    for c in np.argsort(counts, kind="stable"):
        keep[c] = min(counts[c], budget // left)
        budget -= int(keep[c])
        left -= 1
    return keep


def resolve_feature_fn(spec):
    """(import path "module:function", the function) of a user feature hook given as either."""
    if callable(spec):
        module, name = getattr(spec, "__module__", None), getattr(spec, "__qualname__", "")
        if not module or "<" in name or module == "__main__":
            raise ValueError(f"feature_fn {spec!r} cannot be saved by import path: define it at the top level of an "
                             "importable module (the model stores 'module:function', never a pickle)")
        spec = f"{module}:{name}"
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"feature_fn must be a function or 'module:function', got {spec!r}")
    module, name = spec.split(":")
    try:
        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"feature_fn {spec!r} cannot be imported ({err})") from None
    if not callable(fn):
        raise ValueError(f"feature_fn {spec!r} is not callable")
    return spec, fn


def modal_filter(mask: np.ndarray, size: int) -> np.ndarray:
    """Majority (modal) filter: each pixel takes the most frequent value in the size×size window
    around it (borders mirrored, scipy's "reflect"); ties go to the smallest value."""
    from scipy import ndimage as ndi

    if size < 1 or size % 2 == 0:
        raise ValueError(f"the modal filter's size must be odd and positive, got {size}")
    best_count = np.full(mask.shape, -1.0, np.float32)
    best = np.zeros_like(mask)
    for v in np.unique(mask):  # ascending: a later value must beat, not tie, the count so far
        count = ndi.uniform_filter((mask == v).astype(np.float32), size, mode="reflect")
        better = count > best_count + 1e-4 / (size * size)  # counts are multiples of 1/size²: beat by a pixel
        best[better], best_count[better] = v, count[better]
    return best


def _is_colour(image) -> bool:
    if isinstance(image, ArraySource):
        return image.pixels.ndim == 3
    if isinstance(image, ChunkedSource):
        return image.colour
    return image.channels > 1 if isinstance(image, ChunkedImage) else np.ndim(image) == 3


def _stored_dtype(image) -> np.dtype:
    """The stored pixels' type of an image, a chunked image or a source."""
    return image.image.dtype if isinstance(image, ChunkedSource) else np.dtype(image.dtype)


def _as_list(items, what: str, dims: int = 2) -> list:
    """A list of images: one 2D (or (H, W, 3|4) RGB) array counts as one image (with ``dims=3``, one
    3D array as one volume); other arrays are ambiguous."""
    if isinstance(items, np.ndarray):
        if dims == 3 and items.ndim == 3:
            return [items]
        if dims == 2 and (items.ndim == 2 or (items.ndim == 3 and items.shape[-1] in (3, 4))):
            return [items]
        expected = "(z, y, x) volumes" if dims == 3 else "2D images (the slices of a 3D stack as separate images)"
        raise ValueError(f"{what}: got one array of shape {items.shape}; pass a list of {expected}")
    return list(items)


class TrainableSegmenter:
    """Pixel classifier trained from sparse labels.

    backbone: None (classical features only), a model name for :func:`alibi_vit.create_backbone`
        (with ``checkpoint``/``pretrained``/``model_kwargs``), or an ``nn.Module`` that
        :func:`alibi_vit.patch_features` accepts.
    classifier: "random_forest" (default: XGBoost's random-forest mode) or "xgboost" (boosting); extra
        settings in ``classifier_params`` (see :mod:`~alibi_vit.trainable.classifier`). Classes are
        balanced by sample weights.
    crf: refine probabilities with a dense CRF, tiled like the features (``tile`` px cores, 128 px
        overlap; :func:`~alibi_vit.trainable.crf.dense_crf_tiled`): False (default), a preset name
        ("gentle": chosen on the labelled micrograph set, keeps thin phases; "paper": the paper
        notebook's sxy values; "library": the authors' backend library's defaults; see
        :mod:`~alibi_vit.trainable.crf`), or True for "gentle". ``crf_params`` overrides single values.
    filters: the classical filter set, "compact" (default, 29 features) or "weka" (the paper's 63;
        models saved before filter sets existed load as "weka"); see :mod:`~alibi_vit.trainable.classical`.
    sigmas, sigma_scale: the classical filters' scales, by default the filter set's own.
    n_components: ViT PCA components (default 9). vit_tile, vit_overlap: ViT tiling in px.
    intensity: how images become [0, 1] floats. "training" (default): black and white points are the
        0.01/99.99th percentiles of the training images' pooled grey values, fitted by fit(), stored
        as ``intensity_range`` and applied unchanged to every image segmented, so a grey level means
        the same in every image whatever mix of phases it holds. Per-image modes (each image scaled
        by itself, see :mod:`alibi_vit.images`): "auto" (a 0.5–99.5th percentile stretch for
        grayscale, dtype for colour), "percentile", "minmax", "dtype".
    tile: core size in px of the featurisation tiles (default 1036 = 74 patches, so a 1024-px image is
        one tile); bounds memory.
    max_samples: at most this many labelled pixels train the classifier: a seeded random subset,
        stratified by class (:func:`sample_quotas`), drawn from the label images before any feature
        is computed, so training memory depends on this cap, not on how many pixels are labelled.
    colour: "channels" (default): colour (RGB(A)) images are featurised per channel (the classical
        filters on each of R, G, B; ViT features from the RGB image); a model trained on colour
        images refuses grayscale ones and the reverse. "grey": colour becomes luma first, any image
        goes.
    feature_dtype: dtype the gathered training features are stored in (float32; float16 halves memory).
    device: where the backbone runs ("cuda" when available, else "cpu").
    feature_fn: a user feature hook: a function (defined at the top level of an importable module)
        or its import path "module:function", called on each image as scaled (float32 in [0, 1],
        (H, W) or (H, W, 3)) and returning (H, W, F) features appended to the others. Saved by
        import path, never pickled; it runs on the whole image (not tiled).
    modal: post-processing of predict(): a majority filter of this odd window size (0: none).
    classical_backend: "auto" (default: the torch filter bank on a CUDA ``device``, OpenCV otherwise;
        torch on CPU is slower), "cpu" (OpenCV; "scipy" is its former name) or "torch"
        (:func:`~alibi_vit.trainable.classical.classical_features_torch`, equal to float32 rounding).
        A runtime choice, not saved with the model.
    seed: seeds subsampling and the classifier. progress: show progress bars.
    intensity_range: with intensity "training", a fixed (lo, hi) that fit() keeps instead of fitting
        one (the app fits it once on all of a session's images, so features computed when an image is
        opened stay valid whatever is labelled later). Saved like a fitted one.
    cache: a :class:`~alibi_vit.trainable.cache.FeatureCache` that keeps the classical features of
        each tile and the backbone's window features between calls (interactive retraining); entries
        are keyed by the image (its scaled pixels' digest, or a chunked file's identity and scaling),
        the tile and the settings, so results are exactly those without it. Runtime only.
    """

    def __init__(self, backbone=None, classifier: str = DEFAULT_CLASSIFIER, crf: bool | str = DEFAULT_CRF, *,
                 checkpoint=None,
                 pretrained: bool = False, model_kwargs: dict | None = None, classifier_params: dict | None = None,
                 crf_params: dict | None = None, filters: str = DEFAULT_FILTERS, sigmas=None, sigma_scale=None,
                 n_components: int = 9, vit_tile: int = 518, vit_overlap: int = 56, intensity: str = "training",
                 tile: int = 1036, max_samples: int = 500_000, feature_dtype=np.float32, device=None, seed: int = 0,
                 progress: bool = False, colour: str = "channels", classical_backend: str = "auto",
                 feature_fn=None, modal: int = 0, intensity_range=None, cache=None):
        if classifier not in CLASSIFIERS:
            raise ValueError(f"classifier must be one of {CLASSIFIERS}, got {classifier!r}")
        if intensity not in INTENSITY:
            raise ValueError(f"unknown intensity mode {intensity!r}; choose one of {', '.join(INTENSITY)}")
        if classical_backend not in ("auto", "cpu", "scipy", "torch"):
            raise ValueError(f"classical_backend must be auto, cpu or torch, got {classical_backend!r}")
        self.feature_fn, self._feature_fn = resolve_feature_fn(feature_fn) if feature_fn is not None else (None, None)
        self.n_user_features = None  # set by fit()
        if modal and (modal < 0 or modal % 2 == 0):
            raise ValueError(f"modal must be 0 (off) or an odd window size, got {modal}")
        self.modal = int(modal or 0)
        if colour not in COLOUR:
            raise ValueError(f"colour must be one of {', '.join(COLOUR)}, got {colour!r}")
        if crf_params and set(crf_params) - set(CRF_DEFAULTS):
            raise ValueError(f"unknown CRF parameters {sorted(set(crf_params) - set(CRF_DEFAULTS))}")
        if tile < PATCH_ALIGN:
            raise ValueError(f"tile must be at least {PATCH_ALIGN} px, got {tile}")
        self.device = device or default_device()
        if crf is True:
            crf = DEFAULT_CRF_PRESET
        if crf and crf not in CRF_PRESETS:
            raise ValueError(f"crf must be False, True or a preset ({', '.join(CRF_PRESETS)}), got {crf!r}")
        self.classifier_kind, self.crf = classifier, crf or False
        self.classifier_params = dict(classifier_params or {})
        self.crf_params = dict(crf_params or {})
        self._set_filters(filters, sigmas, sigma_scale)
        self.n_components, self.vit_tile, self.vit_overlap = int(n_components), int(vit_tile), int(vit_overlap)
        self.intensity, self.tile, self.max_samples = intensity, _round_up(int(tile), PATCH_ALIGN), int(max_samples)
        self.feature_dtype, self.seed, self.progress = np.dtype(feature_dtype), int(seed), progress
        on_gpu = str(self.device).startswith("cuda")
        self.classical_torch = classical_backend == "torch" or (classical_backend == "auto" and on_gpu)
        self.colour, self.channels_ = colour, None  # channels_: 1 or 3, set by fit() (what the model accepts)
        self.intensity_dtype = None  # the training images' dtype when they share one (intensity="training")
        self._dtype_warned = False
        self.intensity_range = None  # (lo, hi) in stored grey values, fitted by fit() with intensity="training"
        self.fixed_intensity_range = None
        if intensity_range is not None:
            if intensity != "training":
                raise ValueError(f'intensity_range is for intensity="training", not {intensity!r}')
            lo, hi = (float(v) for v in intensity_range)
            if not (np.isfinite(lo) and np.isfinite(hi) and hi >= lo):
                raise ValueError(f"intensity_range must be two finite values lo <= hi, got {intensity_range!r}")
            self.intensity_range = self.fixed_intensity_range = (lo, hi)
        self.cache = cache
        self.backbone_spec = None
        self.vit = None
        if backbone is not None:
            import torch.nn as nn

            from .vit import ViTFeatures

            if isinstance(backbone, nn.Module):
                model = backbone
                self.backbone_spec = {"module": type(backbone).__name__}
            elif isinstance(backbone, str):
                from ..models.checkpoint import create_backbone

                model = create_backbone(backbone, pretrained=pretrained, checkpoint=checkpoint, seed=self.seed,
                                        **(model_kwargs or {}))
                self.backbone_spec = {"name": backbone, "pretrained": bool(pretrained),
                                      "checkpoint": str(Path(checkpoint).resolve()) if checkpoint else None,
                                      "model_kwargs": dict(model_kwargs or {})}
            else:
                raise ValueError(f"backbone must be None, a model name or an nn.Module, got {type(backbone).__name__}")
            self.vit = ViTFeatures(model, self.n_components, tile=self.vit_tile, overlap=self.vit_overlap,
                                   device=self.device)
        self.intensity_note = None  # how the training range was sampled, when chunked images were
        self._scratch = self._scratch_user = None  # state of one call (_call)
        self.classes_ = None
        self.model_ = None

    dims = 2  # the images' dimensions: 2 here, 3 for volumes (VolumeSegmenter)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _KINDS[cls.dims] = cls  # what load() builds for a model of these dimensions

    @classmethod
    def _config_kwargs(cls, cfg: dict) -> dict:
        """Constructor arguments of a saved model beyond those every segmenter takes."""
        return {}

    def _set_filters(self, filters, sigmas, sigma_scale) -> None:
        fs = filter_set(filters, sigmas, sigma_scale)
        self.filters, self.sigmas, self.sigma_scale = filters, fs.sigmas, fs.sigma_scale
        self.halo = halo(self.sigmas, self.sigma_scale, self.filters)  # the filters' reach: tiles equal the whole image

    # ---- features -------------------------------------------------------------------------
    @property
    def feature_names(self) -> list[str]:
        return self._feature_names(self.channels_ or 1)

    def _feature_names(self, channels: int) -> list[str]:
        names = classical_feature_names(self.sigmas, self.filters)
        if channels > 1:
            names = [f"{n}_{ch}" for ch in CHANNEL_NAMES[:channels] for n in names]
        if self.vit is not None:
            names = names + [f"vit_pc{i}" for i in range(self.n_components)]
        return names + [f"user_{i}" for i in range(self.n_user_features or 0)]

    def check_channels(self, image, source: str = "image"):
        """A clear ValueError when a colour model gets a grayscale image or the reverse (an array or
        a :class:`~alibi_vit.chunked.ChunkedImage`, whose planes and channels are checked too)."""
        if isinstance(image, ChunkedImage):
            if image.planes != 1:
                raise ValueError(f"{source} holds {image.planes} planes (axes {image.axes}) but the model segments 2D "
                                 "images: segment a volume with a volume model (3D features), or slice by slice "
                                 "(--features 2d); store one plane per image otherwise")
            if image.channels not in (1, 3, 4):
                raise ValueError(f"{source} has {image.channels} channels (axes {image.axes}): expected 1 (grey) or "
                                 "3/4 (RGB(A))")
            colour = image.channels > 1
        else:
            image = as_grayscale(image, source)
            colour = image.ndim == 3
        if self.colour != "channels" or self.channels_ is None:
            return image
        if colour and self.channels_ == 1:
            raise ValueError(f"{source} is a colour image but the model was trained on grayscale images: convert it "
                             "to grayscale, or train on colour images (or with colour='grey' / --colour grey)")
        if not colour and self.channels_ > 1:
            raise ValueError(f"{source} is grayscale but the model was trained on colour images, channel by "
                             "channel: give colour images, or train on grayscale (or with colour='grey' / --colour grey)")
        return image

    def _warn_dtype(self, dtype, source: str) -> None:
        if self.intensity_dtype and dtype.name != self.intensity_dtype and not self._dtype_warned:
            self._dtype_warned = True
            warnings.warn(f"{source} is {dtype.name} but the model was trained on {self.intensity_dtype} "
                          f"images: its stored intensity range {self.intensity_range} is in {self.intensity_dtype} "
                          "values; convert the images or retrain", stacklevel=3)

    def _training_range(self):
        if self.intensity_range is None:
            raise ValueError('intensity="training" is fitted by fit(): call fit() or load() first')
        return self.intensity_range

    def scale(self, image, source: str = "image") -> np.ndarray:
        """One image as the float32 in [0, 1] the features are computed on (the model's intensity):
        (H, W), or (H, W, 3) for a colour image with ``colour="channels"``."""
        image = self.check_channels(image, source)
        keep = self.colour == "channels"
        if self.intensity != "training":
            return scale_colour(image, self.intensity, source) if keep else to_unit_float(image, self.intensity, source)
        lo, hi = self._training_range()
        self._warn_dtype(image.dtype, source)
        return scale_to_range(image, lo, hi, source=source, colour=keep)

    def source(self, image, name: str = "image"):
        """What the tiled engine reads for one image: an :class:`~alibi_vit.trainable.sources.ArraySource`
        (an array, scaled whole) or a :class:`~alibi_vit.trainable.sources.ChunkedSource` (a
        :class:`~alibi_vit.chunked.ChunkedImage`, scaled region by region). A source passes through."""
        if isinstance(image, (ArraySource, ChunkedSource)):
            return image
        if not isinstance(image, ChunkedImage):
            return ArraySource(self.scale(image, name), name, dtype=getattr(image, "dtype", None))
        self.check_channels(image, name)
        keep = self.colour == "channels" and image.channels > 1
        if self.intensity == "training":
            lo, hi = self._training_range()
            self._warn_dtype(image.dtype, name)
            return ChunkedSource(image, lo, hi, keep)
        lo, hi, note = chunked_range(image, self.intensity, keep, self.seed)
        return ChunkedSource(image, lo, hi, keep, note=note)

    def _prepare(self, images, source="image", fit: bool = False) -> list:
        images = _as_list(images, "images", self.dims)
        if fit:
            for i, im in enumerate(images):
                if isinstance(im, ChunkedImage):
                    self.check_channels(im, im.name)
                elif isinstance(im, (ArraySource, ChunkedSource)):
                    self._check_own_source(im)
                else:
                    images[i] = as_grayscale(im, f"{source} {i}")
            self.channels_ = None
            if self.colour == "channels":
                kinds = {_is_colour(im) for im in images}
                if len(kinds) > 1:
                    raise ValueError("the training images mix colour and grayscale: give one kind, or convert "
                                     "colour to grey with colour='grey' (--colour grey)")
                self.channels_ = 3 if kinds == {True} else 1
            else:
                self.channels_ = 1
            dtypes = {_stored_dtype(im).name for im in images}
            self.intensity_dtype = dtypes.pop() if len(dtypes) == 1 and self.intensity == "training" else None
            if self.intensity == "training" and self.fixed_intensity_range is None:
                self.intensity_range, self.intensity_note = self._fit_range(images)
        return [self.source(im, im.name if isinstance(im, ChunkedImage) else f"{source} {i}")
                for i, im in enumerate(images)]

    def _check_own_source(self, src) -> None:
        """fit() takes a source only as :meth:`source` makes it with a fixed ``intensity_range`` (the
        scaling it was made with is then this segmenter's; its stored dtype is known)."""
        if self.intensity == "training" and self.fixed_intensity_range is None:
            raise ValueError("fit() takes sources (already scaled images) only with a fixed intensity_range; "
                             "give the images themselves")
        if isinstance(src, ArraySource) and src.dtype is None:
            raise ValueError(f"{src.name}: a source made by source() is needed (its stored pixels' dtype is not known)")
        if isinstance(src, ChunkedSource) and self.intensity == "training" and (src.lo, src.hi) != self.intensity_range:
            raise ValueError(f"{src.name} was scaled to ({src.lo}, {src.hi}), not this segmenter's intensity range "
                             f"{self.intensity_range}")

    def _fit_range(self, images):
        """The training range: pooled percentiles of the images' grey values; a chunked image gives a
        seeded sample of its tiles (all of them when it is small). Returns (range, what was sampled)."""
        pooled, notes = [], []
        for im in images:
            if isinstance(im, ChunkedImage):
                pixels, n, total = sample_tiles(im, seed=self.seed)
                pooled.append(pixels)
                if n < total:
                    notes.append(f"{n} of {total} tiles of {im.name}")
            else:
                pooled.append(im)
        note = ("intensity range fitted on a seeded sample of tiles: " + "; ".join(notes)) if notes else None
        return fit_intensity_range(pooled, seed=self.seed, colour=self.colour == "channels"), note

    def tile_grid(self, src) -> TileGrid:
        """The tiles of an image (a source): cores of ``tile`` px, halos of the filters' reach."""
        return TileGrid(src.shape, self.tile, self.halo)

    def _cached(self, key: str, compute):
        cache = self.cache if self.cache is not None else self._scratch
        return compute() if cache is None else cache.get(key, compute)

    def _classical_key(self, src, tile: Tile) -> str:
        bounds = [(s.start, s.stop) for s in tile.outer + tile.core]
        return f"classical|{src.key}|{self.filters}|{self.sigmas}|{self.sigma_scale}|{self.classical_torch}|{bounds}"

    def _classical_planes(self, src, tile: Tile) -> list:
        """The classical feature planes of a tile plus its halo (every channel's), in feature order."""
        crop = src.read(*tile.outer)
        channels = [crop] if crop.ndim == 2 else [crop[..., c] for c in range(crop.shape[-1])]
        kwargs = dict(sigma_scale=self.sigma_scale, filters=self.filters)
        planes = []
        for ch in channels:
            if self.classical_torch:
                device = self.device if str(self.device).startswith("cuda") else "cpu"
                planes += list(classical_features_torch(ch, self.sigmas, device=device, **kwargs))
            else:
                planes += classical_planes(np.ascontiguousarray(ch), self.sigmas, **kwargs)
        return planes

    def _classical_tile(self, src, tile: Tile, cached: bool = True) -> np.ndarray:
        """(h, w, F) classical features of a tile's core, computed on it plus its halo (through the
        cache when there is one and ``cached``, keyed by the image, the tile and the filter settings).

        Pixel-major and contiguous, so a tile's rows go to the classifier without a transpose (for a
        1024² tile that copy cost more than the prediction itself)."""
        def compute():
            return pixel_major(self._classical_planes(src, tile), *tile.inner)

        if self.cache is None or not cached:  # the scratch cache holds ViT windows only: used once
            return compute()
        return self.cache.get(self._classical_key(src, tile), compute)

    def _patch_map(self, src, rows: slice, cols: slice) -> np.ndarray:
        """(C, rows, cols) raw backbone patch features of a patch range (the windows through the cache)."""
        model = self.backbone_spec if "name" in self.backbone_spec else id(self.vit.model)
        prefix = f"vit|{src.key}|{json.dumps(model, sort_keys=True, default=str)}|{self.seed}|{self.vit_tile}|" \
                 f"{self.vit_overlap}"
        from .vit import patch_map

        return patch_map(self.vit.model, src.read, src.shape, rows, cols, tile=self.vit_tile,
                         overlap=self.vit_overlap, device=self.device,
                         window=lambda y0, x0, compute: self._cached(f"{prefix}|{y0},{x0}", compute))

    def _patch_size(self) -> int:
        return int(self.vit.model.patch_embed.patch_size[0])

    def _vit_tile(self, src, tile: Tile) -> np.ndarray:
        """(h, w, n_components) ViT features of a tile's core: projected patch features of the core
        plus one patch (the bilinear upsampling's reach), upsampled."""
        p = self._patch_size()
        (r0, r1), (c0, c1) = ((s.start, s.stop) for s in tile.core)
        gh, gw = -(-src.shape[0] // p), -(-src.shape[1] // p)
        a0, b0 = max(r0 // p - 1, 0), max(c0 // p - 1, 0)
        a1, b1 = min(-(-r1 // p) + 1, gh), min(-(-c1 // p) + 1, gw)
        from .vit import upsample_patches

        z = self.vit.project(self._patch_map(src, slice(a0, a1), slice(b0, b1)))
        return np.moveaxis(upsample_patches(z, p, (a0, b0), *tile.core), 0, -1)

    def _user_tile(self, src, tile: Tile) -> np.ndarray:
        """(h, w, F) features of the user's function: on the whole image when it is in memory, else on
        the tile plus its halo (so it must not look further than the halo to equal the whole image's)."""
        if isinstance(src, ArraySource):
            whole = self._scratch_user.get(id(src))
            if whole is None:
                whole = self._scratch_user[id(src)] = self._user_features(src.pixels)
            return whole[tile.core]
        return self._user_features(src.read(*tile.outer))[tile.inner]

    def _user_features(self, image01) -> np.ndarray:
        u = np.asarray(self._feature_fn(image01), np.float32)
        if u.ndim == 2:
            u = u[..., None]
        if u.ndim != 3 or u.shape[:2] != image01.shape[:2]:
            raise ValueError(f"feature_fn {self.feature_fn} returned shape {u.shape}; expected (H, W, F) with "
                             f"(H, W) = {image01.shape[:2]}")
        if self.n_user_features is not None and u.shape[-1] != self.n_user_features:
            raise ValueError(f"feature_fn {self.feature_fn} returned {u.shape[-1]} features; the model was "
                             f"trained with {self.n_user_features}")
        return u

    def _tile_features(self, src, tile: Tile) -> np.ndarray:
        """(h, w, F) features of a tile's core: classical, then ViT, then the user's."""
        feats = [self._classical_tile(src, tile)]
        if self.vit is not None:
            feats.append(self._vit_tile(src, tile))
        if self._feature_fn is not None:
            feats.append(self._user_tile(src, tile))
        return np.concatenate(feats, axis=-1) if len(feats) > 1 else feats[0]

    @contextmanager
    def _call(self):
        """Scratch state of one fit/predict call: without a cache, a small one for ViT windows
        (neighbouring tiles share them); user features of in-memory images."""
        outer = self._scratch_user is None
        if outer:
            self._scratch_user = {}
            self._scratch = FeatureCache(VIT_WINDOW_BYTES) if self.cache is None and self.vit is not None else None
        try:
            yield
        finally:
            if outer:
                self._scratch_user, self._scratch = None, None

    def features(self, image) -> np.ndarray:
        """(H, W, F) per-pixel features of one image as the classifier sees them (whole image in memory)."""
        if self.vit is not None and self.vit.components_ is None:
            raise ValueError("the ViT PCA is fitted by fit(): call fit() before features() with a backbone")
        with self._call():
            (src,) = self._prepare([image])
            grid = self.tile_grid(src)
            out = None
            for tile in grid:
                feats = self._tile_features(src, tile)
                if out is None:
                    out = np.empty(src.shape + feats.shape[-1:], np.float32)
                out[tile.core] = feats
        return out

    def precompute(self, image, on_progress=None, first=None):
        """Fill the cache with one image's features (the classical features of every tile, and the
        backbone's patch features), so later fit()/predict() calls on it skip that work: the tiles
        overlapping ``first`` (a region (rows, cols), e.g. what is on screen) before the others.
        Returns the scaled image (an array) or its source (a chunked image).
        ``on_progress(done, total)`` is called after each tile."""
        if self.cache is None:
            raise ValueError("precompute() fills the feature cache: create the segmenter with cache=FeatureCache()")
        with self._call():
            (src,) = self._prepare([image])
            tiles = self.tile_grid(src).ordered(first)
            p = self._patch_size() if self.vit is not None else None
            for i, tile in enumerate(tiles):
                if p is not None:  # the windows of the core's patches; PCA may not be fitted yet
                    self._patch_map(src, *(slice(s.start // p, -(-s.stop // p)) for s in tile.core))
                self._classical_tile(src, tile)
                if on_progress:
                    on_progress(i + 1, len(tiles))
        return src.pixels if isinstance(src, ArraySource) else src

    # ---- training -------------------------------------------------------------------------
    def fit(self, images, labels) -> "TrainableSegmenter":
        """Train on the labelled pixels of ``images``; only the tiles that hold labels are read, and only boxes
        around the labels featurised (:meth:`_labelled_rows`).

        images: a list of images (arrays, or :class:`~alibi_vit.chunked.ChunkedImage` for images too
            large for memory), or one (H, W) or (H, W, 3) array; a 3D stack is an error. With a fixed
            ``intensity_range``, also sources made by :meth:`source` (an image scaled once and its
            digest computed once for many fits, as the app retrains after each stroke).
        labels: one label image per image (an array or a chunked image), same size, 0 = unlabelled,
            1..K = classes. The classes are the label values found in all label images together (a
            class may appear in one image only); at least two are needed. Images without any labelled
            pixel add no training pixel (in-memory ones still shape the ViT PCA, and all of them the
            fitted intensity range). Returns self.
        """
        labels = _as_list(labels, "labels", self.dims)
        import_in_background()  # XGBoost loads while the features are computed
        with self._call():
            sources = self._prepare(images, fit=True)
            if len(labels) != len(sources):
                raise ValueError(f"got {len(sources)} images but {len(labels)} label images")
            for i, (src, lab) in enumerate(zip(sources, labels)):
                shape = labels_shape(lab, self.dims)
                if shape != tuple(src.shape):
                    unit, kind = ("px", "image") if self.dims == 2 else ("voxels (z×y×x)", f"volume ({src.name})")
                    raise ValueError(f"labels {i} is {'×'.join(map(str, shape))} {unit} but its {kind} is "
                                     f"{'×'.join(map(str, src.shape))} {unit}")
            labelled = self._labelled_tiles(sources, labels)
            totals: dict[int, int] = {}
            for *_, counts in labelled:
                for value, n in counts.items():
                    totals[value] = totals.get(value, 0) + n
            classes = np.array(sorted(totals), np.int64)
            if len(classes) == 0:
                raise ValueError("the label images have no labelled pixel (all 0): draw at least one scribble per "
                                 "class")
            if len(classes) < 2:
                raise ValueError(f"only class {classes[0]} is labelled: at least two classes are needed")
            if not np.array_equal(classes, np.arange(1, len(classes) + 1)):
                warnings.warn(f"label values {', '.join(str(int(c)) for c in classes)} are not 1..{len(classes)}: "
                              "each value is a class, and masks are written with these same values", stacklevel=2)
            self.classes_ = classes
            self.label_counts_ = {int(c): int(totals[c]) for c in classes}  # labelled pixels per class
            self.n_user_features = None
            if self.vit is not None:
                self._fit_pca(sources, labels, labelled)
            X, Y = self._gather(sources, labels, labelled, classes, totals)
        self.model_ = fit_classifier(self.classifier_kind, X, Y, self.seed, self.classifier_params)
        return self

    def _labelled_tiles(self, sources, labels) -> list:
        """(image index, tile, {class value: labelled pixels}) of every tile that holds a label, in
        image then row-major tile order (reading the label images tile by tile)."""
        found = []
        for i, (src, lab) in enumerate(zip(sources, labels)):
            occupied = nonzero_along_axes(lab) if isinstance(lab, np.ndarray) else None
            for tile in tqdm(list(self.tile_grid(src)), desc="labels", disable=not self.progress, leave=False):
                if occupied is not None and not all(o[c].any() for o, c in zip(occupied, tile.core)):
                    continue  # nothing but 0 (unlabelled) in this tile: nothing to read or check
                y = label_region(lab, *tile.core, source=f"labels {i}")
                values, counts = np.unique(y[y > 0], return_counts=True)
                if len(values):
                    found.append((i, tile, dict(zip(values.tolist(), counts.tolist()))))
        return found

    def _fit_pca(self, sources, labels, labelled) -> None:
        """Standardisation and PCA of the backbone's patch features: every patch of the in-memory
        training images, and the patches of the labelled tiles of chunked ones."""
        p = self._patch_size()
        maps = []
        for i, src in enumerate(tqdm(sources, desc="ViT features", disable=not self.progress)):
            if isinstance(src, ArraySource):
                gh, gw = -(-src.shape[0] // p), -(-src.shape[1] // p)
                maps.append(self._patch_map(src, slice(0, gh), slice(0, gw)))
                continue
            for j, tile, _ in labelled:
                if j == i:
                    maps.append(self._patch_map(src, *(slice(s.start // p, -(-s.stop // p)) for s in tile.core)))
        self.vit.fit_patch_matrix(np.concatenate([m.reshape(m.shape[0], -1).T for m in maps]))

    def _gather(self, sources, labels, labelled, classes, totals):
        """(X, Y): features and class indices of the training pixels, tile by tile. All labelled pixels
        when they number at most ``max_samples``; else per class a seeded uniform random subset of the
        size :func:`sample_quotas` gives, drawn over the class's pixels in tile order before any
        feature is computed, so X never holds more than ``max_samples`` rows."""
        counts = np.array([totals[c] for c in classes], np.int64)
        chosen = None
        if counts.sum() > self.max_samples:
            rng = np.random.default_rng(self.seed)
            quotas = sample_quotas(counts, self.max_samples)
            chosen = [np.sort(rng.choice(n, q, replace=False)) for n, q in zip(counts, quotas)]
        seen = np.zeros(len(classes), np.int64)  # pixels of each class in the tiles before this one
        X = Y = None
        row = 0
        for i, tile, tile_counts in tqdm(labelled, desc="features", disable=not self.progress):
            y = label_region(labels[i], *tile.core, source=f"labels {i}")
            n_c = np.array([tile_counts.get(c, 0) for c in classes.tolist()], np.int64)
            if chosen is None:
                sel = y > 0
            else:
                sel = np.zeros(y.shape, bool)
                for k, c in enumerate(classes):
                    lo, hi = np.searchsorted(chosen[k], [seen[k], seen[k] + n_c[k]])
                    sel.flat[np.flatnonzero(y == c)[chosen[k][lo:hi] - seen[k]]] = True
            seen += n_c
            m = int(sel.sum())
            if not m:
                continue
            rows = self._labelled_rows(sources[i], tile, sel)
            if X is None:  # sized once the first tile shows the user function's feature count
                if self._feature_fn is not None:
                    self.n_user_features = rows.shape[-1] - len(self.feature_names)
                n = int(min(counts.sum(), self.max_samples))
                X, Y = np.empty((n, rows.shape[-1]), self.feature_dtype), np.empty(n, np.int64)
            X[row:row + m] = rows
            Y[row:row + m] = np.searchsorted(classes, y[sel])
            row += m
        return X[:row], Y[:row]

    def _restore(self, cfg: dict) -> None:
        """Saved state beyond the constructor's arguments (none for 2D images)."""

    def _labelled_rows(self, src, tile: Tile, sel: np.ndarray) -> np.ndarray:
        """(m, F) features of the pixels ``sel`` (a mask over the tile's core) marks, in C order.

        Scribbles are sparse: the pixels are featurised in boxes around them (:func:`labelled_boxes`), each with
        the tile's halo, which gives the whole tile's values (the halo is the filters' reach) at a fraction of
        the cost, unless the boxes cover as much or the cache holds the whole tile already (a prediction put it
        there). Boxes are not cached: the next stroke changes them. ViT windows and user functions work per tile."""
        whole = (self.vit is not None or self._feature_fn is not None
                 or (self.cache is not None and self._classical_key(src, tile) in self.cache))
        boxes = [] if whole else labelled_boxes(sel, STROKE_GAP)
        parts = [tile.part(box, (self.halo,) * 2, src.shape) for box, _ in boxes]
        if not parts or sum(_area(p.outer) for p in parts) >= _area(tile.outer):
            return self._tile_features(src, tile)[sel]
        return self._rows_in_boxes(sel, boxes, parts, lambda part: self._classical_tile(src, part, cached=False))

    @staticmethod
    def _rows_in_boxes(sel: np.ndarray, boxes, parts, features) -> np.ndarray:
        """(m, F) rows of the pixels (voxels) ``sel`` marks, in C order, gathered box by box: ``boxes`` are
        ``(box, owned)`` owning every marked pixel once, ``parts`` their tiles, ``features(part)`` a part's
        (..., F) features over its box."""
        row_of = (np.cumsum(sel, dtype=np.int64) - 1).reshape(sel.shape)  # each marked pixel's row, in C order
        rows = None
        for (box, owned), part in zip(boxes, parts):
            feats = features(part)[owned]
            if rows is None:
                rows = np.empty((int(sel.sum()), feats.shape[-1]), feats.dtype)
            rows[row_of[box][owned]] = feats
        return rows

    # ---- prediction -----------------------------------------------------------------------
    def _check_fitted(self):
        if self.model_ is None:
            raise ValueError("the segmenter is not trained: call fit() or load() first")

    def _features_once(self, tile: Tile) -> bool:
        """Whether a tile's features are used once and made here from its classical planes: no cache to keep
        them, no ViT or user features, a 2D tile."""
        return self.cache is None and self.vit is None and self._feature_fn is None and len(tile.core) == 2

    def tile_proba(self, src, tile: Tile, part=None, planes=None) -> np.ndarray:
        """(h, w, K) float32 class probabilities of one tile's core ((d, h, w, K) for a volume's block),
        straight from the classifier (no CRF, no modal filter: those look past the tile;
        :mod:`~alibi_vit.trainable.stream`).
        part: only this region of the core ((rows, cols) slices in image coordinates) is classified
        (the features are the whole tile's, so through the cache a tile is featurised once however
        many parts of it are asked for, e.g. the part on screen first).
        planes: the tile's classical planes (:meth:`_classical_planes`), when computed ahead."""
        if self._features_once(tile):
            # Features used once: made pixel-major band by band, so the tile holds its planes and one band rather
            # than its planes and a whole pixel-major copy (for colour, 87 planes: 350 MB less at 1024²).
            planes = self._classical_planes(src, tile) if planes is None else planes
            rows, cols = (slice(i.start + (p.start - c.start), i.start + (p.stop - c.start))
                          for i, p, c in zip(tile.inner, part or tile.core, tile.core))
            out = np.empty((rows.stop - rows.start, cols.stop - cols.start, len(self.classes_)), np.float32)
            for r in range(rows.start, rows.stop, PREDICT_BAND):
                band = slice(r, min(r + PREDICT_BAND, rows.stop))
                out[band.start - rows.start:band.stop - rows.start] = self._proba_of(pixel_major(planes, band, cols))
            return out
        feats = self._tile_features(src, tile)
        if part is not None:
            feats = feats[tuple(slice(p.start - c.start, p.stop - c.start) for p, c in zip(part, tile.core))]
        return self._proba_of(feats)

    def _proba_of(self, feats: np.ndarray) -> np.ndarray:
        """(..., K) float32 class probabilities of (..., F) pixel-major features."""
        # Pixel-major features reshape to C-contiguous rows without a copy (XGBoost would copy others).
        rows = np.ascontiguousarray(feats.reshape(-1, feats.shape[-1]), dtype=self.feature_dtype)
        return self.model_.predict_proba(rows).reshape(feats.shape[:-1] + (len(self.classes_),)).astype(
            np.float32, copy=False)

    def predict_tiles(self, image, first=None):
        """Class probabilities tile by tile, as they are computed: yields (core (rows, cols) slices,
        (h, w, K) probabilities), the tiles overlapping ``first`` (a region (rows, cols), e.g. what is
        on screen) before the others. Nothing is held beyond the tile in hand (and the cache). Raw
        classifier output: no CRF, no modal filter. ``image``: an array, a chunked image or a source."""
        self._check_fitted()
        with self._call():
            src = self.source(image)
            for tile in self.tile_grid(src).ordered(first):
                yield tile.core, self.tile_proba(src, tile)

    def _proba_one(self, src, on_progress=None) -> np.ndarray:
        out = np.empty(tuple(src.shape) + (len(self.classes_),), np.float32)
        tiles = list(self.tile_grid(src))
        # The next tile's filters run on a thread while this one is classified: each alone leaves a core idle
        # part of the time (numpy's elementwise steps, the channel merge, the classifier's serial parts). Not in a
        # process of one thread (a Dask worker's): there it would only compete with the classifier.
        ahead = ThreadPoolExecutor(1, thread_name_prefix="alibi-vit-features") \
            if len(tiles) > 1 and self._features_once(tiles[0]) and thread_budget() > 1 else None
        try:
            pending = ahead.submit(self._classical_planes, src, tiles[0]) if ahead else None
            for i, tile in enumerate(tiles):
                planes = pending.result() if pending is not None else None
                pending = ahead.submit(self._classical_planes, src, tiles[i + 1]) \
                    if ahead and i + 1 < len(tiles) else None
                out[tile.core] = self.tile_proba(src, tile, planes=planes)
                if on_progress:
                    on_progress(i + 1, len(tiles))
        finally:
            if ahead:
                ahead.shutdown(cancel_futures=True)
        if self.crf:
            x = src.pixels if isinstance(src, ArraySource) else src.read(slice(None), slice(None))
            out = dense_crf_tiled(out, x, self.tile, CRF_OVERLAP, self.crf, **self.crf_params)
        return out

    def predict_proba(self, images, scaled: bool = False, on_progress=None) -> list[np.ndarray]:
        """Per image an (H, W, K) float32 array of class probabilities, classes ordered as ``classes_``
        (held whole: for images larger than memory use :mod:`~alibi_vit.trainable.stream`).

        scaled: the images are already the output of :meth:`scale` (so a caller that needs the scaled
        image too scales once). on_progress(done, total): called after each tile of each image."""
        self._check_fitted()
        with self._call():
            srcs = [ArraySource(x) for x in _as_list(images, "images", self.dims)] if scaled else self._prepare(images)
            return [self._proba_one(s, on_progress) for s in tqdm(srcs, desc="segment", disable=not self.progress)]

    def predict(self, images, scaled: bool = False) -> list[np.ndarray]:
        """Per image an (H, W) int64 mask of class values (those in the training labels); ``scaled`` as
        in :meth:`predict_proba`."""
        return [self.mask_from_proba(p) for p in self.predict_proba(images, scaled)]

    def mask_from_proba(self, proba: np.ndarray) -> np.ndarray:
        """(H, W) class values from (H, W, K) probabilities: the most probable class, then the modal
        filter when ``modal`` is set."""
        mask = self.classes_[proba.argmax(-1)]
        return modal_filter(mask, self.modal) if self.modal else mask

    # ---- persistence ----------------------------------------------------------------------
    def config(self) -> dict:
        return {"format": FORMAT_VERSION, "classes": [int(c) for c in self.classes_],
                "classifier": self.classifier_kind, "classifier_params": self.classifier_params,
                "crf": self.crf, "crf_params": self.crf_params, "filters": self.filters, "sigmas": list(self.sigmas),
                "sigma_scale": self.sigma_scale, "n_components": self.n_components, "vit_tile": self.vit_tile,
                "vit_overlap": self.vit_overlap, "intensity": self.intensity,
                "intensity_range": None if self.intensity_range is None else list(self.intensity_range),
                "intensity_dtype": self.intensity_dtype,
                "tile": self.tile,
                "max_samples": self.max_samples, "feature_dtype": self.feature_dtype.name, "seed": self.seed,
                "backbone": self.backbone_spec, "feature_names": self.feature_names, "colour": self.colour,
                "channels": self.channels_, "feature_fn": self.feature_fn, "n_user_features": self.n_user_features,
                "modal": self.modal, "dims": self.dims}

    def save(self, path) -> Path:
        """Write the model folder: config.json, classifier.json (XGBoost's JSON format), and with a
        backbone vit_pca.npz (the fitted standardisation and PCA) plus, for a backbone that cannot be
        rebuilt from its name (random init), backbone.safetensors. No pickle anywhere."""
        self._check_fitted()
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = self.config()
        self.model_.save_model(path / "classifier.json")
        if self.vit is not None:
            np.savez(path / "vit_pca.npz", **self.vit.state())
            spec = self.backbone_spec
            if "name" in spec and not spec["pretrained"] and not spec["checkpoint"]:
                from ..models.checkpoint import save_safetensors

                state = {k: v.detach().cpu().contiguous() for k, v in self.vit.model.state_dict().items()}
                save_safetensors(state, path / "backbone.safetensors")
                config["backbone"] = {**spec, "checkpoint": "backbone.safetensors"}
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path, backbone: nn.Module | None = None, device=None, progress: bool = False) -> "TrainableSegmenter":
        """A segmenter from a folder written by :meth:`save`.

        A model trained with an ``nn.Module`` backbone needs that module again as ``backbone``;
        one trained with a model name rebuilds it (its checkpoint file must still exist).
        """
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{path} is not a trained segmenter folder (no config.json)")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{cfg_path} is not valid JSON ({err}): the model folder is damaged; train it again") from None
        if cfg.get("format") not in READABLE_FORMATS:
            raise ValueError(f"{cfg_path} has format {cfg.get('format')}, this version reads formats "
                             f"{', '.join(map(str, READABLE_FORMATS))}: train the model again with this version")
        spec = cfg["backbone"]
        kwargs = {}
        if spec is None:
            model = None
        elif "module" in spec:
            if backbone is None:
                raise ValueError(f"{path} was trained with a custom backbone ({spec['module']}): pass it as backbone=")
            model = backbone
        else:
            model = spec["name"]
            ckpt = spec["checkpoint"]
            if ckpt and not Path(ckpt).is_absolute():
                ckpt = path / ckpt
            kwargs = dict(checkpoint=ckpt, pretrained=spec["pretrained"], model_kwargs=spec["model_kwargs"])
        crf = "library" if cfg["crf"] is True else cfg["crf"]  # format 1 stored True: the library's values
        kind = _KINDS.get(cfg.get("dims", 2))
        if kind is None or not issubclass(kind, cls):
            raise ValueError(f"{path} holds a model of {cfg.get('dims', 2)}D images, which {cls.__name__} does not "
                             "segment: load it with TrainableSegmenter.load")
        cls = kind
        kwargs.update(cls._config_kwargs(cfg))
        seg = cls(model, cfg["classifier"], crf, classifier_params=cfg["classifier_params"],
                  crf_params=cfg["crf_params"], filters=cfg.get("filters", "weka"), sigmas=cfg["sigmas"],
                  sigma_scale=cfg["sigma_scale"],
                  n_components=cfg["n_components"], vit_tile=cfg["vit_tile"], vit_overlap=cfg["vit_overlap"],
                  intensity=cfg["intensity"], tile=cfg["tile"], max_samples=cfg["max_samples"],
                  feature_dtype=cfg["feature_dtype"], device=device, seed=cfg["seed"], progress=progress,
                  colour=cfg.get("colour", "grey"), feature_fn=cfg.get("feature_fn"), modal=cfg.get("modal", 0),
                  **kwargs)  # format 1: colour became grey
        seg.channels_ = cfg.get("channels", 1)
        seg.n_user_features = cfg.get("n_user_features")
        seg._restore(cfg)
        if spec is not None and "name" in spec and spec["checkpoint"] == "backbone.safetensors":
            # Weights saved with the model (a random-init backbone): a later save() writes them again.
            seg.backbone_spec = {**spec, "checkpoint": None}
        seg.intensity_dtype = cfg.get("intensity_dtype")
        if cfg.get("intensity_range") is not None:
            seg.intensity_range = tuple(float(v) for v in cfg["intensity_range"])
        elif seg.intensity == "training":
            raise ValueError(f'{cfg_path} has intensity "training" but no intensity_range: the model folder is '
                             "damaged; train it again")
        seg.classes_ = np.asarray(cfg["classes"], np.int64)
        seg.model_ = load_classifier_in_background(cfg["classifier"], path / "classifier.json")
        if seg.vit is not None:
            pca = path / "vit_pca.npz"
            if not pca.is_file():
                raise FileNotFoundError(f"{pca} is missing")
            with np.load(pca, allow_pickle=False) as state:
                seg.vit.load_state(state)
        return seg


_KINDS[2] = TrainableSegmenter
