"""OverClustering mIoU (docs/method.md §9) on features and clusters whose answer is known, and its recipes
against small transcriptions of the reference implementations (Leopart's and the RASA reference's faiss calls)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from alibi_vit.analysis import overclustering as oc
from alibi_vit.analysis.overclustering import (cluster_features, labels_to_patch_grid, map_clusters,
                                               miou_from_cluster_maps, miou_from_clusters, overclustering,
                                               overclustering_miou, overclustering_seeds, reduce_features,
                                               upsample_nearest)

pytestmark = pytest.mark.usefixtures("one_thread")


def _blobs(num_classes=4, per_class=150, dim=8, sub=1, seed=0, spread=0.05):
    """Well-separated blobs; with ``sub`` > 1 each class is ``sub`` separate blobs."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(num_classes * sub, dim)) * 10
    labels = np.repeat(np.arange(num_classes), per_class * sub)
    blob = (labels * sub + np.tile(np.repeat(np.arange(sub), per_class), num_classes))
    features = centres[blob] + rng.normal(scale=spread, size=(len(labels), dim))
    return features.astype(np.float32), labels


def test_hand_computed_hungarian():
    # 3 clusters, 3 classes; clusters 0→class 2, 1→class 0, 2→class 1 are the IoU-maximising matching
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 255])
    clusters = np.array([1, 1, 2, 2, 2, 0, 0, 1, 0])
    r = miou_from_clusters(clusters, labels, 3, 3)
    assert r.cluster_to_class.tolist() == [2, 0, 1]
    # class 0: tp 2 (ids 0,1), pred 0 = cluster 1 = {0,1,7} → union = 3 + 3 − 2 = 4 → 0.5
    # class 1: tp 2 (ids 3,4), pred = cluster 2 = {2,3,4}, label 1 = {3,4} → union 3 → 2/3
    # class 2: tp 2 (ids 5,6), pred = cluster 0 = {5,6} (8 is ignored), label 2 = {5,6,7} → union 3 → 2/3
    np.testing.assert_allclose(r.per_class_iou, [0.5, 2 / 3, 2 / 3])
    assert r.miou == pytest.approx((0.5 + 2 / 3 + 2 / 3) / 3)


def test_hand_computed_many_to_one():
    labels = np.array([0, 0, 1, 1, 1, 2])
    clusters = np.array([0, 1, 2, 2, 3, 3])  # 4 clusters: 0,1 → class 0; 2 → 1; 3: tie (1 and 2) → 1
    r = miou_from_clusters(clusters, labels, 4, 3)
    assert r.cluster_to_class.tolist() == [0, 0, 1, 1]
    # class 0: 1.0; class 1: tp 3, union 4 → 0.75; class 2: tp 0, union 1 → 0
    np.testing.assert_allclose(r.per_class_iou, [1.0, 0.75, 0.0])


def test_absent_class_counts_zero_as_leopart_or_is_skipped():
    labels = np.array([0, 0, 1, 1])
    r = miou_from_clusters(np.array([0, 0, 1, 1]), labels, 3, 3)  # Leopart: tp / max(tp+fp+fn, 1e-8), mean of all
    assert r.per_class_iou.tolist() == [1.0, 1.0, 0.0] and r.miou == pytest.approx(2 / 3)
    r = miou_from_clusters(np.array([0, 0, 1, 1]), labels, 3, 3, absent="skip")
    assert np.isnan(r.per_class_iou[2]) and r.miou == 1.0
    with pytest.raises(ValueError, match="absent must be"):
        miou_from_clusters(np.array([0, 0, 1, 1]), labels, 3, 3, absent="nan")


def test_permutation_of_cluster_ids_changes_nothing():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, 500)
    labels[rng.random(500) < 0.1] = 255
    clusters = (labels % 255 + rng.integers(0, 3, 500) * (rng.random(500) < 0.4)) % 5
    for k in (5, 7, 9):  # Hungarian (k = classes) and many-to-one
        base = miou_from_clusters(clusters, labels, k, 5)
        perm = rng.permutation(k)
        again = miou_from_clusters(perm[clusters], labels, k, 5)
        assert again.miou == pytest.approx(base.miou)
        np.testing.assert_allclose(again.per_class_iou, base.per_class_iou)


