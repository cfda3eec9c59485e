"""TrainableSegmenter: label convention, shapes, tiling, save/load, bad input, accuracy, CRF."""

import json

import numpy as np
import pytest
import torch

from alibi_vit.trainable import TrainableSegmenter, mean_iou, scribbles, synthetic_dataset
from alibi_vit.trainable.classical import classical_feature_names
from alibi_vit.trainable.segmenter import DEFAULT_CRF_PRESET, DEFAULT_FILTERS
from alibi_vit.trainable.classifier import balanced_weights
from helpers import TINY, tiny_model

FAST = dict(classifier_params={"n_estimators": 10, "n_jobs": 1}, sigmas=(0, 1, 4))


@pytest.fixture(scope="module")
def data():
    (tr, trm), (te, tem) = synthetic_dataset(2, 2, size=96, seed=1)
    labels = [scribbles(m, 2, rng=i) for i, m in enumerate(trm)]
    return tr, trm, labels, te, tem


def test_balanced_weights_give_every_class_the_same_total():
    y = np.array([0] * 90 + [1] * 9 + [2])
    w = balanced_weights(y)
    totals = [w[y == c].sum() for c in range(3)]
    np.testing.assert_allclose(totals, len(y) / 3, rtol=1e-6)


def test_unlabelled_pixels_are_ignored(data):
    tr, trm, labels, te, _ = data
    # intensity="dtype": an unlabelled image still shapes the fitted ("training") intensity range.
    seg = TrainableSegmenter(**FAST, intensity="dtype").fit(tr, labels)
    # Filling the unlabelled pixels with other values must not change anything once they are 0 again,
    # and a label 0 is never predicted.
    assert set(np.unique(seg.predict(te)[0])) <= {1, 2, 3}
    # Adding unlabelled (0) images or relabelling 0 pixels as 0 is a no-op; putting wrong labels there is not.
    seg2 = TrainableSegmenter(**FAST, intensity="dtype").fit(list(tr) + [tr[0]], labels + [np.zeros_like(labels[0])])
    np.testing.assert_array_equal(seg.predict_proba(te)[0], seg2.predict_proba(te)[0])
    noisy = [np.where(lab > 0, lab, 1) for lab in labels]
    seg3 = TrainableSegmenter(**FAST, intensity="dtype").fit(tr, noisy)
    assert not np.array_equal(seg.predict(te)[0], seg3.predict(te)[0])


def test_class_values_need_not_be_contiguous(data):
    tr, trm, labels, te, _ = data
    with pytest.warns(UserWarning, match=r"label values 1, 2, 7 are not 1\.\.3"):
        seg = TrainableSegmenter(**FAST).fit(tr, [np.where(lab == 3, 7, lab) for lab in labels])
    np.testing.assert_array_equal(seg.classes_, [1, 2, 7])
    assert set(np.unique(seg.predict(te)[0])) <= {1, 2, 7}
    proba = seg.predict_proba(te)[0]
    assert proba.shape == te[0].shape + (3,)
    np.testing.assert_allclose(proba.sum(-1), 1, atol=1e-5)


def test_classical_xgboost_reaches_high_miou_on_synthetic_3_phase():
    (tr, trm), (te, tem) = synthetic_dataset(3, 3, size=256, seed=0)
    rng = np.random.default_rng(0)
    labels = [scribbles(m, 3, rng) for m in trm]  # three scribbles per class per image
    seg = TrainableSegmenter(classifier_params={"n_jobs": 1}).fit(tr, labels)
    miou = np.mean([mean_iou(p, t) for p, t in zip(seg.predict(te), tem)])
    assert miou >= 0.8, miou


def test_random_forest_option_learns(data):
    tr, trm, labels, te, tem = data
    seg = TrainableSegmenter(classifier="random_forest", classifier_params={"n_estimators": 20, "n_jobs": 1},
                             sigmas=(0, 1, 4)).fit(tr, labels)
    assert np.mean([mean_iou(p, t) for p, t in zip(seg.predict(te), tem)]) > 0.5


