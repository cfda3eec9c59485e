"""Scribbles, synthetic micrographs and the scribble benchmark of alibi_vit.trainable."""

import numpy as np
import pytest
from scipy import ndimage as ndi

from alibi_vit.trainable import mean_iou, scribble_benchmark, scribbles, synthetic_dataset, synthetic_micrograph
from alibi_vit.trainable.benchmark import remap_masks, write_outputs


@pytest.mark.parametrize("seed", range(5))
def test_scribbles_are_always_correct_and_inside_regions(seed):
    _, mask = synthetic_micrograph(128, phases=3, seed=seed)
    lab = scribbles(mask, per_class=2, rng=seed, width=3)
    labelled = lab > 0
    assert set(np.unique(lab[labelled])) == {1, 2, 3}  # every class gets strokes
    np.testing.assert_array_equal(lab[labelled], mask[labelled])  # always the true class
    # Away from the border: every scribbled pixel lies more than `margin` (width + 2) px from another class,
    # unless its class has no such pixel at all.
    for c in (1, 2, 3):
        dist = ndi.distance_transform_edt(mask == c)
        if dist.max() > 5:
            assert dist[lab == c].min() > 5
    # Strokes are lines, not dots: each class has a few dozen pixels at least.
    assert min((lab == c).sum() for c in (1, 2, 3)) >= 20


def test_scribbles_reproducible_and_thin_regions_still_get_one():
    mask = np.ones((40, 40), int)
    mask[:, 20:22] = 2  # a 2-px wide class: no pixel is 5 px inside, the innermost pixels are used
    a, b = scribbles(mask, 1, rng=3), scribbles(mask, 1, rng=3)
    np.testing.assert_array_equal(a, b)
    assert (a == 2).any() and np.all(mask[a > 0] == a[a > 0])
    assert not (scribbles(np.zeros((10, 10), int), 1, rng=0) > 0).any()  # 0 = no class: never scribbled


def test_small_round_grains_get_strokes_not_dots():
    # Discs of radius 6: only a pixel or a few at each centre lie more than the margin (5 px) inside,
    # too little for a 3 px brush; strokes then keep to the pixels at least half the largest depth inside.
    yy, xx = np.mgrid[:96, :96]
    mask = np.ones((96, 96), int)
    for cy, cx in [(16, 16), (16, 60), (50, 30), (75, 75), (80, 20)]:
        mask[(yy - cy) ** 2 + (xx - cx) ** 2 <= 36] = 2
    depth = ndi.distance_transform_edt(mask == 2)
    assert 0 < (depth > 5).sum() < 9 * 5  # the deep cores: under a brush's area per grain
    for seed in range(3):
        lab = scribbles(mask, 2, rng=seed)
        np.testing.assert_array_equal(lab[lab > 0], mask[lab > 0])
        assert (lab == 2).sum() >= 20  # two strokes over a grain's inner core (a dot labels 1-5 px)
        assert depth[lab == 2].min() >= depth.max() / 2
        matrix_depth = ndi.distance_transform_edt(mask == 1)
        assert matrix_depth[lab == 1].min() > 5  # the roomy class keeps the full margin


def test_synthetic_micrograph_is_16bit_with_exact_ground_truth():
    image, mask = synthetic_micrograph((64, 80), phases=4, seed=1)
    assert image.dtype == np.uint16 and image.shape == mask.shape == (64, 80)
    assert image.max() <= 4095  # 12 bits used of 16
    np.testing.assert_array_equal(np.unique(mask), [1, 2, 3, 4])
    # Equal area fractions by construction (quantile thresholds).
    np.testing.assert_allclose(np.bincount(mask.ravel())[1:] / mask.size, 0.25, atol=1e-3)
    # Phases differ in mean grey level: the ground truth describes the image.
    means = [image[mask == c].mean() for c in (1, 2, 3, 4)]
    assert np.ptp(means) > 500
    image2, mask2 = synthetic_micrograph((64, 80), phases=4, seed=1)
    np.testing.assert_array_equal(image, image2)


def test_mean_iou_by_hand_and_mask_remapping():
    truth = np.array([[1, 1, 2, 2]])
    pred = np.array([[1, 2, 2, 2]])
    assert mean_iou(pred, truth) == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert mean_iou(truth, truth) == 1.0
    masks, values = remap_masks([np.array([[0, 128]]), np.array([[255, 0]])])
    np.testing.assert_array_equal(values, [0, 128, 255])
    np.testing.assert_array_equal(masks[0], [[1, 2]])
    np.testing.assert_array_equal(masks[1], [[3, 1]])