@pytest.mark.parametrize("k, sub, recipe", [(4, 1, "leopart"), (9, 1, "leopart"), (4, 1, "kmeans++"),
                                            (12, 3, "kmeans++"), (9, 1, "kmeans++")])
def test_well_separated_blobs_score_near_one(k, sub, recipe):
    # (12 blobs for 12 clusters is left to k-means++: random initialisation, the references', may merge two blobs)
    features, labels = _blobs(sub=sub)
    assert overclustering_miou(features, labels, k, 4, recipe=recipe) > 0.98


def test_float16_features_and_chunked_statistics(monkeypatch):
    features, labels = _blobs(per_class=300, sub=2, dim=60)
    whole = reduce_features(features)
    assert whole.shape == (len(labels), 50)  # 60 channels → 50 PCA dimensions
    monkeypatch.setattr(oc, "STANDARDISE_CHUNK", 100)  # statistics merged over 12 chunks
    np.testing.assert_allclose(reduce_features(features), whole, atol=1e-4)
    monkeypatch.undo()
    assert overclustering(features.astype(np.float16), labels, 8, 4).miou > 0.98


def test_huge_nuisance_channel_still_clusters_by_class():
    # 4 classes in 59 channels; channel 59 is uniform noise 10⁴ times larger than the class separation
    features, labels = _blobs(per_class=200, dim=59, spread=1.0)
    rng = np.random.default_rng(1)
    nuisance = rng.uniform(-1, 1, size=(len(labels), 1)).astype(np.float32) * 1e5
    features = np.concatenate([features, nuisance], axis=1)
    from sklearn.cluster import KMeans  # without standardisation k-means splits along the nuisance channel

    raw = KMeans(4, n_init=5, random_state=0).fit_predict(features)
    assert miou_from_clusters(raw, labels, 4, 4).miou < 0.5
    assert overclustering_miou(features, labels, 4, 4) > 0.98


@pytest.mark.parametrize("recipe", ["leopart", "kmeans++"])
def test_standardised_pca_features(recipe):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 80)) * rng.uniform(0.01, 100, size=80) + rng.normal(size=80) * 50
    z = reduce_features(x.astype(np.float32), recipe=recipe)
    assert z.shape == (500, 50) and z.dtype == np.float32
    np.testing.assert_allclose(z.mean(0), 0, atol=1e-3)
    # PCA of standardised data: component variances are the top eigenvalues of the correlation matrix
    eig = np.sort(np.linalg.eigvalsh(np.corrcoef(x, rowvar=False)))[::-1][:50]
    np.testing.assert_allclose(z.var(0), eig, rtol=1e-3)  # StandardScaler: ddof 0


def test_upsample_nearest_by_hand():
    maps = np.array([[[1, 2], [3, 4]]])
    np.testing.assert_array_equal(upsample_nearest(maps, 4)[0], [[1, 1, 2, 2], [1, 1, 2, 2], [3, 3, 4, 4],
                                                                [3, 3, 4, 4]])
    np.testing.assert_array_equal(upsample_nearest(maps, (3, 2))[0], [[1, 2], [1, 2], [3, 4]])


@pytest.mark.parametrize("size_in, size_out", [((32, 28), (100, 100)), ((37, 21), (518, 518)), ((62, 76), (224, 448)),
                                               ((448, 333), (100, 100)), ((16, 16), (224, 224)), ((5, 9), (10, 3))])
def test_upsample_nearest_equals_torch(size_in, size_out):
    # both references resize float32 cluster maps and masks with interpolate(mode="nearest"), whose float32 source index
    # ⌊i · (n_in / n_out)⌋ differs from the exact ⌊i · n_in / n_out⌋ at e.g. 62 → 224 and 21 → 518
    maps = np.arange(np.prod(size_in)).reshape(1, *size_in)
    expected = F.interpolate(torch.from_numpy(maps)[None].float(), size=size_out, mode="nearest")[0].long().numpy()
    np.testing.assert_array_equal(upsample_nearest(maps, size_out), expected)


