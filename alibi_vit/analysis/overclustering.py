"""OverClustering: k-means on frozen patch features, clusters mapped to classes (docs/method.md §9).

Three recipes (:data:`RECIPES`); the first two are the reference implementations' own, so their
numbers compare with those references' tables, the third is not comparable with any:

``leopart`` (Ziegler & Asano 2022, ``MkuuWaUjinga/leopart``, ``experiments/overcluster``)
    Patch features, every channel standardised (scikit-learn ``StandardScaler`` fitted and applied
    in chunks of 100,000 rows), PCA to 50 dimensions (faiss ``PCAMatrix`` fitted on all rows), then
    faiss k-means: random initialisation, ``niter=100``, ``nredo=5`` (the best of 5 runs by
    objective), at most 256 points per centroid (faiss trains on a seeded sample of k·256 points
    when there are more, then assigns every point), seeds 0–4. Each image's cluster map is
    nearest-upsampled to its 100×100 label mask. Leopart's inputs: 448 px images, VOC12 val in
    batches of 60 with the last partial batch dropped (1,440 of 1,449 images).
``rasa`` (the RASA reference, ``RobvanGastel/removing-pos-vit-bias``, ``rasa/metrics.py``)
    Pixels, not patches: the patch features are bilinearly upsampled (``align_corners=False``) to
    the label mask's size (224 px, the validation image size) and every pixel is a point; each
    channel is standardised as ``(x − mean) / (std + 1e-5)``; PCA to 50 dimensions (faiss, fitted
    on the first 4,000,000 pixels); faiss k-means with ``niter=50``, ``nredo=5``, 256 points per
    centroid, one seed (1). Its README's tables score the first 640 VOC12 val images (40 batches of
    16); its training config validates on the first 320 (10 batches of 32).
``kmeans++`` (this project's earlier recipe)
    As ``leopart`` but scikit-learn PCA (fitted on at most 200,000 random rows) and scikit-learn
    ``KMeans`` with k-means++ initialisation, 5 restarts, at most 50 iterations. Another k-means gives
    other clusters on the same features (``benchmarks/bench_overclustering.py``'s synthetic set at
    k = 21: 0.185 against leopart's 0.106), so its numbers compare with no reference table. It
    needs no faiss.

Scoring is the same for all: only pixels whose label is not the ignore index (255) count; for
k == num_classes clusters are matched to classes by Hungarian matching on IoU (scipy's
``linear_sum_assignment``), for k > num_classes each cluster goes to the class it overlaps most
(Leopart's precision-based many-to-one rule; a cluster that covers no labelled pixel goes to
class 0, background); mIoU comes from one confusion matrix over the whole set, a class absent
from labels and predictions counting as IoU 0 (Leopart's ``PredsmIoU``; ``absent="skip"`` leaves
such classes out). Nearest upsampling follows ``torch.nn.functional.interpolate(mode="nearest")``
exactly (its float32 source index), as both references resize with it.

With 50 channels or fewer there is no PCA (it would only rotate the points). faiss is imported
only by the ``leopart`` and ``rasa`` recipes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

__all__ = ["RECIPES", "OverclusteringResult", "OverclusteringSummary", "Recipe", "ReducedFeatures", "cluster_features",
           "get_recipe", "kmeans_clusters", "labels_to_patch_grid", "map_clusters", "miou_from_cluster_maps",
           "miou_from_clusters", "overclustering", "overclustering_miou", "overclustering_seeds",
           "reduce_features", "reduce_for_overclustering", "resize_labels_nearest", "score_overclustering",
           "upsample_nearest"]

IGNORE_INDEX = 255
PCA_DIM = 50
STANDARDISE_CHUNK = 100_000  # Leopart fits and applies its StandardScaler in chunks of this many rows
PIXEL_CHUNK = 1 << 18  # rows of upsampled pixel features handled at a time (the RASA recipe)


@dataclass(frozen=True)
class Recipe:
    """One OverClustering protocol: how features become points, how k-means runs, which inputs it expects.

    ``image_size``, ``mask_size`` (None: the image size) and ``max_images`` (None: all) are the
    inputs the reference used; ``alibi-vit overcluster`` takes them as its defaults.
    """

    name: str
    kmeans: str  # "faiss" (random initialisation, as both references) or "kmeans++" (scikit-learn)
    iterations: int
    restarts: int
    points_per_centroid: int | None  # faiss: k-means trains on at most k × this many points (a seeded sample)
    pixels: bool  # cluster every pixel of bilinearly upsampled features (RASA) instead of patches
    pca_rows: int | None  # faiss PCA fitted on the first this many rows (None: all); kmeans++: a random subset
    std_epsilon: float | None  # None: StandardScaler's scale; else each channel divided by std + epsilon
    seeds: tuple[int, ...]
    image_size: int
    mask_size: int | None
    max_images: int | None
    compares_with: str


RECIPES = {
    "leopart": Recipe("leopart", "faiss", iterations=100, restarts=5, points_per_centroid=256, pixels=False,
                      pca_rows=None, std_epsilon=None, seeds=(0, 1, 2, 3, 4), image_size=448, mask_size=100,
                      max_images=1440,
                      compares_with="Leopart's OverClustering tables (Ziegler & Asano 2022, VOC12 val)"),
    "rasa": Recipe("rasa", "faiss", iterations=50, restarts=5, points_per_centroid=256, pixels=True,
                   pca_rows=4_000_000, std_epsilon=1e-5, seeds=(1,), image_size=224, mask_size=None, max_images=640,
                   compares_with="the RASA reference's README tables (RobvanGastel/removing-pos-vit-bias: "
                                 "first 640 VOC12 val images)"),
    "kmeans++": Recipe("kmeans++", "kmeans++", iterations=50, restarts=5, points_per_centroid=None, pixels=False,
                       pca_rows=200_000, std_epsilon=None, seeds=(0, 1, 2, 3, 4), image_size=448, mask_size=100,
                       max_images=None,
                       compares_with="no reference table (not the references' k-means)"),
}


def get_recipe(recipe) -> Recipe:
    """A :class:`Recipe` or its name in :data:`RECIPES`."""
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown OverClustering recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[recipe]


@dataclass
class OverclusteringResult:
    """mIoU, per-class IoU (absent classes: 0, or NaN with ``absent="skip"``), cluster → class map."""

    miou: float
    per_class_iou: np.ndarray
    cluster_to_class: np.ndarray
    k: int


@dataclass
class OverclusteringSummary:
    """mIoU over several k-means seeds: mean, standard deviation (ddof 0), min, max, per seed; per-class mean."""

    k: int
    seeds: tuple
    mious: np.ndarray
    per_class_iou: np.ndarray
    results: list = field(repr=False, default_factory=list)
    recipe: str = "leopart"

    @property
    def miou(self) -> float:
        return float(np.mean(self.mious))

    @property
    def std(self) -> float:
        return float(np.std(self.mious))

    @property
    def min(self) -> float:
        return float(np.min(self.mious))

    @property
    def max(self) -> float:
        return float(np.max(self.mious))


@dataclass
class ReducedFeatures:
    """Features turned into k-means points by one recipe, with what scoring them needs.

    ``points`` (M, d) float32: one row per patch, or per pixel for a pixel recipe; ``labels``: flat
    (M,) labels scored one to one, or (B, H, W) masks; ``grid``: the (B, h, w) patch grid whose cluster
    maps are nearest-upsampled to the masks (None when the points are scored one to one).
    """

    points: np.ndarray
    labels: np.ndarray
    grid: tuple | None
    num_classes: int
    ignore_index: int
    recipe: Recipe


def _to_numpy(a):
    if hasattr(a, "detach"):  # torch tensors without importing torch here
        a = a.detach().cpu().numpy()
    return np.asarray(a)


def _faiss():
    try:
        import faiss
    except ImportError as err:  # pragma: no cover - faiss-cpu is a dependency
        raise ImportError("the leopart and rasa OverClustering recipes run faiss's k-means: pip install faiss-cpu "
                          "(the kmeans++ recipe does not need it)") from err
    return faiss


def _check_labels(labels, n: int, num_classes: int, ignore_index: int) -> np.ndarray:
    labels = _to_numpy(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be flat (M,), got shape {labels.shape}")
    if labels.shape[0] != n:
        raise ValueError(f"features hold {n} points but labels {labels.shape[0]}; they must match one to one")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers, got {labels.dtype}")
    valid = labels != ignore_index
    bad = valid & ((labels < 0) | (labels >= num_classes))
    if bad.any():
        values = np.unique(labels[bad])[:10].tolist()
        raise ValueError(f"labels {values} are neither classes 0..{num_classes - 1} nor the ignore index "
                         f"{ignore_index}")
    return labels


def _check_k(k: int, num_classes: int) -> None:
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    if k < num_classes:
        raise ValueError(f"k={k} clusters is fewer than the {num_classes} classes: OverClustering needs k >= "
                         "num_classes (k == num_classes: Hungarian matching; k > num_classes: many-to-one)")


def _check_absent(absent: str) -> None:
    if absent not in ("zero", "skip"):
        raise ValueError(f"absent must be 'zero' (Leopart: absent classes count as IoU 0) or 'skip', got {absent!r}")


# ---- features → points ---------------------------------------------------------------------------

def _row_chunks(x: np.ndarray) -> Callable[[], Iterator[np.ndarray]]:
    """Float32 chunks of the rows of flat features (any float dtype), as Leopart standardises them."""
    return lambda: (x[s:s + STANDARDISE_CHUNK].astype(np.float32) for s in range(0, x.shape[0], STANDARDISE_CHUNK))


def _pixel_chunks(maps: np.ndarray, size) -> Callable[[], Iterator[np.ndarray]]:
    """Float32 (pixels, C) chunks of (B, h, w, C) patch maps bilinearly upsampled to ``size`` (H, W), image by
    image in order, each image row-major: the RASA reference's ``interpolate(mode="bilinear")``."""
    import torch
    import torch.nn.functional as F

    H, W = size
    per_chunk = max(1, PIXEL_CHUNK // (H * W))

    def chunks():
        for start in range(0, maps.shape[0], per_chunk):
            block = torch.from_numpy(np.ascontiguousarray(maps[start:start + per_chunk], dtype=np.float32))
            up = F.interpolate(block.permute(0, 3, 1, 2), size=(H, W), mode="bilinear", align_corners=False)
            yield up.permute(0, 2, 3, 1).reshape(-1, maps.shape[3]).numpy()
    return chunks


def _standardiser(chunks, epsilon: float | None) -> Callable[[np.ndarray], np.ndarray]:
    """Per-channel statistics over every row (scikit-learn ``StandardScaler``, float64 accumulators), as a
    function that standardises float32 rows: ``StandardScaler.transform``, or ``(x − mean) / (std + epsilon)``."""
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler()
    for chunk in chunks():
        if len(chunk):
            scaler.partial_fit(chunk)
    if epsilon is None:
        return scaler.transform
    mean, scale = scaler.mean_, np.sqrt(scaler.var_) + epsilon
    return lambda chunk: ((chunk - mean) / scale).astype(np.float32)


def _faiss_reduce(chunks, n_rows: int, width: int, dim: int, pca_rows: int | None, epsilon: float | None) -> np.ndarray:
    """Standardise, then faiss PCA fitted on the first ``pca_rows`` rows (all: None) and applied to every row."""
    standardise = _standardiser(chunks, epsilon)
    n_fit = n_rows if pca_rows is None else min(pca_rows, n_rows)
    reduce = dim < width
    fit = np.empty((n_fit if reduce else n_rows, width), dtype=np.float32)
    filled = 0
    for chunk in chunks():
        if filled >= fit.shape[0]:
            break
        take = min(len(chunk), fit.shape[0] - filled)
        fit[filled:filled + take] = standardise(chunk)[:take]
        filled += take
    if not reduce:
        return fit
    pca = _faiss().PCAMatrix(width, dim)
    pca.train(fit)
    if n_fit == n_rows:
        return pca.apply_py(fit)  # one call over every row, as the references apply it
    del fit
    out = np.empty((n_rows, dim), dtype=np.float32)
    start = 0
    for chunk in chunks():
        out[start:start + len(chunk)] = pca.apply_py(np.ascontiguousarray(standardise(chunk)))
        start += len(chunk)
    return out


def _sklearn_reduce(x: np.ndarray, dim: int, fit_rows: int, seed: int = 0, chunk: int = 65_536) -> np.ndarray:
    """The kmeans++ recipe's reduction: StandardScaler (in chunks), scikit-learn PCA fitted on all rows up to
    ``fit_rows``, else on a seeded random subset of that many."""
    from sklearn.decomposition import PCA
    from sklearn.preprocessing import StandardScaler

    m, c = x.shape
    scaler = StandardScaler()
    for start in range(0, m, chunk):
        scaler.partial_fit(x[start:start + chunk].astype(np.float32))
    d = min(dim, c, m)
    pca = None
    if d < c:
        idx = np.arange(m) if m <= fit_rows else np.sort(np.random.default_rng(seed).choice(m, fit_rows, replace=False))
        pca = PCA(n_components=d, random_state=seed).fit(scaler.transform(x[idx].astype(np.float32)))
    out = np.empty((m, d), dtype=np.float32)
    for start in range(0, m, chunk):
        z = scaler.transform(x[start:start + chunk].astype(np.float32))
        out[start:start + chunk] = pca.transform(z) if pca is not None else z
    return out


def reduce_features(features, dim: int = PCA_DIM, recipe="leopart") -> np.ndarray:
    """Flat features (M, C) standardised per channel and reduced to ``dim`` dimensions with PCA, by a patch
    recipe (``leopart``: faiss PCA on every row; ``kmeans++``: scikit-learn PCA). Returns float32
    (M, min(dim, C)); with C <= ``dim`` only the standardisation is applied."""
    x = _to_numpy(features)
    if x.ndim != 2:
        raise ValueError(f"features must be flat (M, C), got shape {x.shape}")
    if dim < 1:
        raise ValueError(f"PCA dimension must be positive, got {dim}")
    m, c = x.shape
    if m == 0:
        raise ValueError("features hold no points")
    if not np.isfinite(x[: min(m, STANDARDISE_CHUNK)]).all():
        raise ValueError("features contain NaN or infinite values")
    recipe = get_recipe(recipe)
    if recipe.pixels:
        raise ValueError(f"recipe {recipe.name!r} clusters pixels of (B, h, w, C) maps; use reduce_for_overclustering")
    if recipe.kmeans == "kmeans++":
        return _sklearn_reduce(x, dim, recipe.pca_rows)
    return _faiss_reduce(_row_chunks(x), m, c, dim, recipe.pca_rows, recipe.std_epsilon)


def kmeans_clusters(points, k: int, seed: int = 0, recipe="leopart") -> np.ndarray:
    """Cluster ids (M,) int64 of already reduced points (M, d) by the recipe's k-means.

    faiss recipes: ``faiss.Kmeans`` (random initialisation, the recipe's ``niter``, ``nredo`` and
    ``max_points_per_centroid``, ``seed``), then every point assigned to its nearest centroid.
    ``kmeans++``: scikit-learn ``KMeans`` (k-means++, 5 restarts, at most 50 iterations, ``tol=0``).
    """
    recipe = get_recipe(recipe)
    x = np.ascontiguousarray(_to_numpy(points), dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"features must be flat (M, C), got shape {x.shape}")
    if k < 1 or k > x.shape[0]:
        raise ValueError(f"k={k} clusters for {x.shape[0]} points: k must be between 1 and the number of points")
    if recipe.kmeans == "kmeans++":
        from sklearn.cluster import KMeans

        km = KMeans(n_clusters=k, init="k-means++", n_init=recipe.restarts, max_iter=recipe.iterations, tol=0.0,
                    random_state=seed)
        return km.fit_predict(x).astype(np.int64)
    kmeans = _faiss().Kmeans(x.shape[1], k, niter=recipe.iterations, nredo=recipe.restarts, seed=int(seed),
                             max_points_per_centroid=recipe.points_per_centroid, spherical=False, verbose=False)
    kmeans.train(x)
    _, nearest = kmeans.index.search(x, 1)
    return nearest[:, 0].astype(np.int64)


def cluster_features(features, k: int, seed: int = 0, pca_dim: int = PCA_DIM, recipe="leopart") -> np.ndarray:
    """k-means cluster ids (M,) int64 of flat features (M, C): :func:`reduce_features` then
    :func:`kmeans_clusters`, both by ``recipe`` (a patch recipe)."""
    return kmeans_clusters(reduce_features(features, pca_dim, recipe=recipe), k, seed=seed, recipe=recipe)


# ---- nearest resizing -----------------------------------------------------------------------------

def _nearest_index(n_in: int, n_out: int) -> np.ndarray:
    """Source index of each output position for ``interpolate(mode="nearest")``: ⌊i · s⌋ with the scale
    s = n_in / n_out and the product both rounded to float32, as PyTorch computes it."""
    if n_in == n_out:
        return np.arange(n_out)
    scale = np.float32(n_in) / np.float32(n_out)
    return np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int64), n_in - 1)