def test_tiled_prediction_equals_whole_image_prediction(data):
    tr, trm, labels, te, _ = data
    seg = TrainableSegmenter(tiny_model(dtype=torch.float32), n_components=3, **FAST, tile=1008).fit(tr, labels)
    image = te[0][:70, :60]
    features, proba = seg.features(image), seg.predict_proba([image])[0]
    seg.tile = 28  # 28-px cores: 9 tiles, each featurised with its own margin
    np.testing.assert_allclose(seg.features(image), features, rtol=1e-5, atol=1e-5)  # float32 rounding
    np.testing.assert_allclose(seg.predict_proba([image])[0], proba, atol=1e-5)


@pytest.mark.parametrize("backbone", [None, "name", "module"])
def test_save_load_gives_identical_predictions(tmp_path, data, backbone):
    tr, trm, labels, te, _ = data
    kwargs = dict(FAST, n_components=3)
    if backbone == "name":
        seg = TrainableSegmenter("alibi_vit_small_patch14_reg4_dinov2", model_kwargs=TINY, **kwargs)
    elif backbone == "module":
        module = tiny_model(dtype=torch.float32)
        seg = TrainableSegmenter(module, **kwargs)
    else:
        seg = TrainableSegmenter(**kwargs)
    seg.fit(tr, labels)
    seg.save(tmp_path / "m")
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert "classifier.json" in files and "config.json" in files
    assert not any(name.endswith((".pkl", ".pickle", ".joblib")) for name in files)
    json.loads((tmp_path / "m" / "classifier.json").read_text())  # XGBoost's own JSON format
    if backbone == "module":
        with pytest.raises(ValueError, match="custom backbone"):
            TrainableSegmenter.load(tmp_path / "m")
        loaded = TrainableSegmenter.load(tmp_path / "m", backbone=module)
    else:
        loaded = TrainableSegmenter.load(tmp_path / "m")
    np.testing.assert_array_equal(seg.predict_proba(te)[0], loaded.predict_proba(te)[0])
    np.testing.assert_array_equal(seg.predict(te)[1], loaded.predict(te)[1])


def test_prediction_shape_equals_image_shape_for_any_size(data):
    tr, trm, labels, _, _ = data
    seg = TrainableSegmenter(tiny_model(dtype=torch.float32), n_components=3, **FAST).fit(tr, labels)
    rng = np.random.default_rng(0)
    for shape in ((45, 61), (97, 29), (10, 5)):  # no multiple of 14; the last smaller than a patch
        image = (rng.random(shape) * 60000).astype(np.uint16)
        assert seg.predict([image])[0].shape == shape
        assert seg.predict_proba([image])[0].shape == shape + (3,)


def test_bad_labels_give_clear_errors(data):
    tr, trm, labels, _, _ = data
    seg = TrainableSegmenter(**FAST)
    with pytest.raises(ValueError, match="px but its image is"):
        seg.fit(tr, [labels[0][:-1], labels[1]])
    with pytest.raises(ValueError, match="no labelled pixel"):
        seg.fit(tr, [np.zeros_like(lab) for lab in labels])
    with pytest.raises(ValueError, match="at least two classes"):
        seg.fit(tr, [np.where(lab > 0, 1, 0) for lab in labels])
    with pytest.raises(ValueError, match="non-integer"):
        seg.fit(tr, [lab + 0.5 for lab in labels])
    with pytest.raises(ValueError, match="RGB"):
        seg.fit(tr, [np.stack([lab] * 3, -1) for lab in labels])
    with pytest.raises(ValueError, match="3D stack"):
        seg.fit([np.stack([tr[0]] * 5)], [labels[0]])
    with pytest.raises(ValueError, match="3D stack"):
        seg.fit(np.stack([tr[0]] * 5), np.stack([labels[0]] * 5))
    with pytest.raises(ValueError, match="2 images but 1 label"):
        seg.fit(tr, labels[:1])
    with pytest.raises(ValueError, match="not trained"):
        seg.predict(tr)
    # Integer-valued float labels are fine: the same model as with integer labels.
    a = TrainableSegmenter(**FAST).fit(tr, [lab.astype(np.float32) for lab in labels]).predict(tr[:1])[0]
    b = TrainableSegmenter(**FAST).fit(tr, labels).predict(tr[:1])[0]
    np.testing.assert_array_equal(a, b)


def test_class_present_in_one_image_only(data):
    tr, trm, labels, te, _ = data
    only_first = [labels[0], np.where(labels[1] == 3, 0, labels[1])]
    seg = TrainableSegmenter(**FAST).fit(tr, only_first)
    np.testing.assert_array_equal(seg.classes_, [1, 2, 3])
    assert 3 in seg.predict(te)[0]