def test_pixel_scoring_equals_hand_computed_confusion():
    # one image, 2×2 cluster map → 4×4 pixels; 2 classes, 2 clusters (Hungarian)
    clusters = np.array([[[0, 1], [1, 1]]])
    masks = np.array([[[0, 0, 1, 255],
                       [0, 255, 1, 1],
                       [0, 0, 1, 1],
                       [255, 1, 1, 1]]])
    # upsampled clusters: rows 0-1 = [0 0 1 1], rows 2-3 = [1 1 1 1]; non-ignore pixels only:
    # cluster 0 covers label 0 ×3 (the 255 at (1,1) does not count); cluster 1 covers label 0 ×2, label 1 ×8
    # mapping 0→0, 1→1; confusion (label, pred) = [[3, 2], [0, 8]]
    # IoU 0 = 3 / (3 + 2 + 0) = 0.6; IoU 1 = 8 / (8 + 0 + 2) = 0.8
    r = miou_from_cluster_maps(clusters, masks, 2, 2)
    assert r.cluster_to_class.tolist() == [0, 1]
    np.testing.assert_allclose(r.per_class_iou, [0.6, 0.8])
    assert r.miou == pytest.approx(0.7)
    # the same through overclustering_seeds: features (B, h, w, C) whose k-means partition is the map above
    feats = np.array([[[[0.0, 0.0], [5.0, 5.0]], [[5.0, 5.1], [5.1, 5.0]]]], dtype=np.float32)
    summary = overclustering_seeds(feats, masks, 2, 2, seeds=(0, 1))
    np.testing.assert_allclose(summary.mious, [0.7, 0.7])
    assert summary.miou == pytest.approx(0.7) and summary.std == 0


def test_seeds_summary_reports_spread():
    features, labels = _blobs(sub=3, spread=3.0, dim=6)
    s = overclustering_seeds(features, labels, 6, 4, seeds=(0, 1, 2, 3, 4))
    assert s.mious.shape == (5,) and s.seeds == (0, 1, 2, 3, 4)
    assert s.miou == pytest.approx(s.mious.mean()) and s.std == pytest.approx(s.mious.std())
    assert s.min <= s.miou <= s.max
    assert s.mious[2] == pytest.approx(overclustering_miou(features, labels, 6, 4, seed=2))


def test_noise_scores_near_chance():
    rng = np.random.default_rng(0)
    n, c = 4000, 4
    features, labels = rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, c, n)
    chance = 1 / (2 * c - 1)  # random clusters vs. uniform random labels: |A∩B| / |A∪B| = (1/c²)/(2/c − 1/c²)
    assert abs(overclustering_miou(features, labels, c, c) - chance) < 0.04
    assert overclustering_miou(features, labels, 4 * c, c) < chance + 0.08


def test_kmeans_is_seeded():
    features, _ = _blobs(sub=3, spread=2.0)
    np.testing.assert_array_equal(cluster_features(features, 6, seed=1), cluster_features(features, 6, seed=1))


def test_pixel_inputs_checked():
    with pytest.raises(ValueError, match=r"must be \(B, h, w, C\)"):
        overclustering_seeds(np.zeros((4, 2), np.float32), np.zeros((1, 4, 4), int), 2, 2)
    with pytest.raises(ValueError, match="2 images but the masks 1"):
        overclustering_seeds(np.zeros((2, 2, 2, 3), np.float32), np.zeros((1, 4, 4), int), 2, 2)


@pytest.mark.parametrize("labels, k, match", [
    (np.zeros(9, dtype=int), 2, "fewer than the 3 classes"),
    (np.zeros(8, dtype=int), 3, "9 points but labels 8"),
    (np.array([0, 1, 2, 3, 0, 0, 0, 0, 0]), 3, r"labels \[3\] are neither classes 0..2"),
    (np.array([0, -1, 0, 0, 0, 0, 0, 0, 0]), 3, r"labels \[-1\]"),
    (np.zeros(9, dtype=float), 3, "integers"),
])
def test_bad_input(labels, k, match):
    with pytest.raises(ValueError, match=match):
        overclustering_miou(np.zeros((9, 2), dtype=np.float32), labels, k, 3)


def test_map_clusters_refuses_too_few_clusters():
    with pytest.raises(ValueError, match="k >= num_classes"):
        map_clusters(np.ones((2, 3)), 3)