def upsample_nearest(maps, size) -> np.ndarray:
    """(B, h, w) integer maps → (B, H, W) by nearest neighbour, exactly as torch's ``interpolate(mode="nearest")``."""
    maps = _to_numpy(maps)
    if maps.ndim != 3:
        raise ValueError(f"maps must be (B, h, w), got shape {maps.shape}")
    H, W = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    h, w = maps.shape[1:]
    return maps[:, _nearest_index(h, H)][:, :, _nearest_index(w, W)]


def resize_labels_nearest(labels, size: int = 100) -> np.ndarray:
    """(B, H, W) label masks → (B, size, size) by nearest neighbour (Leopart resizes VOC masks to 100×100)."""
    return upsample_nearest(labels, size)


# ---- scoring --------------------------------------------------------------------------------------

def _cluster_class_counts(clusters: np.ndarray, labels: np.ndarray, k: int, num_classes: int,
                          ignore_index: int) -> np.ndarray:
    valid = labels != ignore_index
    flat = clusters[valid].astype(np.int64) * num_classes + labels[valid].astype(np.int64)
    return np.bincount(flat, minlength=k * num_classes).reshape(k, num_classes)


def map_clusters(counts: np.ndarray, num_classes: int) -> np.ndarray:
    """Cluster → class (k,) from the (k, num_classes) overlap counts.

    k == num_classes: Hungarian matching maximising the summed IoU; k > num_classes: each cluster
    the class it overlaps most (ties: the lower class; a cluster with no labelled point: 0).
    """
    from scipy.optimize import linear_sum_assignment

    k = counts.shape[0]
    _check_k(k, num_classes)
    if k == num_classes:
        counts = counts.astype(np.float64)
        union = counts.sum(1, keepdims=True) + counts.sum(0, keepdims=True) - counts
        iou = np.divide(counts, union, out=np.zeros_like(counts), where=union > 0)
        rows, cols = linear_sum_assignment(iou, maximize=True)
        mapping = np.zeros(k, dtype=np.int64)  # a cluster left unmatched would be background
        mapping[rows] = cols
        return mapping
    return counts.argmax(1).astype(np.int64)