def test_dense_crf_smooths_noisy_probabilities():
    pytest.importorskip("pydensecrf")
    from alibi_vit.trainable import dense_crf

    # Two halves; probabilities right on average but noisy per pixel. The CRF must fix most errors.
    rng = np.random.default_rng(0)
    truth = np.zeros((40, 40), int)
    truth[:, 20:] = 1
    image = truth * 0.6 + 0.2
    p1 = np.clip(np.where(truth == 1, 0.65, 0.35) + rng.normal(0, 0.25, truth.shape), 0.01, 0.99)
    proba = np.stack([1 - p1, p1], -1).astype(np.float32)
    refined = dense_crf(proba, image)
    assert refined.shape == proba.shape
    np.testing.assert_allclose(refined.sum(-1), 1, atol=1e-4)
    err_before = (proba.argmax(-1) != truth).mean()
    err_after = (refined.argmax(-1) != truth).mean()
    assert err_before > 0.1 and err_after < 0.25 * err_before


def test_crf_option_predicts_and_survives_save_load(tmp_path, data):
    pytest.importorskip("pydensecrf")
    tr, trm, labels, te, tem = data
    plain = TrainableSegmenter(**FAST).fit(tr, labels)
    seg = TrainableSegmenter(**FAST, crf=True, crf_params={"iterations": 5}).fit(tr, labels)
    proba = seg.predict_proba(te[:1])[0]
    assert proba.shape == te[0].shape + (3,)
    np.testing.assert_allclose(proba.sum(-1), 1, atol=1e-4)
    assert not np.allclose(proba, plain.predict_proba(te[:1])[0], atol=1e-3)  # the CRF changed something
    seg.save(tmp_path / "crf")
    loaded = TrainableSegmenter.load(tmp_path / "crf")
    assert loaded.crf == DEFAULT_CRF_PRESET == "gentle" and loaded.crf_params == {"iterations": 5}  # crf=True
    np.testing.assert_array_equal(loaded.predict(te[:1])[0], seg.predict(te[:1])[0])


