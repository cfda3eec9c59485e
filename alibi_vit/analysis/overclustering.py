"""OverClustering: k-means on frozen patch features, clusters mapped to classes (docs/method.md §9).

The recipe is Leopart's and the RASA reference's:

1. features: every channel standardised (scikit-learn ``StandardScaler``, fitted in chunks) and
   reduced to 50 dimensions with ``PCA`` (fitted on at most ``pca_fit_max`` points; no reduction
   when there are 50 channels or fewer);
2. k-means: scikit-learn ``KMeans`` and nothing else, with fixed settings — k-means++, 5 restarts,
   at most 50 Lloyd iterations with ``tol=0`` (faiss's ``niter=50, nredo=5``: it stops early only
   at an exact fixed point) — so results do not depend on which optional packages are installed;
3. scoring on pixels: the (h, w) cluster map of each image is nearest-upsampled to the size of its
   label mask (100×100 in the ``overcluster`` command, Leopart's protocol) and only non-ignore
   pixels (label ≠ 255) are scored, so the ignore label takes part in no vote;
4. clusters → classes: for k == num_classes Hungarian matching on IoU (scipy's
   ``linear_sum_assignment``), for k > num_classes many-to-one (each cluster the class it overlaps
   most; a cluster that covers no labelled pixel goes to class 0, background);
5. mIoU from one confusion matrix over the whole set. A class absent from both labels and
   predictions counts as IoU 0 in the mean, as in Leopart's ``PredsmIoU`` (tp / max(tp+fp+fn, 1e-8),
   then ``np.mean`` over all classes); ``absent="skip"`` leaves such classes out instead;
6. :func:`overclustering_seeds` repeats the k-means for 5 seeds and reports the mean and the spread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["OverclusteringResult", "OverclusteringSummary", "cluster_features", "kmeans_clusters",
           "labels_to_patch_grid", "map_clusters", "miou_from_cluster_maps", "miou_from_clusters", "overclustering", "overclustering_miou",
           "overclustering_seeds", "reduce_features", "upsample_nearest", "resize_labels_nearest"]

IGNORE_INDEX = 255
PCA_DIM = 50
KMEANS_RESTARTS = 5
KMEANS_ITERATIONS = 50
SEEDS = (0, 1, 2, 3, 4)


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


def _to_numpy(a):
    if hasattr(a, "detach"):  # torch tensors without importing torch here
        a = a.detach().cpu().numpy()
    return np.asarray(a)


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


def reduce_features(features, dim: int = PCA_DIM, seed: int = 0, pca_fit_max: int = 200_000,
                    chunk: int = 65_536) -> np.ndarray:
    """Standardise every channel of flat features (M, C) and reduce them to ``dim`` dimensions with PCA.

    Returns float32 (M, min(dim, C)). Statistics are gathered in chunks (float16 input is fine);
    PCA is fitted on all points up to ``pca_fit_max``, else on a seeded random subset of that many,
    and applied to every point. With C <= ``dim`` only the standardisation is applied (PCA would
    only rotate the points, which changes no k-means partition).
    """
    from sklearn.decomposition import PCA
    from sklearn.preprocessing import StandardScaler

    x = _to_numpy(features)
    if x.ndim != 2:
        raise ValueError(f"features must be flat (M, C), got shape {x.shape}")
    if dim < 1:
        raise ValueError(f"PCA dimension must be positive, got {dim}")
    m, c = x.shape
    if m == 0:
        raise ValueError("features hold no points")
    if not np.isfinite(x[: min(m, chunk)]).all():
        raise ValueError("features contain NaN or infinite values")
    scaler = StandardScaler()
    for start in range(0, m, chunk):
        scaler.partial_fit(x[start:start + chunk].astype(np.float32))
    d = min(dim, c, m)
    pca = None
    if d < c:
        idx = np.arange(m) if m <= pca_fit_max else np.sort(
            np.random.default_rng(seed).choice(m, pca_fit_max, replace=False))
        pca = PCA(n_components=d, random_state=seed).fit(scaler.transform(x[idx].astype(np.float32)))
    out = np.empty((m, d), dtype=np.float32)
    for start in range(0, m, chunk):
        z = scaler.transform(x[start:start + chunk].astype(np.float32))
        out[start:start + chunk] = pca.transform(z) if pca is not None else z
    return out


def kmeans_clusters(points, k: int, seed: int = 0) -> np.ndarray:
    """Cluster ids (M,) int64 of already reduced points (M, d): scikit-learn ``KMeans``, k-means++,
    ``KMEANS_RESTARTS`` restarts, at most ``KMEANS_ITERATIONS`` Lloyd iterations, ``tol=0``."""
    from sklearn.cluster import KMeans

    x = np.ascontiguousarray(_to_numpy(points), dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"features must be flat (M, C), got shape {x.shape}")
    if k < 1 or k > x.shape[0]:
        raise ValueError(f"k={k} clusters for {x.shape[0]} points: k must be between 1 and the number of points")
    km = KMeans(n_clusters=k, init="k-means++", n_init=KMEANS_RESTARTS, max_iter=KMEANS_ITERATIONS, tol=0.0,
                random_state=seed)
    return km.fit_predict(x).astype(np.int64)


def cluster_features(features, k: int, seed: int = 0, pca_dim: int = PCA_DIM) -> np.ndarray:
    """k-means cluster ids (M,) int64 of flat features (M, C): :func:`reduce_features` then
    :func:`kmeans_clusters` (the fixed recipe of docs/method.md §9)."""
    return kmeans_clusters(reduce_features(features, pca_dim), k, seed=seed)


def upsample_nearest(maps, size) -> np.ndarray:
    """(B, h, w) integer maps → (B, H, W) by nearest neighbour (source index ⌊i·h/H⌋, as torch's ``nearest``)."""
    maps = _to_numpy(maps)
    if maps.ndim != 3:
        raise ValueError(f"maps must be (B, h, w), got shape {maps.shape}")
    H, W = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    h, w = maps.shape[1:]
    rows = (np.arange(H) * h) // H
    cols = (np.arange(W) * w) // W
    return maps[:, rows][:, :, cols]


def resize_labels_nearest(labels, size: int = 100) -> np.ndarray:
    """(B, H, W) label masks → (B, size, size) by nearest neighbour (Leopart resizes VOC masks to 100×100)."""
    return upsample_nearest(labels, size)


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


def _score(clusters: np.ndarray, labels: np.ndarray, grid, k: int, num_classes: int, ignore_index: int,
           absent: str) -> OverclusteringResult:
    if labels.ndim == 1:
        return miou_from_clusters(clusters, labels, k, num_classes, ignore_index, absent)
    return miou_from_cluster_maps(clusters.reshape(grid), labels, k, num_classes, ignore_index, absent)


def _prepare(features, labels, num_classes: int, ignore_index: int):
    """Flat features (M, C), labels (flat (M,) or pixel masks (B, S, S)), and the (B, h, w) grid for masks."""
    x = _to_numpy(features)
    labels = _to_numpy(labels)
    grid = None
    if labels.ndim == 3:
        if x.ndim != 4:
            raise ValueError(f"with pixel masks (B, H, W) the features must be (B, h, w, C), got shape {x.shape}")
        if x.shape[0] != labels.shape[0]:
            raise ValueError(f"features hold {x.shape[0]} images but the masks {labels.shape[0]}")
        grid = x.shape[:3]
        x = x.reshape(-1, x.shape[3])
        _check_labels(labels.reshape(-1), labels.size, num_classes, ignore_index)
    elif labels.ndim == 1:
        if x.ndim != 2:
            raise ValueError(f"with flat labels (M,) the features must be flat (M, C), got shape {x.shape}")
        labels = _check_labels(labels, x.shape[0], num_classes, ignore_index)
    else:
        raise ValueError(f"labels must be flat (M,) or pixel masks (B, H, W), got shape {labels.shape}")
    return x, labels, grid


def overclustering_seeds(features, labels, k: int, num_classes: int, seeds=SEEDS, ignore_index: int = IGNORE_INDEX,
                         absent: str = "zero", pca_dim: int = PCA_DIM) -> OverclusteringSummary:
    """OverClustering over several k-means seeds (default 5) on one standardised, PCA-reduced copy of the features.

    Args:
        features: flat (M, C) with flat labels (M,) (points scored one to one), or (B, h, w, C) patch maps
            with pixel masks (B, H, W): the cluster maps are nearest-upsampled to H×W and the
            non-ignore pixels scored.
        labels: integer classes 0..num_classes−1 or ``ignore_index``.
        k: clusters, at least ``num_classes``.
        seeds: k-means seeds; the summary holds their mean, spread and each result.
        absent: ``zero`` (Leopart) or ``skip``; see :func:`miou_from_clusters`.
    """
    _check_k(k, num_classes)
    _check_absent(absent)
    seeds = tuple(int(s) for s in seeds)
    if not seeds:
        raise ValueError("give at least one k-means seed")
    x, labels, grid = _prepare(features, labels, num_classes, ignore_index)
    points = reduce_features(x, pca_dim)
    results = [_score(kmeans_clusters(points, k, seed=s), labels, grid, k, num_classes, ignore_index, absent)
               for s in seeds]
    per_class = np.stack([r.per_class_iou for r in results])
    with np.errstate(invalid="ignore"):
        mean_per_class = per_class.mean(0)
    return OverclusteringSummary(k, seeds, np.array([r.miou for r in results]), mean_per_class, results)


def overclustering(features, labels, k: int, num_classes: int, seed: int = 0, ignore_index: int = IGNORE_INDEX,
                   absent: str = "zero", pca_dim: int = PCA_DIM) -> OverclusteringResult:
    """One k-means seed of :func:`overclustering_seeds` (same inputs). Every point is clustered, labelled or
    not; the ignore label only drops out of the matching and the score."""
    return overclustering_seeds(features, labels, k, num_classes, (seed,), ignore_index, absent, pca_dim).results[0]


def overclustering_miou(features, labels, k: int, num_classes: int, seed: int = 0,
                        ignore_index: int = IGNORE_INDEX, absent: str = "zero") -> float:
    """OverClustering mIoU (docs/method.md §9) of one k-means seed; inputs as :func:`overclustering_seeds`."""
    return overclustering(features, labels, k, num_classes, seed=seed, ignore_index=ignore_index, absent=absent).miou


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