def miou_from_clusters(clusters, labels, k: int, num_classes: int, ignore_index: int = IGNORE_INDEX,
                       absent: str = "zero") -> OverclusteringResult:
    """OverClustering scores of given cluster ids (M,) in 0..k−1 against labels (M,), points matched one to one.

    ``absent="zero"`` (Leopart's ``PredsmIoU``): a class in neither labels nor mapped predictions has
    IoU 0 and counts in the mean; ``"skip"``: its IoU is NaN and it is left out of the mean.
    """
    clusters = _to_numpy(clusters)
    _check_k(k, num_classes)
    _check_absent(absent)
    labels = _check_labels(labels, clusters.shape[0], num_classes, ignore_index)
    if clusters.ndim != 1 or (clusters.size and (clusters.min() < 0 or clusters.max() >= k)):
        raise ValueError(f"cluster ids must be a flat array of values in 0..{k - 1}")
    counts = _cluster_class_counts(clusters, labels, k, num_classes, ignore_index)
    mapping = map_clusters(counts, num_classes)
    # confusion (label, predicted class) of the whole set: sum the cluster rows by their class
    confusion = np.zeros((num_classes, num_classes), dtype=np.float64)
    np.add.at(confusion.T, mapping, counts.astype(np.float64))
    tp = np.diag(confusion)
    union = confusion.sum(0) + confusion.sum(1) - tp
    present = union > 0
    if absent == "zero":
        per_class = tp / np.maximum(union, 1e-8)
        miou = float(per_class.mean())
    else:
        per_class = np.where(present, tp / np.maximum(union, 1), np.nan)
        miou = float(per_class[present].mean()) if present.any() else float("nan")
    return OverclusteringResult(miou, per_class, mapping, k)


