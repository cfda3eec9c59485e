"""``TrainableSegmenter``: Weka/ilastik-style pixel classification on classical ⊕ ViT features.

The method: docs/method.md §7.

Images go in as arrays ((H, W) of any integer or float dtype, or RGB) and are scaled to [0, 1] by
``intensity`` (by default black and white points fitted once on the training images and stored
with the model); label images use the Weka/ilastik convention: 0 = unlabelled, 1..K = classes.
Features are computed tile by tile (a core of ``tile`` px plus a margin covering the filters'
reach), so the features of every pixel are exactly those of the whole image and memory stays
bounded for any image size.
"""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import numpy as np
import torch.nn as nn
from tqdm.auto import tqdm

from .classical import (classical_feature_names, classical_features_torch, classical_planes, filter_set, halo,
                        pixel_major)
from .classifier import CLASSIFIERS, DEFAULT_CLASSIFIER, fit_classifier, load_classifier
from .crf import CRF_DEFAULTS, CRF_PRESETS, dense_crf_tiled
from ..images import INTENSITY_MODES, fit_intensity_range, scale_colour, scale_to_range
from .io import as_grayscale, as_label_image, to_unit_float

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
PATCH_ALIGN = 14  # tiles start on multiples of the patch size so ViT grids line up
DEFAULT_FILTERS = "compact"  # chosen on the labelled micrograph set's training split (docs/segmentation.md)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _upsample_region(z: np.ndarray, p: int, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
    """Pixels [r0, r1) × [c0, c1) of the bilinear ×p upsampling of the (C, gh, gw) map ``z``.

    With an integer scale and align_corners=False, upsampling a crop of the grid with one patch of
    margin gives exactly the whole map's upsampling inside the crop, so regions need not hold the
    whole image's upsampled features in memory.
    """
    import torch
    import torch.nn.functional as F

    gh, gw = z.shape[1:]
    a0, b0 = max(r0 // p - 1, 0), max(c0 // p - 1, 0)
    a1, b1 = min(-(-r1 // p) + 1, gh), min(-(-c1 // p) + 1, gw)
    crop = torch.from_numpy(np.ascontiguousarray(z[:, a0:a1, b0:b1]))[None]
    up = F.interpolate(crop, size=((a1 - a0) * p, (b1 - b0) * p), mode="bilinear", align_corners=False)[0]
    return up[:, r0 - a0 * p:r1 - a0 * p, c0 - b0 * p:c1 - b0 * p].numpy()


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


def _as_list(items, what: str) -> list:
    """A list of images: one 2D (or (H, W, 3|4) RGB) array counts as one image; other arrays are ambiguous."""
    if isinstance(items, np.ndarray):
        if items.ndim == 2 or (items.ndim == 3 and items.shape[-1] in (3, 4)):
            return [items]
        raise ValueError(f"{what}: got one array of shape {items.shape}; pass a list of 2D images (the slices of a "
                         "3D stack as separate images)")
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
        each tile and the ViT patch features of each image between calls (interactive retraining);
        entries are keyed by the scaled pixels, so results are exactly those without it. Runtime only.
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
        import torch

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if crf is True:
            crf = DEFAULT_CRF_PRESET
        if crf and crf not in CRF_PRESETS:
            raise ValueError(f"crf must be False, True or a preset ({', '.join(CRF_PRESETS)}), got {crf!r}")
        self.classifier_kind, self.crf = classifier, crf or False
        self.classifier_params = dict(classifier_params or {})
        self.crf_params = dict(crf_params or {})
        fs = filter_set(filters, sigmas, sigma_scale)
        self.filters, self.sigmas, self.sigma_scale = filters, fs.sigmas, fs.sigma_scale
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
        self.halo = _round_up(max(halo(self.sigmas, self.sigma_scale, self.filters), 2 * PATCH_ALIGN), PATCH_ALIGN)
        self.classes_ = None
        self.model_ = None

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
        """A clear ValueError when a colour model gets a grayscale image or the reverse."""
        image = as_grayscale(image, source)
        if self.colour != "channels" or self.channels_ is None:
            return image
        colour = image.ndim == 3
        if colour and self.channels_ == 1:
            raise ValueError(f"{source} is a colour image but the model was trained on grayscale images: convert it "
                             "to grayscale, or train on colour images (or with colour='grey' / --colour grey)")
        if not colour and self.channels_ > 1:
            raise ValueError(f"{source} is grayscale but the model was trained on colour images, channel by "
                             "channel: give colour images, or train on grayscale (or with colour='grey' / --colour grey)")
        return image

    def scale(self, image, source: str = "image") -> np.ndarray:
        """One image as the float32 in [0, 1] the features are computed on (the model's intensity):
        (H, W), or (H, W, 3) for a colour image with ``colour="channels"``."""
        image = self.check_channels(image, source)
        keep = self.colour == "channels"
        if self.intensity != "training":
            return scale_colour(image, self.intensity, source) if keep else to_unit_float(image, self.intensity, source)
        if self.intensity_range is None:
            raise ValueError('intensity="training" is fitted by fit(): call fit() or load() first')
        if self.intensity_dtype and image.dtype.name != self.intensity_dtype and not self._dtype_warned:
            self._dtype_warned = True
            warnings.warn(f"{source} is {image.dtype.name} but the model was trained on {self.intensity_dtype} "
                          f"images: its stored intensity range {self.intensity_range} is in {self.intensity_dtype} "
                          "values; convert the images or retrain", stacklevel=2)
        return scale_to_range(image, *self.intensity_range, source=source, colour=keep)

    def _prepare(self, images, source="image", fit: bool = False):
        images = _as_list(images, "images")
        if fit:
            images = [as_grayscale(im, f"{source} {i}") for i, im in enumerate(images)]
            self.channels_ = None
            if self.colour == "channels":
                kinds = {im.ndim for im in images}
                if len(kinds) > 1:
                    raise ValueError("the training images mix colour and grayscale: give one kind, or convert "
                                     "colour to grey with colour='grey' (--colour grey)")
                self.channels_ = 3 if kinds == {3} else 1
            else:
                self.channels_ = 1
            dtypes = {im.dtype.name for im in images}
            self.intensity_dtype = dtypes.pop() if len(dtypes) == 1 and self.intensity == "training" else None
            if self.intensity == "training" and self.fixed_intensity_range is None:
                self.intensity_range = fit_intensity_range(images, seed=self.seed, colour=self.colour == "channels")
        return [self.scale(im, f"{source} {i}") for i, im in enumerate(images)]

    def _vit_map(self, image01, patch_feats=None):
        """(ViT map or None, user features (H, W, F) or None) of one scaled image."""
        user = None
        if self._feature_fn is not None:
            u = np.asarray(self._feature_fn(image01), np.float32)
            if u.ndim == 2:
                u = u[..., None]
            if u.ndim != 3 or u.shape[:2] != image01.shape[:2]:
                raise ValueError(f"feature_fn {self.feature_fn} returned shape {u.shape}; expected (H, W, F) with "
                                 f"(H, W) = {image01.shape[:2]}")
            if self.n_user_features is not None and u.shape[-1] != self.n_user_features:
                raise ValueError(f"feature_fn {self.feature_fn} returned {u.shape[-1]} features; the model was "
                                 f"trained with {self.n_user_features}")
            user = u
        if self.vit is None:
            return None, user
        if patch_feats is None:
            patch_feats = self._patch_features(image01)
        return self.vit.project(patch_feats), user

    def _patch_features(self, image01) -> np.ndarray:
        """The backbone's raw patch features of one scaled image, through the cache when there is one."""
        if self.cache is None:
            return self.vit.patch_features(image01)
        from .cache import array_digest

        model = self.backbone_spec if "name" in self.backbone_spec else id(self.vit.model)
        key = array_digest(image01, "vit", json.dumps(model, sort_keys=True, default=str), self.seed,
                           self.vit_tile, self.vit_overlap)
        return self.cache.get(key, lambda: self.vit.patch_features(image01))

    def _regions(self, shape):
        h, w = shape
        for r0 in range(0, h, self.tile):
            for c0 in range(0, w, self.tile):
                yield r0, min(r0 + self.tile, h), c0, min(c0 + self.tile, w)

    def _classical_region(self, image01, r0, r1, c0, c1) -> np.ndarray:
        """(r1-r0, c1-c0, F) classical features of a core region, computed on it plus its halo
        (through the cache when there is one: the key is the halo'd crop and the core's place in it).

        Pixel-major and contiguous, so a region's rows go to the classifier without a transpose (for
        a 1024² region that copy cost more than the prediction itself)."""
        h, w = image01.shape[:2]
        g = self.halo
        R0, R1, C0, C1 = max(r0 - g, 0), min(r1 + g, h), max(c0 - g, 0), min(c1 + g, w)
        crop = image01[R0:R1, C0:C1]

        def compute():
            channels = [crop] if crop.ndim == 2 else [crop[..., c] for c in range(crop.shape[-1])]
            kwargs = dict(sigma_scale=self.sigma_scale, filters=self.filters)
            planes = []
            for ch in channels:
                if self.classical_torch:
                    device = self.device if str(self.device).startswith("cuda") else "cpu"
                    planes += list(classical_features_torch(ch, self.sigmas, device=device, **kwargs))
                else:
                    planes += classical_planes(np.ascontiguousarray(ch), self.sigmas, **kwargs)
            return pixel_major(planes, slice(r0 - R0, r1 - R0), slice(c0 - C0, c1 - C0))

        if self.cache is None:
            return compute()
        from .cache import array_digest

        key = array_digest(crop, "classical", self.filters, self.sigmas, self.sigma_scale, self.classical_torch,
                           r0 - R0, r1 - R0, c0 - C0, c1 - C0)
        return self.cache.get(key, compute)

    def _region_features(self, image01, maps, r0, r1, c0, c1) -> np.ndarray:
        """(r1-r0, c1-c0, F) features of a core region: classical, then ViT, then the user's."""
        feats = [self._classical_region(image01, r0, r1, c0, c1)]
        vit_map, user = maps
        if vit_map is not None:
            p = int(self.vit.model.patch_embed.patch_size[0])
            feats.append(np.moveaxis(_upsample_region(vit_map, p, r0, r1, c0, c1), 0, -1))
        if user is not None:
            feats.append(user[r0:r1, c0:c1])
        return np.concatenate(feats, axis=-1) if len(feats) > 1 else feats[0]

    def features(self, image) -> np.ndarray:
        """(H, W, F) per-pixel features of one image as the classifier sees them (whole image in memory)."""
        if self.vit is not None and self.vit.components_ is None:
            raise ValueError("the ViT PCA is fitted by fit(): call fit() before features() with a backbone")
        (x,) = self._prepare([image])
        vit_map = self._vit_map(x)
        n_user = 0 if vit_map[1] is None else vit_map[1].shape[-1]
        n = len(self._feature_names(1 if x.ndim == 2 else x.shape[-1])) - (self.n_user_features or 0) + n_user
        out = np.empty(x.shape[:2] + (n,), np.float32)
        for r0, r1, c0, c1 in self._regions(x.shape[:2]):
            out[r0:r1, c0:c1] = self._region_features(x, vit_map, r0, r1, c0, c1)
        return out

    def precompute(self, image, on_progress=None) -> np.ndarray:
        """Fill the cache with one image's features (the classical features of every tile, and the
        backbone's patch features), so later fit()/predict() calls on it skip that work. Returns the
        scaled image. ``on_progress(done, total)`` is called after each step."""
        if self.cache is None:
            raise ValueError("precompute() fills the feature cache: create the segmenter with cache=FeatureCache()")
        (x,) = self._prepare([image])
        regions = list(self._regions(x.shape[:2]))
        total = len(regions) + (self.vit is not None)
        if self.vit is not None:
            self._patch_features(x)
            if on_progress:
                on_progress(1, total)
        for i, (r0, r1, c0, c1) in enumerate(regions):
            self._classical_region(x, r0, r1, c0, c1)
            if on_progress:
                on_progress(i + 1 + (self.vit is not None), total)
        return x

    # ---- training -------------------------------------------------------------------------
    def fit(self, images, labels) -> "TrainableSegmenter":
        """Train on the labelled pixels of ``images``.

        images: a list of images, or one (H, W) or (H, W, 3) array; a 3D stack is an error.
        labels: one label image per image, same size, 0 = unlabelled, 1..K = classes. The classes are the label values found in all label
        images together (a class may appear in one image only); at least two are needed. Images
        without any labelled pixel add no training pixel (but still shape the ViT PCA and the
        fitted intensity range). Returns self.
        """
        xs = self._prepare(images, fit=True)
        labels = _as_list(labels, "labels")
        if len(labels) != len(xs):
            raise ValueError(f"got {len(xs)} images but {len(labels)} label images")
        ys = [as_label_image(lab, x.shape[:2], source=f"labels {i}") for i, (lab, x) in enumerate(zip(labels, xs))]
        classes = np.unique(np.concatenate([np.unique(y) for y in ys]))
        classes = classes[classes > 0]
        if len(classes) == 0:
            raise ValueError("the label images have no labelled pixel (all 0): draw at least one scribble per class")
        if len(classes) < 2:
            raise ValueError(f"only class {classes[0]} is labelled: at least two classes are needed")
        if not np.array_equal(classes, np.arange(1, len(classes) + 1)):
            warnings.warn(f"label values {', '.join(str(int(c)) for c in classes)} are not 1..{len(classes)}: each "
                          "value is a class, and masks are written with these same values", stacklevel=2)
        self.classes_ = classes
        self.n_user_features = None
        if self._feature_fn is not None:  # its feature count, from the first training image
            u = np.asarray(self._feature_fn(xs[0]))
            self.n_user_features = 1 if u.ndim == 2 else int(u.shape[-1])
        picks = self._sample(ys, classes)
        patch_feats = None
        if self.vit is not None:
            patch_feats = [self._patch_features(x) for x in tqdm(xs, desc="ViT features", disable=not self.progress)]
            self.vit.fit_patch_matrix(np.concatenate([f.reshape(f.shape[0], -1).T for f in patch_feats]))
        n = sum(int(p.sum()) for p in picks)
        X, Y = np.empty((n, len(self.feature_names)), self.feature_dtype), np.empty(n, np.int64)
        row = 0
        for i, (x, y) in enumerate(tqdm(list(zip(xs, ys)), desc="features", disable=not self.progress)):
            if not picks[i].any():
                continue
            vit_map = self._vit_map(x, patch_feats[i] if patch_feats is not None else None)
            for r0, r1, c0, c1 in self._regions(x.shape[:2]):
                sel = picks[i][r0:r1, c0:c1]
                m = int(sel.sum())
                if not m:
                    continue
                feats = self._region_features(x, vit_map, r0, r1, c0, c1)
                X[row:row + m] = feats[sel]
                Y[row:row + m] = np.searchsorted(classes, y[r0:r1, c0:c1][sel])
                row += m
        self.model_ = fit_classifier(self.classifier_kind, X, Y, self.seed, self.classifier_params)
        return self

    def _sample(self, ys, classes) -> list[np.ndarray]:
        """Per label image a boolean mask of the labelled pixels that train the classifier: all of
        them when they number at most ``max_samples``, else per class a seeded uniform random subset
        of the size :func:`sample_quotas` gives. Only masks are held: features are computed afterwards
        for the picked pixels alone, tile by tile, into one array of at most ``max_samples`` rows."""
        counts = np.array([sum(int((y == c).sum()) for y in ys) for c in classes], np.int64)
        if counts.sum() <= self.max_samples:
            return [y > 0 for y in ys]
        quotas = sample_quotas(counts, self.max_samples)
        rng = np.random.default_rng(self.seed)
        picks = [np.zeros(y.shape, bool) for y in ys]
        for c, n_c, q in zip(classes, counts, quotas):
            chosen = np.zeros(n_c, bool)  # over the class's pixels in image order, then raster order
            chosen[rng.choice(n_c, q, replace=False)] = True
            start = 0
            for y, pick in zip(ys, picks):
                where = np.flatnonzero(y == c)
                pick.flat[where[chosen[start:start + len(where)]]] = True
                start += len(where)
        return picks

    # ---- prediction -----------------------------------------------------------------------
    def _check_fitted(self):
        if self.model_ is None:
            raise ValueError("the segmenter is not trained: call fit() or load() first")

    def _proba_one(self, x: np.ndarray, on_progress=None) -> np.ndarray:
        vit_map = self._vit_map(x)
        k = len(self.classes_)
        out = np.empty(x.shape[:2] + (k,), np.float32)
        regions = list(self._regions(x.shape[:2]))
        for i, (r0, r1, c0, c1) in enumerate(regions):
            feats = self._region_features(x, vit_map, r0, r1, c0, c1)
            # Pixel-major features reshape to C-contiguous rows without a copy (XGBoost would copy others).
            rows = np.ascontiguousarray(feats.reshape(-1, feats.shape[-1]), dtype=self.feature_dtype)
            out[r0:r1, c0:c1] = self.model_.predict_proba(rows).reshape(r1 - r0, c1 - c0, k)
            if on_progress:
                on_progress(i + 1, len(regions))
        if self.crf:
            out = dense_crf_tiled(out, x, self.tile, CRF_OVERLAP, self.crf, **self.crf_params)
        return out

    def predict_proba(self, images, scaled: bool = False, on_progress=None) -> list[np.ndarray]:
        """Per image an (H, W, K) float32 array of class probabilities, classes ordered as ``classes_``.

        scaled: the images are already the output of :meth:`scale` (so a caller that needs the scaled
        image too scales once). on_progress(done, total): called after each tile of each image."""
        self._check_fitted()
        xs = _as_list(images, "images") if scaled else self._prepare(images)
        return [self._proba_one(x, on_progress) for x in tqdm(xs, desc="segment", disable=not self.progress)]

    def predict(self, images, scaled: bool = False) -> list[np.ndarray]:
        """Per image an (H, W) int64 mask of class values (those in the training labels); ``scaled`` as
        in :meth:`predict_proba`."""
        self._check_fitted()
        xs = _as_list(images, "images") if scaled else self._prepare(images)
        return [self.mask_from_proba(self._proba_one(x)) for x in tqdm(xs, desc="segment", disable=not self.progress)]

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
                "modal": self.modal}

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
        seg.model_ = load_classifier(cfg["classifier"], path / "classifier.json")
        if seg.vit is not None:
            pca = path / "vit_pca.npz"
            if not pca.is_file():
                raise FileNotFoundError(f"{pca} is missing")
            with np.load(pca, allow_pickle=False) as state:
                seg.vit.load_state(state)
        return seg