def test_training_intensity_is_fitted_once_stored_and_applied_unchanged(tmp_path, data):
    tr, trm, labels, te, _ = data
    seg = TrainableSegmenter(**FAST).fit(tr, labels)  # intensity="training" is the default
    pooled = np.concatenate([im.ravel() for im in tr]).astype(np.float64)
    lo, hi = np.percentile(pooled, (0.01, 99.99))
    np.testing.assert_allclose(seg.intensity_range, (lo, hi), rtol=1e-6)
    seg.save(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["format"] == 2 and cfg["intensity"] == "training"
    np.testing.assert_allclose(cfg["intensity_range"], (lo, hi), rtol=1e-6)
    loaded = TrainableSegmenter.load(tmp_path / "m")
    expected = np.clip((te[0].astype(np.float64) - lo) / (hi - lo), 0, 1)
    np.testing.assert_allclose(loaded.scale(te[0]), expected, atol=1e-6)
    # The mapping does not depend on what else the image holds: a test image lacking its bright
    # half (another composition) keeps the same value for every remaining pixel.
    cut = te[0].copy()
    cut[:, 48:] = cut[:, :48].min()
    np.testing.assert_array_equal(loaded.scale(cut)[:, :48], loaded.scale(te[0])[:, :48])
    np.testing.assert_array_equal(loaded.predict_proba(te)[1], seg.predict_proba(te)[1])
    assert cfg["intensity_dtype"] == "uint16"
    with pytest.warns(UserWarning, match="is uint8 but the model was trained on uint16 images"):
        loaded.scale((te[0] >> 4).astype(np.uint8))
    # predict(scaled=True) on the stored transform's output is predict() on the raw image.
    np.testing.assert_array_equal(loaded.predict([expected.astype(np.float32)], scaled=True)[0],
                                  loaded.predict([te[0]])[0])


def test_per_image_intensity_is_an_explicit_option(data):
    from alibi_vit.images import scale_intensity

    tr, trm, labels, te, _ = data
    seg = TrainableSegmenter(**FAST, intensity="percentile").fit(tr, labels)
    assert seg.intensity_range is None
    np.testing.assert_array_equal(seg.scale(te[0]), scale_intensity(te[0], "percentile"))
    with pytest.raises(ValueError, match="unknown intensity mode 'gamma'"):
        TrainableSegmenter(intensity="gamma")


def test_format_1_model_folders_still_load_and_unknown_formats_are_refused(tmp_path, data):
    tr, trm, labels, te, _ = data
    seg = TrainableSegmenter(**FAST, intensity="auto").fit(tr, labels)
    seg.save(tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["format"] = 1
    del cfg["intensity_range"]  # format 1 had per-image modes only
    cfg_path.write_text(json.dumps(cfg))
    np.testing.assert_array_equal(TrainableSegmenter.load(tmp_path / "m").predict(te)[0], seg.predict(te)[0])
    cfg["format"] = 99
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="format 99, this version reads formats 1, 2"):
        TrainableSegmenter.load(tmp_path / "m")


def test_sample_quotas_are_stratified_and_capped():
    from alibi_vit.trainable.segmenter import sample_quotas

    np.testing.assert_array_equal(sample_quotas([100, 60000, 5000], 2000), [100, 950, 950])
    np.testing.assert_array_equal(sample_quotas([10, 20, 30], 1000), [10, 20, 30])  # all fit
    np.testing.assert_array_equal(sample_quotas([700, 700, 700], 900), [300, 300, 300])


def _fit_recording(monkeypatch, image, lab, **kwargs):
    """Fit on one image; return the training rows' class counts and the numpy peak memory of fit()."""
    import tracemalloc

    import alibi_vit.trainable.classifier as classifier

    seen = {}
    real = classifier.make_classifier

    def recording(*a, **k):
        model = real(*a, **k)
        fit = model.fit

        def fit_and_record(X, Y, **kw):
            seen["X"], seen["Y"] = X.shape, np.bincount(Y)
            return fit(X, Y, **kw)
        model.fit = fit_and_record
        return model

    monkeypatch.setattr(classifier, "make_classifier", recording)
    seg = TrainableSegmenter(**FAST, **kwargs)
    tracemalloc.start()
    seg.fit([image], [lab])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seen, peak, seg


def test_training_memory_does_not_grow_with_labelled_area(monkeypatch):
    from alibi_vit.trainable import synthetic_micrograph

    image, truth = synthetic_micrograph(256, seed=3)
    sparse = scribbles(truth, 3, rng=0)
    kw = dict(max_samples=600, tile=56)
    _fit_recording(monkeypatch, image, sparse, **kw)  # warm-up: first-call allocations (imports, caches)
    s_seen, s_peak, _ = _fit_recording(monkeypatch, image, sparse, **kw)
    f_seen, f_peak, seg = _fit_recording(monkeypatch, image, truth, **kw)  # every pixel labelled
    n_features = len(seg.feature_names)
    assert s_seen["X"] == (600, n_features) == f_seen["X"]
    # Stratified: each class gets its quota of the cap (all three classes hold far more than 200 px).
    np.testing.assert_array_equal(f_seen["Y"], [200, 200, 200])
    # Gathering every labelled pixel's features first would need 65536 rows (> 10 MB here).
    all_rows = truth.size * n_features * 4
    assert f_peak < s_peak + 0.1 * all_rows, (f_peak, s_peak, all_rows)


def test_subsampling_is_seeded():
    from alibi_vit.trainable import synthetic_micrograph

    image, truth = synthetic_micrograph(64, seed=4)
    a, b, c = (TrainableSegmenter(**FAST, max_samples=300, seed=s).fit([image], [truth]) for s in (0, 0, 1))
    np.testing.assert_array_equal(a.predict_proba([image])[0], b.predict_proba([image])[0])
    assert not np.array_equal(a.predict_proba([image])[0], c.predict_proba([image])[0])


def _colour_set():
    """Two RGB uint8 images whose classes differ only in hue (equal luma), with scribbles."""
    from alibi_vit.trainable import synthetic_micrograph

    out = []
    for seed in (0, 1):
        _, mask = synthetic_micrograph(64, seed=seed)
        # Colours of (nearly) equal luma 0.299 R + 0.587 G + 0.114 B ≈ 120: grey cannot tell them apart.
        colours = np.array([[0, 0, 0], [200, 60, 160], [60, 150, 140], [120, 120, 120]], np.float64)
        rng = np.random.default_rng(seed)
        rgb = np.clip(colours[mask] + rng.normal(0, 6, mask.shape + (3,)), 0, 255).astype(np.uint8)
        out.append((rgb, mask, scribbles(mask, 2, rng=seed)))
    return out


def test_colour_features_are_the_grey_path_per_channel():
    (rgb, _, lab), (rgb2, _, lab2) = _colour_set()
    seg = TrainableSegmenter(**FAST, intensity="dtype").fit([rgb, rgb2], [lab, lab2])
    grey = TrainableSegmenter(**FAST, intensity="dtype")
    f = seg.features(rgb)
    n = len(classical_feature_names((0, 1, 4), DEFAULT_FILTERS))
    assert f.shape == rgb.shape[:2] + (3 * n,) and len(seg.feature_names) == 3 * n
    for c in range(3):  # each channel's block equals the grayscale features of that channel alone
        np.testing.assert_array_equal(f[..., c * n:(c + 1) * n], grey.features(rgb[..., c]))
    assert seg.feature_names[n].endswith("_g")


def test_colour_separates_phases_grey_cannot_and_mismatches_are_errors(tmp_path):
    data = _colour_set()
    images, masks, labels = zip(*data)
    colour = TrainableSegmenter(**FAST).fit(images[:1], labels[:1])
    grey = TrainableSegmenter(**FAST, colour="grey").fit(images[:1], labels[:1])
    miou_colour = mean_iou(colour.predict(images[1:])[0], masks[1])
    miou_grey = mean_iou(grey.predict(images[1:])[0], masks[1])
    assert miou_colour > 0.9 and miou_grey < miou_colour - 0.2, (miou_colour, miou_grey)
    # The fitted range pools the channels' values (alpha dropped), not their luma.
    np.testing.assert_allclose(colour.intensity_range, np.percentile(images[0].astype(float), (0.01, 99.99)),
                               rtol=1e-6)
    colour.save(tmp_path / "c")
    loaded = TrainableSegmenter.load(tmp_path / "c")
    np.testing.assert_array_equal(loaded.predict(images[1:])[0], colour.predict(images[1:])[0])
    rgba = np.concatenate([images[1], np.full(images[1].shape[:2] + (1,), 255, np.uint8)], -1)
    np.testing.assert_array_equal(loaded.predict([rgba])[0], colour.predict(images[1:])[0])
    with pytest.raises(ValueError, match="is grayscale but the model was trained on colour images"):
        loaded.predict([images[1][..., 0]])
    plain = TrainableSegmenter(**FAST).fit([images[0][..., 0]], labels[:1])
    with pytest.raises(ValueError, match="is a colour image but the model was trained on grayscale"):
        plain.predict([images[1]])
    with pytest.raises(ValueError, match="mix colour and grayscale"):
        TrainableSegmenter(**FAST).fit([images[0], images[1][..., 0]], labels)
    grey.predict([images[1][..., 0]])  # colour="grey" takes either kind


def test_vit_features_of_rgb_with_equal_channels_equal_the_grey_path():
    from alibi_vit.trainable.vit import vit_patch_features

    model = tiny_model(dtype=torch.float32)
    x = np.random.default_rng(0).random((30, 44)).astype(np.float32)
    np.testing.assert_allclose(vit_patch_features(model, np.stack([x] * 3, -1)), vit_patch_features(model, x),
                               atol=1e-6)
    rgb = np.stack([x, x[::-1], 1 - x], -1)
    assert not np.allclose(vit_patch_features(model, rgb), vit_patch_features(model, x), atol=1e-3)


def test_crf_presets_hold_the_values_they_are_named_for():
    from alibi_vit.trainable.crf import CRF_PRESETS

    assert CRF_PRESETS["paper"]["gaussian_sxy"] == 1 and CRF_PRESETS["paper"]["bilateral_sxy"] == 30
    assert CRF_PRESETS["library"]["gaussian_sxy"] == 3 and CRF_PRESETS["library"]["bilateral_sxy"] == 80
    with pytest.raises(ValueError, match="crf must be False, True or a preset"):
        TrainableSegmenter(crf="fancy")


def test_tiled_crf_equals_whole_image_crf_away_from_tile_borders():
    pytest.importorskip("pydensecrf")
    from alibi_vit.trainable.crf import dense_crf, dense_crf_tiled

    rng = np.random.default_rng(0)
    truth = (np.add.outer(np.arange(120), np.arange(100)) // 37 % 2).astype(int)
    image = (truth * 0.6 + 0.2 + rng.normal(0, 0.05, truth.shape)).astype(np.float32)
    p1 = np.clip(np.where(truth == 1, 0.65, 0.35) + rng.normal(0, 0.25, truth.shape), 0.01, 0.99)
    proba = np.stack([1 - p1, p1], -1).astype(np.float32)
    for preset in ("paper", "library"):
        whole = dense_crf(proba, image, preset)
        np.testing.assert_array_equal(dense_crf_tiled(proba, image, tile=128, preset=preset), whole)  # one tile
        tiled = dense_crf_tiled(proba, image, tile=40, overlap=24, preset=preset)  # 3×3 tiles
        assert (tiled.argmax(-1) == whole.argmax(-1)).mean() > 0.97
    assert not np.allclose(dense_crf(proba, image, "paper"), dense_crf(proba, image, "library"), atol=1e-3)


def test_format_1_crf_true_loads_as_the_library_preset(tmp_path, data):
    pytest.importorskip("pydensecrf")
    tr, trm, labels, te, _ = data
    seg = TrainableSegmenter(**FAST, crf="library", intensity="auto").fit(tr, labels)
    seg.save(tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["crf"] == "library"
    cfg.update(format=1, crf=True)
    del cfg["intensity_range"]
    cfg_path.write_text(json.dumps(cfg))
    loaded = TrainableSegmenter.load(tmp_path / "m")
    assert loaded.crf == "library"
    np.testing.assert_array_equal(loaded.predict(te[:1])[0], seg.predict(te[:1])[0])


def test_modal_filter_is_the_window_majority_with_ties_to_the_smallest():
    from alibi_vit.trainable.segmenter import modal_filter

    mask = np.random.default_rng(7).choice([1, 2, 9], size=(13, 11))
    padded = np.pad(mask, 2, mode="symmetric")  # scipy's "reflect"
    expected = np.empty_like(mask)
    for r in range(mask.shape[0]):
        for c in range(mask.shape[1]):
            vals, counts = np.unique(padded[r:r + 5, c:c + 5], return_counts=True)
            expected[r, c] = vals[np.argmax(counts)]  # argmax takes the first (smallest) of tied values
    np.testing.assert_array_equal(modal_filter(mask, 5), expected)
    with pytest.raises(ValueError, match="odd"):
        modal_filter(mask, 4)


def user_features(image01):
    """A user feature hook for the tests: the image squared and a constant."""
    return np.stack([image01 ** 2, np.full(image01.shape, 0.5, np.float32)], -1)


def test_user_feature_hook_is_appended_and_saved_by_import_path(tmp_path, data):
    tr, trm, labels, te, _ = data
    seg = TrainableSegmenter(**FAST, feature_fn=user_features, modal=3).fit(tr, labels)
    f = seg.features(te[0])
    x = seg.scale(te[0])
    n = len(classical_feature_names((0, 1, 4), DEFAULT_FILTERS))
    np.testing.assert_array_equal(f[..., n:], user_features(x))
    np.testing.assert_allclose(f[..., :n], TrainableSegmenter(**FAST, intensity="dtype").features(x), atol=1e-6)
    assert seg.feature_names[-2:] == ["user_0", "user_1"]
    seg.save(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["feature_fn"].endswith("test_trainable_segmenter:user_features") and cfg["modal"] == 3
    loaded = TrainableSegmenter.load(tmp_path / "m")
    np.testing.assert_array_equal(loaded.predict(te)[0], seg.predict(te)[0])
    from alibi_vit.trainable.segmenter import modal_filter

    np.testing.assert_array_equal(seg.predict(te)[0], modal_filter(seg.classes_[seg.predict_proba(te)[0].argmax(-1)], 3))
    with pytest.raises(ValueError, match="cannot be saved by import path"):
        TrainableSegmenter(feature_fn=lambda im: im[..., None])
    with pytest.raises(ValueError, match="cannot be imported"):
        TrainableSegmenter(feature_fn="no_such_module_xyz:f")