def miou_from_cluster_maps(cluster_maps, masks, k: int, num_classes: int, ignore_index: int = IGNORE_INDEX,
                           absent: str = "zero") -> OverclusteringResult:
    """Pixel-level OverClustering scores: (B, h, w) cluster maps nearest-upsampled to the (B, H, W) masks' size,
    then :func:`miou_from_clusters` over the pixels (ignore-label pixels take no part)."""
    maps, masks = _to_numpy(cluster_maps), _to_numpy(masks)
    if maps.ndim != 3 or masks.ndim != 3 or maps.shape[0] != masks.shape[0]:
        raise ValueError(f"cluster maps (B, h, w) and masks (B, H, W) of the same B expected, got {maps.shape} "
                         f"and {masks.shape}")
    pixels = upsample_nearest(maps, masks.shape[1:])
    return miou_from_clusters(pixels.reshape(-1), masks.reshape(-1), k, num_classes, ignore_index, absent)


# ---- the whole evaluation -------------------------------------------------------------------------

def reduce_for_overclustering(features, labels, num_classes: int, recipe="leopart", ignore_index: int = IGNORE_INDEX,
                              pca_dim: int = PCA_DIM) -> ReducedFeatures:
    """Check the inputs and turn the features into the recipe's k-means points (done once for every k and seed).

    Args:
        features: flat (M, C) with flat labels (M,) (points scored one to one), or (B, h, w, C) patch maps
            with pixel masks (B, H, W). Patch recipes cluster the patches and nearest-upsample each cluster
            map to H×W; the ``rasa`` recipe upsamples the features bilinearly to H×W and clusters every pixel.
        labels: integer classes 0..num_classes−1 or ``ignore_index``.
    """
    recipe = get_recipe(recipe)
    x = _to_numpy(features)
    labels = _to_numpy(labels)
    if labels.ndim == 3:
        if x.ndim != 4:
            raise ValueError(f"with pixel masks (B, H, W) the features must be (B, h, w, C), got shape {x.shape}")
        if x.shape[0] != labels.shape[0]:
            raise ValueError(f"features hold {x.shape[0]} images but the masks {labels.shape[0]}")
        _check_labels(labels.reshape(-1), labels.size, num_classes, ignore_index)
    elif labels.ndim == 1:
        if x.ndim != 2:
            raise ValueError(f"with flat labels (M,) the features must be flat (M, C), got shape {x.shape}")
        labels = _check_labels(labels, x.shape[0], num_classes, ignore_index)
    else:
        raise ValueError(f"labels must be flat (M,) or pixel masks (B, H, W), got shape {labels.shape}")
    if recipe.pixels:
        if labels.ndim != 3:
            raise ValueError(f"recipe {recipe.name!r} clusters pixels: give (B, h, w, C) features and (B, H, W) masks")
        if not np.isfinite(x[:1]).all():
            raise ValueError("features contain NaN or infinite values")
        n_rows = labels.size
        points = _faiss_reduce(_pixel_chunks(x, labels.shape[1:]), n_rows, x.shape[3], pca_dim, recipe.pca_rows,
                               recipe.std_epsilon)
        return ReducedFeatures(points, labels.reshape(-1), None, num_classes, ignore_index, recipe)
    grid = x.shape[:3] if labels.ndim == 3 else None
    points = reduce_features(x.reshape(-1, x.shape[-1]), pca_dim, recipe=recipe)
    return ReducedFeatures(points, labels, grid, num_classes, ignore_index, recipe)