def test_labels_to_patch_grid_by_hand():
    # one 4×6 label map, 2×3 patches → a 2×2 grid
    labels = np.array([[[0, 0, 1, 2, 2, 2],
                        [0, 1, 1, 2, 255, 255],
                        [255, 255, 255, 3, 3, 0],
                        [255, 255, 1, 3, 0, 0]]])
    expected = [[[0, 2], [255, 0]]]  # ties (top-left 0 vs 1, bottom-right 3 vs 0) go to the lower class
    np.testing.assert_array_equal(labels_to_patch_grid(labels, (2, 3), 4), expected)
    with pytest.raises(ValueError, match="not a multiple"):
        labels_to_patch_grid(labels, 4, 4)
    with pytest.raises(ValueError, match=r"labels \[3\]"):
        labels_to_patch_grid(labels, (2, 3), 3)


# ---- the recipes against transcriptions of the reference code ----------------------------------

def _hard_set(n_img=8, grid=28, channels=64, mask=100, seed=0):
    """(B, h, w, C) float32 features and (B, mask, mask) masks: rectangles of 20 classes on background, each class
    three sub-centres, noise as large as the class separation, a shared positional pattern, 5 % of pixels ignored.
    k-means finds little here (mIoU ~0.15-0.3), so the clustering details decide the score."""
    rng = np.random.default_rng(seed)
    lab = np.zeros((n_img, grid, grid), np.int64)
    for b in range(n_img):
        for _ in range(4):
            c = rng.integers(1, 21)
            y0, x0 = rng.integers(0, grid - grid // 4 - 1, 2)
            hh, ww = rng.integers(max(2, grid // 7), max(3, 4 * grid // 7), 2)
            lab[b, y0:y0 + hh, x0:x0 + ww] = c
    centres = rng.normal(size=(21, 3, channels))
    feats = centres[lab, rng.integers(0, 3, lab.shape)] + rng.normal(size=lab.shape + (channels,))
    feats += 0.5 * rng.normal(size=(1, grid, grid, channels))
    idx = (np.arange(mask) * grid) // mask
    masks = lab[:, idx][:, :, idx].copy()
    masks[rng.random(masks.shape) < 0.05] = 255
    return feats.astype(np.float32), masks


def _reference_miou(gt, pred, num_pred, num_gt=21):
    """Leopart's / the RASA reference's ``PredsmIoU.compute_miou``: Hungarian on 1 − IoU for num_pred == num_gt
    (unmatched → 0), else each prediction to the first class of highest precision; IoU per class, plain mean."""
    from scipy.optimize import linear_sum_assignment

    tp = np.array([[np.sum((gt == c) & (pred == p)) for p in range(num_pred)] for c in range(num_gt)], float)
    fp, fn = tp.sum(0, keepdims=True) - tp, tp.sum(1, keepdims=True) - tp
    remap = np.zeros(num_pred, np.int64)
    if num_pred == num_gt:
        rows, cols = linear_sum_assignment(1 - tp / np.maximum(tp + fp + fn, 1e-8))
        remap[cols] = rows
    else:
        remap[:] = np.argmax(tp / np.maximum(tp + fp, 1e-8), axis=0)
    out = remap[pred]
    return float(np.mean([np.sum((gt == c) & (out == c)) / max(np.sum((gt == c) | (out == c)), 1e-8)
                          for c in range(num_gt)]))


def _leopart(feats, masks, k, seeds):
    """Leopart's ``normalize_and_transform`` + ``cluster`` + the scoring of ``sup_overcluster.py``, written out."""
    import faiss
    from sklearn.preprocessing import StandardScaler

    n, h, w, c = feats.shape
    x = feats.reshape(-1, c).copy()
    scaler = StandardScaler()
    for i in range(0, len(x), 100000):
        scaler.partial_fit(x[i:i + 100000])
    for i in range(0, len(x), 100000):
        x[i:i + 100000] = scaler.transform(x[i:i + 100000])
    pca = faiss.PCAMatrix(c, 50)
    pca.train(x)
    x = pca.apply_py(x)
    gt = torch.from_numpy(masks)[:, None]
    valid = gt != 255
    scores = []
    for seed in seeds:
        kmeans = faiss.Kmeans(50, k, niter=100, nredo=5, verbose=False, gpu=False, spherical=False, seed=seed)
        kmeans.train(x)
        _, assigned = kmeans.index.search(x, 1)
        maps = torch.from_numpy(assigned.squeeze().reshape(-1, 1, h, w)).float()
        pixels = F.interpolate(maps, size=masks.shape[1:], mode="nearest")
        scores.append(_reference_miou(gt[valid].numpy(), pixels[valid].long().numpy(), k))
    return scores


def _rasa_reference(feats, masks, k, seed=1):
    """The RASA reference's ``PredsmIoUKmeans.compute`` (features bilinearly upsampled to the masks, every pixel
    clustered), written out."""
    import faiss

    emb = F.interpolate(torch.from_numpy(feats).permute(0, 3, 1, 2), size=masks.shape[1:], mode="bilinear")
    emb = emb.permute(0, 2, 3, 1).reshape(-1, feats.shape[3]).numpy()
    z = (emb - np.mean(emb, axis=0)) / (np.std(emb, axis=0, ddof=0) + 1e-5)
    pca = faiss.PCAMatrix(feats.shape[3], 50)
    pca.train(z[:4000000])
    z = pca.apply_py(z)
    kmeans = faiss.Kmeans(50, k, niter=50, nredo=5, seed=seed, verbose=False, gpu=False, spherical=False)
    kmeans.train(z)
    _, assigned = kmeans.index.search(z, 1)
    valid = masks != 255
    return _reference_miou(masks[valid], assigned.squeeze().reshape(masks.shape)[valid], k)


@pytest.mark.parametrize("k", [21, 30])
def test_leopart_recipe_equals_leopart_faiss_call(k):
    # 8 × 28 × 28 = 6,272 patches: at k = 21 faiss trains on its seeded sample of 21 × 256 = 5,376 of them
    feats, masks = _hard_set()
    seeds = (0, 3)
    summary = overclustering_seeds(feats, masks, k, 21, seeds=seeds, recipe="leopart")
    np.testing.assert_allclose(summary.mious, _leopart(feats, masks, k, seeds), rtol=0, atol=1e-6)
    assert summary.recipe == "leopart" and summary.seeds == seeds
    # on this set the project's earlier k-means++ is another protocol: other numbers
    kmeanspp = overclustering_seeds(feats, masks, k, 21, seeds=seeds, recipe="kmeans++")
    assert abs(kmeanspp.miou - summary.miou) > 1e-3


def test_rasa_recipe_equals_rasa_reference_pixel_clustering():
    # 6 images of 8×8 patches upsampled to 40×40 pixels: 9,600 points, of which faiss trains on 5,376 at k = 21
    feats, masks = _hard_set(n_img=6, grid=8, mask=40, seed=1)
    summary = overclustering_seeds(feats, masks, 21, 21, recipe="rasa")
    assert summary.seeds == (1,)  # the reference's one seed
    # the reference averages in float32, the recipe in float64: equal up to rounding
    assert summary.miou == pytest.approx(_rasa_reference(feats, masks, 21), abs=1e-6)


def test_rasa_recipe_needs_maps_and_masks():
    features, labels = _blobs()
    with pytest.raises(ValueError, match="recipe 'rasa' clusters pixels"):
        overclustering_seeds(features, labels, 4, 4, recipe="rasa")
    with pytest.raises(ValueError, match="unknown OverClustering recipe 'faiss'"):
        overclustering_seeds(features, labels, 4, 4, recipe="faiss")


def test_benchmark_recipe_run_reports_its_sizes():
    from tests.helpers import benchmark_module

    bench = benchmark_module("bench_overclustering")
    run = bench.run_recipe("rasa", dim=64, smoke=True)  # 4 images of 4×4 patches, masks 28×28: pixels clustered
    assert run["points"] == 4 * 28 * 28 and [r["k"] for r in run["runs"]] == [21, 30]
    assert run["computed_points_mb"] == pytest.approx(4 * 28 * 28 * 50 * 4 / 2**20, abs=0.5)
    assert all(0 < r["mIoU"] <= 1 for r in run["runs"])