def test_benchmark_end_to_end_on_synthetic_data(tmp_path):
    (tr, trm), (te, tem) = synthetic_dataset(2, 2, size=80, seed=0)
    kwargs = dict(rounds=3, seed=0, segmenter_kwargs=dict(classifier_params={"n_estimators": 15, "n_jobs": 1},
                                                          sigmas=(0, 1, 2, 4)))
    rows, preds, masks = scribble_benchmark(tr, trm, te, tem, **kwargs)
    assert [r["round"] for r in rows] == [1, 2, 3]
    pixels = [r["scribbled_pixels"] for r in rows]
    assert pixels[0] < pixels[1] < pixels[2]  # scribbles accumulate
    assert all(0 <= r["miou"] <= 1 for r in rows) and rows[-1]["miou"] > 0.5
    assert np.mean(preds["classical"][0] == masks[0]) > 0.6
    rows2, _, _ = scribble_benchmark(tr, trm, te, tem, **kwargs)
    assert rows2 == rows  # seeded and reproducible
    paths = write_outputs(tmp_path, rows, preds, te, masks)
    assert [p.name for p in paths] == ["benchmark.csv", "miou_vs_round.png", "examples.png"]
    assert (tmp_path / "benchmark.csv").read_text().splitlines()[0] == "method,round,scribbled_pixels,miou,pixel_accuracy"
    with pytest.raises(ValueError, match="exactly one ground-truth mask"):
        scribble_benchmark(tr, trm[:1], te, tem)


def test_benchmark_plots_have_whole_rounds_and_wrapped_titles():
    from alibi_vit.trainable.benchmark import TITLE_WIDTH, plot_examples, plot_miou_vs_round

    rows = [{"method": m, "round": r, "miou": 0.5 + 0.1 * r} for m in ("classical", "classical + vit") for r in (1, 2, 3)]
    ax = plot_miou_vs_round(rows).axes[0]
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)  # no 1.5, 2.5 rounds

    image, mask = synthetic_micrograph(32, seed=0)
    long_name = "classical + alibi_vit_small_patch14_reg4_dinov2.dinosaw_coco"
    fig = plot_examples({long_name: [mask]}, [image], [mask], n_examples=1)
    title = fig.axes[-1].get_title()
    assert "".join(title.splitlines()[:-1]).replace(" ", "") == long_name.replace(" ", "")  # all of it, wrapped
    assert all(len(line) <= TITLE_WIDTH for line in title.splitlines()), title
    assert title.splitlines()[-1] == "mIoU 1.00"


def test_composition_shift_test_images_lack_the_brightest_phase():
    from alibi_vit.trainable.benchmark import composition_shift_data

    (tr, trm), (te, tem) = composition_shift_data(2, 2, size=64, seed=0)
    # The brightest phase, found from the training images themselves: highest mean grey level.
    means = [np.mean(np.concatenate([im[m == p] for im, m in zip(tr, trm)])) for p in (1, 2, 3)]
    bright = int(np.argmax(means)) + 1
    for m in trm:
        np.testing.assert_allclose(np.bincount(m.ravel(), minlength=4)[1:] / m.size, 1 / 3, atol=0.01)
    for m in tem:
        counts = np.bincount(m.ravel(), minlength=4)[1:] / m.size
        assert counts[bright - 1] == 0
        np.testing.assert_allclose(np.delete(counts, bright - 1), 0.5, atol=0.01)


def test_fitted_intensity_holds_under_composition_shift_where_per_image_stretch_fails():
    from alibi_vit.trainable.benchmark import compare_intensity, composition_shift_data

    (tr, trm), (te, tem) = composition_shift_data(2, 2, size=96, seed=0)
    # The classifier and filters this case was written with (the former defaults): it is about intensity modes.
    rows, preds, masks = compare_intensity(
        tr, trm, te, tem, modes=("training", "percentile", "dtype"), rounds=1, per_class=2, seed=0,
        classifier="xgboost", segmenter_kwargs=dict(classifier_params={"n_estimators": 15, "n_jobs": 1},
                                                    sigmas=(0, 1, 2, 4), filters="weka"))
    by = {r["method"]: r for r in rows}
    assert set(by) == {f"classical [intensity={m}]" for m in ("training", "percentile", "dtype")}
    for r in rows:  # pixel accuracy recomputed from the predictions
        p = preds[r["method"]]
        assert r["pixel_accuracy"] == pytest.approx(np.mean([np.mean(a == b) for a, b in zip(p, masks)]))
    training, dtype = by["classical [intensity=training]"], by["classical [intensity=dtype]"]
    assert training["miou"] >= dtype["miou"] - 0.01
    assert by["classical [intensity=percentile]"]["miou"] < training["miou"] - 0.05