def score_overclustering(reduced: ReducedFeatures, k: int, seeds=None, absent: str = "zero") -> OverclusteringSummary:
    """k-means with ``k`` clusters for each seed (default: the recipe's) on reduced features, each scored."""
    recipe = reduced.recipe
    _check_k(k, reduced.num_classes)
    _check_absent(absent)
    seeds = recipe.seeds if seeds is None else tuple(int(s) for s in seeds)
    if not seeds:
        raise ValueError("give at least one k-means seed")
    results = []
    for seed in seeds:
        clusters = kmeans_clusters(reduced.points, k, seed=seed, recipe=recipe)
        if reduced.grid is None:
            results.append(miou_from_clusters(clusters, reduced.labels, k, reduced.num_classes,
                                              reduced.ignore_index, absent))
        else:
            results.append(miou_from_cluster_maps(clusters.reshape(reduced.grid), reduced.labels, k,
                                                  reduced.num_classes, reduced.ignore_index, absent))
    per_class = np.stack([r.per_class_iou for r in results])
    with np.errstate(invalid="ignore"):
        mean_per_class = per_class.mean(0)
    return OverclusteringSummary(k, seeds, np.array([r.miou for r in results]), mean_per_class, results, recipe.name)


def overclustering_seeds(features, labels, k: int, num_classes: int, seeds=None, ignore_index: int = IGNORE_INDEX,
                         absent: str = "zero", pca_dim: int = PCA_DIM, recipe="leopart") -> OverclusteringSummary:
    """OverClustering by ``recipe`` over several k-means seeds (default: the recipe's) on one reduced copy of
    the features: :func:`reduce_for_overclustering` then :func:`score_overclustering`.

    Args:
        features, labels: see :func:`reduce_for_overclustering`.
        k: clusters, at least ``num_classes``.
        seeds: k-means seeds; the summary holds their mean, spread and each result.
        absent: ``zero`` (Leopart) or ``skip``; see :func:`miou_from_clusters`.
        recipe: ``leopart`` (default), ``rasa`` or ``kmeans++`` (:data:`RECIPES`).
    """
    _check_k(k, num_classes)
    _check_absent(absent)
    reduced = reduce_for_overclustering(features, labels, num_classes, recipe, ignore_index, pca_dim)
    return score_overclustering(reduced, k, seeds, absent)


