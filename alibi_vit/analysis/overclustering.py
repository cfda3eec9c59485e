"""OverClustering: k-means on frozen patch features, clusters mapped to classes (README.md "Method" §9).

k-means with k clusters runs over the features of a whole set; each cluster is then given a
class: for k == num_classes by Hungarian matching on IoU (scipy's ``linear_sum_assignment``),
for k > num_classes many-to-one (each cluster the class it overlaps most; a cluster that covers
no labelled feature goes to class 0, background). mIoU over the classes comes from one
confusion matrix over the whole set; the ignore label (255) counts nowhere; a class in neither
labels nor mapped predictions has no IoU (NaN) and is left out of the mean, as in the
segmentation probe.

k-means: faiss when it is installed, else scikit-learn: ``KMeans`` for up to ``full_kmeans_max``
points, ``MiniBatchKMeans`` fed float32 chunks of the features beyond that, so memory stays at
the features as given (float16 is fine) plus one chunk and the centroids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["OverclusteringResult", "cluster_features", "labels_to_patch_grid", "map_clusters", "miou_from_clusters",
           "overclustering", "overclustering_miou"]

IGNORE_INDEX = 255


@dataclass
class OverclusteringResult:
    """mIoU, per-class IoU (NaN for a class absent from labels and predictions), cluster → class map."""

    miou: float
    per_class_iou: np.ndarray
    cluster_to_class: np.ndarray
    k: int


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


def cluster_features(features, k: int, seed: int = 0, full_kmeans_max: int = 100_000, chunk: int = 65_536,
                     epochs: int = 3, backend: str = "auto") -> np.ndarray:
    """k-means cluster ids (M,) int64 of flat features (M, C).

    Args:
        features: (M, C) array or tensor, any float dtype (float16 keeps the memory down; chunks are
            converted to float32 as they are used).
        k: clusters.
        seed: seeds the initialisation and the chunk order.
        full_kmeans_max: up to this many points scikit-learn's ``KMeans`` (k-means++, 3 inits) runs
            on all of them; beyond it ``MiniBatchKMeans`` sees ``epochs`` passes of ``chunk``-point chunks.
        backend: ``auto`` (faiss if importable, else scikit-learn), ``faiss`` or ``sklearn``.
    """
    x = _to_numpy(features)
    if x.ndim != 2:
        raise ValueError(f"features must be flat (M, C), got shape {x.shape}")
    m = x.shape[0]
    if k < 1 or k > m:
        raise ValueError(f"k={k} clusters for {m} points: k must be between 1 and the number of points")
    if backend not in ("auto", "faiss", "sklearn"):
        raise ValueError(f"backend must be auto, faiss or sklearn, got {backend!r}")
    if backend in ("auto", "faiss"):
        try:
            import faiss
        except ImportError:
            if backend == "faiss":
                raise ValueError("backend='faiss' but faiss is not installed (pip install faiss-cpu)") from None
            faiss = None
        if faiss is not None:
            return _faiss_kmeans(faiss, x, k, seed, chunk)
    rng = np.random.default_rng(seed)
    if m <= full_kmeans_max:
        from sklearn.cluster import KMeans

        return KMeans(n_clusters=k, n_init=3, random_state=seed).fit_predict(x.astype(np.float32)).astype(np.int64)
    from sklearn.cluster import MiniBatchKMeans

    chunk = max(int(chunk), 3 * k)  # the first chunk initialises the centroids (k-means++) and needs ≥ k points
    km = MiniBatchKMeans(n_clusters=k, random_state=seed, batch_size=chunk, n_init=3)
    for _ in range(epochs):
        order = rng.permutation(m)
        for start in range(0, m - chunk + 1 if m >= chunk else 1, chunk):
            idx = np.sort(order[start:start + chunk])  # sorted: contiguous reads from a memory map
            km.partial_fit(x[idx].astype(np.float32))
    return _predict_chunks(lambda a: km.predict(a), x, chunk)


def _predict_chunks(predict, x: np.ndarray, chunk: int) -> np.ndarray:
    out = np.empty(x.shape[0], dtype=np.int64)
    for start in range(0, x.shape[0], chunk):
        out[start:start + chunk] = predict(x[start:start + chunk].astype(np.float32))
    return out


def _faiss_kmeans(faiss, x: np.ndarray, k: int, seed: int, chunk: int) -> np.ndarray:
    # faiss samples at most max_points_per_centroid·k points for training: memory stays bounded
    km = faiss.Kmeans(x.shape[1], k, niter=20, seed=seed, verbose=False)
    sample = min(x.shape[0], 256 * k)
    idx = np.sort(np.random.default_rng(seed).choice(x.shape[0], sample, replace=False))
    km.train(np.ascontiguousarray(x[idx], dtype=np.float32))
    return _predict_chunks(lambda a: km.index.search(np.ascontiguousarray(a), 1)[1][:, 0], x, chunk)


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


def miou_from_clusters(clusters, labels, k: int, num_classes: int,
                       ignore_index: int = IGNORE_INDEX) -> OverclusteringResult:
    """OverClustering scores of given cluster ids (M,) in 0..k−1 against labels (M,)."""
    clusters = _to_numpy(clusters)
    _check_k(k, num_classes)
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
    per_class = np.where(union > 0, tp / np.maximum(union, 1), np.nan)
    present = union > 0
    miou = float(per_class[present].mean()) if present.any() else float("nan")
    return OverclusteringResult(miou, per_class, mapping, k)


def overclustering(features, labels, k: int, num_classes: int, seed: int = 0, ignore_index: int = IGNORE_INDEX,
                   **kmeans_options) -> OverclusteringResult:
    """k-means of flat features (M, C) into k clusters, scored against labels (M,); see :func:`cluster_features`
    for ``kmeans_options``. Every point is clustered, labelled or not; the ignore label only drops out of
    the matching and the score."""
    x = _to_numpy(features)
    if x.ndim != 2:
        raise ValueError(f"features must be flat (M, C), got shape {x.shape}")
    _check_k(k, num_classes)
    labels = _check_labels(labels, x.shape[0], num_classes, ignore_index)
    clusters = cluster_features(x, k, seed=seed, **kmeans_options)
    return miou_from_clusters(clusters, labels, k, num_classes, ignore_index)


def overclustering_miou(features, labels, k: int, num_classes: int, seed: int = 0,
                        ignore_index: int = IGNORE_INDEX) -> float:
    """OverClustering mIoU (README.md "Method" §9) of flat features (M, C) against labels (M,).

    Args:
        features: (M, C) float array or tensor (float16 is fine).
        labels: (M,) integer classes 0..num_classes−1, or ``ignore_index``.
        k: k-means clusters, at least ``num_classes`` (Hungarian matching when equal, many-to-one above).
        num_classes: classes of the labels (21 for VOC).
        seed: k-means seed.
    """
    return overclustering(features, labels, k, num_classes, seed=seed, ignore_index=ignore_index).miou


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