def overclustering(features, labels, k: int, num_classes: int, seed: int = 0, ignore_index: int = IGNORE_INDEX,
                   absent: str = "zero", pca_dim: int = PCA_DIM, recipe="leopart") -> OverclusteringResult:
    """One k-means seed of :func:`overclustering_seeds` (same inputs). Every point is clustered, labelled or
    not; the ignore label only drops out of the matching and the score."""
    return overclustering_seeds(features, labels, k, num_classes, (seed,), ignore_index, absent, pca_dim,
                                recipe).results[0]


def overclustering_miou(features, labels, k: int, num_classes: int, seed: int = 0,
                        ignore_index: int = IGNORE_INDEX, absent: str = "zero", recipe="leopart") -> float:
    """OverClustering mIoU (docs/method.md §9) of one k-means seed; inputs as :func:`overclustering_seeds`."""
    return overclustering(features, labels, k, num_classes, seed=seed, ignore_index=ignore_index, absent=absent,
                          recipe=recipe).miou


def labels_to_patch_grid(labels, patch_size, num_classes: int, ignore_index: int = IGNORE_INDEX) -> np.ndarray:
    """(B, H, W) pixel labels → (B, H/ph, W/pw) uint8: each patch gets the label most of its pixels have.

    The ignore label takes part in the vote (a patch mostly of object borders is ignored); ties go to
    the lower class, and a class always wins a tie with the ignore label. H and W must be multiples of
    the patch size (the images were resized to a multiple of it).
    """
    labels = _to_numpy(labels)
    ph, pw = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(int(p) for p in patch_size)
    if labels.ndim != 3:
        raise ValueError(f"labels must be (B, H, W), got shape {labels.shape}")
    B, H, W = labels.shape
    if H % ph or W % pw:
        raise ValueError(f"label size {H}×{W} is not a multiple of the patch size {ph}×{pw}")
    flat = labels.reshape(-1)
    _check_labels(flat, flat.shape[0], num_classes, ignore_index)
    votes = np.where(flat == ignore_index, num_classes, flat).astype(np.int64).reshape(B, H // ph, ph, W // pw, pw)
    h, w = H // ph, W // pw
    patch = np.arange(B * h * w).reshape(B, h, 1, w, 1)
    counts = np.bincount((patch * (num_classes + 1) + votes).reshape(-1), minlength=B * h * w * (num_classes + 1))
    winner = counts.reshape(B * h * w, num_classes + 1).argmax(1)
    return np.where(winner == num_classes, ignore_index, winner).astype(np.uint8).reshape(B, h, w)
