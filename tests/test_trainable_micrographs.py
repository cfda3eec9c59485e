"""The shipped labelled micrograph set, its protocols, the per-image benchmark and `segment benchmark --dataset`."""

import csv
import json
import math
from functools import partial
from importlib import resources

import numpy as np
import pytest

from alibi_vit.cli import segment as segment_cli
from alibi_vit.trainable.datasets import DATASETS, load_micrographs, micrograph_manifest
from alibi_vit.trainable.micrograph_benchmark import (SPARSE, micrograph_benchmark, protocol_labels, summarise)
from tests.helpers import benchmark_module, run_subcommand

run = partial(run_subcommand, segment_cli)
FOLDER = resources.files("alibi_vit.trainable").joinpath("micrographs")


def test_every_image_has_its_files_licence_and_consistent_ground_truth():
    entries = micrograph_manifest()
    assert {s for e in entries for s in e["sets"]} == set(DATASETS) - {"all"}
    assert {e["split"] for e in entries} == {"train", "test"}
    for e in entries:
        for licence in e["licence"]:
            assert "MIT License" in FOLDER.joinpath(licence).read_text() or "Permission is hereby granted" in \
                FOLDER.joinpath(licence).read_text()
    assert sum(len(FOLDER.joinpath(e[k]).read_bytes()) for e in entries for k in ("image", "mask")) < 5 * 2**20
    for item in load_micrographs("all"):
        assert item.image.ndim == 2 and item.image.dtype in (np.uint8, np.uint16)
        assert item.mask.shape == item.image.shape
        # Ground truth labels every pixel with a class 1..K, and every class occurs.
        np.testing.assert_array_equal(np.unique(item.mask), np.arange(1, len(item.classes) + 1))
        if item.authors_scribbles is not None:
            lab = item.authors_scribbles
            assert lab.shape == item.mask.shape and (lab == 0).mean() > 0.9  # sparse strokes
    # The 16-bit original of the authors' SEM image carries their scribbles.
    (sem,) = load_micrographs("isb", names=["super_45kx_etched"])
    assert sem.image.dtype == np.uint16 and sem.authors_scribbles is not None


def test_split_and_name_selection_and_errors():
    train = load_micrographs("all", split="train")
    test = load_micrographs("all", split="test")
    assert train and test and not {i.name for i in train} & {i.name for i in test}
    assert len(train) + len(test) == len(load_micrographs("all"))
    assert [i.name for i in load_micrographs("ebc", names=["ebc_010417_4_S2480009"])] == ["ebc_010417_4_S2480009"]
    with pytest.raises(ValueError, match="no image nope in dataset 'super'"):
        load_micrographs("super", names=["nope"])
    with pytest.raises(ValueError, match="unknown dataset"):
        load_micrographs("voc")
    item = load_micrographs("isb", names=["isb_tem"])[0]
    small = item.cropped(100)
    assert small.image.shape == small.mask.shape == small.authors_scribbles.shape == (100, 100)
    np.testing.assert_array_equal(small.mask, item.mask[209:309, 209:309])  # (518 - 100) // 2 = 209


def test_conversion_of_colour_overlays_and_value_masks():
    make = benchmark_module("make_micrograph_set")
    image = np.array([[10, 20], [30, 40]], np.uint8)
    overlay = np.zeros((2, 2, 4), np.uint8)
    overlay[..., 3] = 255
    overlay[0, 0, :3] = 10  # the image's own grey: matrix
    overlay[0, 1, :3] = (0, 0, 255)  # blue
    overlay[1, 0, :3] = (255, 0, 0)  # red
    overlay[1, 1, :3] = 40
    np.testing.assert_array_equal(make.overlay_to_labels(image, overlay, "x"), [[1, 2], [3, 1]])
    overlay[1, 1, :3] = (0, 255, 0)  # a colour the set does not use
    with pytest.raises(ValueError, match="unknown overlay colours"):
        make.overlay_to_labels(image, overlay, "x")
    overlay[1, 1, :3] = 41  # grey, but not the image's value
    with pytest.raises(ValueError, match="not the image's own values"):
        make.overlay_to_labels(image, overlay, "x")
    np.testing.assert_array_equal(make.values_to_labels(np.array([[0, 127, 254]]), [127, 254], "s", 0), [[0, 1, 2]])
    with pytest.raises(ValueError, match="unexpected values"):
        make.values_to_labels(np.array([[0, 5]]), [0], "m")


def test_sparse_protocol_is_seeded_correct_and_sparse():
    item = load_micrographs("super", names=["super_spot3_0d_3"])[0]
    a, b, c = (protocol_labels(item, "sparse", s) for s in (0, 0, 1))
    np.testing.assert_array_equal(a, b)  # seeded
    assert not np.array_equal(a, c)  # another seed, other strokes
    labelled = a > 0
    np.testing.assert_array_equal(a[labelled], item.mask[labelled])  # always the true class
    counts = np.bincount(a[labelled], minlength=4)[1:]
    assert (counts >= SPARSE["min_pixels"]).all()  # the thin phase too
    assert 200 < labelled.sum() < 3000  # a few hundred labelled pixels
    # The strokes of an image do not depend on which other images are chosen or on a crop's pixels elsewhere.
    np.testing.assert_array_equal(protocol_labels(load_micrographs("all")[0], "sparse", 0), a)
    np.testing.assert_array_equal(protocol_labels(item, "dense", 5), item.mask)
    assert protocol_labels(item, "authors", 0) is None  # no authors' scribbles on this image
    with pytest.raises(ValueError, match="unknown protocol"):
        protocol_labels(item, "lasso", 0)


def test_summary_by_hand():
    rows = [{"configuration": "c", "protocol": "sparse", "image": im, "split": sp, "seed": s, "miou": v,
             "pixel_accuracy": 1.0}
            for im, sp, values in (("a", "train", (0.5, 0.7)), ("b", "test", (0.8, 0.8)))
            for s, v in enumerate(values)]
    summary = {r["image"]: r for r in summarise(rows)}
    assert summary["a"]["miou_mean"] == pytest.approx(0.6) and summary["a"]["miou_std"] == pytest.approx(0.1)
    assert summary["a"]["miou_min"] == 0.5 and summary["a"]["miou_max"] == 0.7
    assert summary["overall"]["miou_mean"] == pytest.approx(0.7)  # mean of the image means
    assert summary["overall"]["miou_std"] == pytest.approx(0.05)
    assert summary["overall"]["miou_std_max"] == pytest.approx(0.1)
    assert summary["overall test"]["miou_mean"] == pytest.approx(0.8)


def test_benchmark_grid_shares_labels_and_crf_refines_the_same_fit():
    items = [i.cropped(64) for i in load_micrographs("super", names=["super_spot2_0d_0"])]
    kwargs = dict(features={"compact": {"filters": "compact"}},
                  classifiers={"rf": ("random_forest", {"n_estimators": 10})},
                  crfs={"off": False, "paper": ("paper", {})}, protocols=("sparse",), seeds=(0, 1))
    rows = micrograph_benchmark(items, **kwargs)
    assert len(rows) == 4
    assert {r["configuration"] for r in rows} == {"compact | rf | crf off", "compact | rf | crf paper"}
    for r in rows:
        assert 0 <= r["miou"] <= 1 and 0 <= r["pixel_accuracy"] <= 1 and r["labelled_pixels"] > 0
    # Per seed the CRF variants saw the same labels.
    for s in (0, 1):
        assert len({r["labelled_pixels"] for r in rows if r["seed"] == s}) == 1
    assert json.dumps(micrograph_benchmark(items, **kwargs)) == json.dumps(rows)  # seeded (nan-safe comparison)


@pytest.mark.slow
def test_cli_dataset_subset_writes_finite_scores_and_is_seeded(tmp_path, capsys):
    """The CI subset: classical features on central crops of two images, every protocol."""
    argv = ["benchmark", "--dataset", "isb", "--crop", "96", "--seeds", "0", "1", "--trees", "10"]
    assert run(argv + ["--out", str(tmp_path / "a")]) == 0
    assert run(argv + ["--out", str(tmp_path / "b")]) == 0
    runs = list(csv.DictReader(open(tmp_path / "a" / "runs.csv")))
    assert {r["protocol"] for r in runs} == {"sparse", "dense", "authors"}
    assert {r["seed"] for r in runs if r["protocol"] == "sparse"} == {"0", "1"}
    for r in runs:
        assert math.isfinite(float(r["miou"])) and math.isfinite(float(r["pixel_accuracy"]))
    summary = list(csv.DictReader(open(tmp_path / "a" / "summary.csv")))
    assert all(math.isfinite(float(r["miou_mean"])) and math.isfinite(float(r["miou_std"])) for r in summary)
    # Seeded: a second run gives the very same file.
    assert (tmp_path / "a" / "runs.csv").read_text() == (tmp_path / "b" / "runs.csv").read_text()
    md = (tmp_path / "a" / "summary.md").read_text()
    assert "### Protocol `sparse`" in md and "overall" in md


def test_cli_dataset_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="no image nope"):
        run(["benchmark", "--dataset", "super", "--images", "nope", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="go with --dataset"):
        run(["benchmark", "--synthetic", "--crop", "64", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="takes one"):
        run(["benchmark", "--synthetic", "--classifier", "xgboost", "random_forest", "--out", str(tmp_path)])


def test_manifest_is_json_with_sources():
    data = json.loads(FOLDER.joinpath("manifest.json").read_text())
    assert all(e["source"].startswith("github.com/") for e in data["images"])
    assert "MIT" in FOLDER.joinpath("README.md").read_text()


def test_models_saved_before_the_new_defaults_load_and_segment_the_same(tmp_path):
    """A model folder of the former defaults (XGBoost, the Weka filters, no "filters" key, crf "paper")
    loads with this version and gives the masks it gave when saved."""
    from alibi_vit.trainable import TrainableSegmenter, scribbles, synthetic_micrograph

    image, mask = synthetic_micrograph(64, seed=0)
    old = TrainableSegmenter(classifier="xgboost", filters="weka", crf="paper",
                             classifier_params={"n_estimators": 5}).fit([image], [scribbles(mask, 2, rng=0)])
    expected = old.predict([image])[0]
    old.save(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    del config["filters"]  # what a model folder written before filter sets existed holds
    assert len(config["feature_names"]) == 63
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    loaded = TrainableSegmenter.load(tmp_path / "model")
    assert (loaded.filters, loaded.classifier_kind, loaded.crf) == ("weka", "xgboost", "paper")
    assert loaded.feature_names == config["feature_names"]
    np.testing.assert_array_equal(loaded.predict([image])[0], expected)


@pytest.mark.slow
def test_peer_side_by_side_smoke_writes_both_parts(tmp_path):
    peers = benchmark_module("bench_trainable_peers")
    assert peers.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "trainable_peers-smoke.json").read_text())
    times = report["speed"]["times"]
    assert {k.split("/")[0] for k in times} == {"grey", "colour"}
    assert all(math.isfinite(t["total_s"]) and t["total_s"] > 0 for t in times.values())
    systems = {r["configuration"] for r in report["accuracy"]}
    assert systems == {peers.AlibiVit().name, peers.ScikitImage.name}
    assert all(math.isfinite(r["miou_mean"]) for r in report["accuracy"])
    assert (tmp_path / "trainable_peers-smoke_accuracy" / "runs.csv").is_file()


def test_cli_train_takes_the_filter_set_and_classifier(tmp_path):
    from PIL import Image

    from alibi_vit.trainable import scribbles, synthetic_micrograph

    image, mask = synthetic_micrograph(48, seed=0)
    Image.fromarray((image >> 4).astype(np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(scribbles(mask, 2, rng=0).astype(np.uint8)).save(tmp_path / "a_labels.png")
    for filters, classifier, n in (("weka", "xgboost", 63), ("compact", "random_forest", 29)):
        out = tmp_path / filters
        assert run(["train", "--images", str(tmp_path / "a.png"), "--labels", str(tmp_path / "a_labels.png"),
                    "--filters", filters, "--classifier", classifier, "--trees", "3", "--out", str(out)]) == 0
        config = json.loads((out / "config.json").read_text())
        assert (config["filters"], config["classifier"], len(config["feature_names"])) == (filters, classifier, n)


def test_cli_choices_are_the_library_constants():
    """The segment command names its choices itself (parsing imports no torch): they must be the library's."""
    from alibi_vit.trainable import classical, classifier, crf, datasets, micrograph_benchmark, segmenter

    assert set(segment_cli.CLASSIFIERS) == set(classifier.CLASSIFIERS)
    assert segment_cli.DEFAULT_CLASSIFIER == classifier.DEFAULT_CLASSIFIER
    assert set(segment_cli.FILTER_SETS) == set(classical.FILTER_SETS)
    assert segment_cli.DEFAULT_FILTERS == segmenter.DEFAULT_FILTERS
    assert set(segment_cli.CRF_PRESETS) == set(crf.CRF_PRESETS)
    assert segment_cli.DEFAULT_CRF_PRESET == segmenter.DEFAULT_CRF_PRESET
    assert segment_cli.DATASETS == datasets.DATASETS and segment_cli.PROTOCOLS == micrograph_benchmark.PROTOCOLS


@pytest.mark.slow
def test_cli_dataset_with_a_backbone_adds_its_configuration(tmp_path):
    assert run(["benchmark", "--dataset", "isb", "--images", "isb_tem", "--crop", "64", "--seeds", "0", "--protocol",
                "sparse", "--backbone", "alibi_vit_small_patch14_reg4_dinov2", "--allow-random-init", "--model-arg",
                "depth=1", "--model-arg", "embed_dim=48", "--model-arg", "num_heads=2", "--components", "3",
                "--intensity", "training", "dtype", "--out", str(tmp_path)]) == 0
    runs = list(csv.DictReader(open(tmp_path / "runs.csv")))
    assert {r["features"] for r in runs} == {f"compact/{i}/{b}" for i in ("training", "dtype")
                                             for b in ("classical", "alibi_vit_small_patch14_reg4_dinov2")}
    assert all(math.isfinite(float(r["miou"])) for r in runs)


@pytest.mark.slow
def test_sparse_diagnosis_smoke_crosses_features_and_classifiers(tmp_path):
    """Every feature set meets every classifier on the same strokes; the per-class columns account for
    every labelled pixel and every predicted pixel."""
    diagnosis = benchmark_module("bench_trainable_sparse_diagnosis")
    assert diagnosis.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["features"], r["classifier"]) for r in rows} == {
        (f, c) for f in ("compact", "skimage") for c in ("forest (defaults)", diagnosis.SKLEARN)}
    for r in rows:
        k = sum(1 for key in r if key.startswith("labelled_") and key != "labelled_pixels" and r[key] != "")
        assert sum(int(r[f"labelled_{c}"]) for c in range(1, k + 1)) == int(r["labelled_pixels"])
        assert math.isclose(sum(float(r[f"area_{c}"]) for c in range(1, k + 1)), 1.0, abs_tol=1e-9)
        assert math.isfinite(float(r["miou"]))
    # The same seed gives every system the same strokes.
    assert len({(r["image"], r["labelled_pixels"]) for r in rows}) == len({r["image"] for r in rows})


def test_stroke_stability_pairs_the_draws_and_reports_the_spread_of_its_runs(tmp_path):
    """benchmarks/bench_stroke_stability.py: every configuration gets the same strokes per image and draw,
    scikit-image's pipeline gets its 15 features (5 σ × intensity and two Hessian eigenvalues), and the
    reported spread is the mean over images of the population std of the runs' mIoU across draws."""
    stability = benchmark_module("bench_stroke_stability")
    configs = ["defaults", "thresholds on labelled values", stability.SKIMAGE]
    assert stability.main(["--smoke", "--configs", *configs, "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "stroke_stability-smoke_runs.csv") as f:
        rows = list(csv.DictReader(f))
    report = json.loads((tmp_path / "stroke_stability-smoke.json").read_text())
    assert [r["configuration"] for r in report["summary"]] == configs
    strokes = {}
    for r in rows:
        labelled = tuple(int(r[k]) for k in r if k.startswith("labelled_"))
        assert strokes.setdefault((r["image"], r["draw"]), labelled) == labelled
    assert len(strokes) == 4  # two crops × two draws
    for s in report["summary"]:
        per_image = {}
        for r in rows:
            if r["configuration"] == s["configuration"]:
                per_image.setdefault(r["image"], []).append(float(r["miou"]))
        assert all(len(v) == 2 for v in per_image.values())
        assert s["spread"] == pytest.approx(np.mean([abs(a - b) / 2 for a, b in per_image.values()]))
        assert s["mean_miou"] == pytest.approx(np.mean(list(per_image.values())))
    assert stability.skimage_features(np.zeros((8, 8), np.uint8)).shape == (8, 8, 15)
    # The ablation's patch is undone: the defaults fit with their thresholds midway again.
    from alibi_vit.trainable import classifier

    originals = classifier.midpoint_thresholds, classifier.balanced_weights
    with stability.patched_fit(midway=False, balanced=False):
        assert classifier.balanced_weights(np.array([0, 0, 0, 1])).tolist() == [1, 1, 1, 1]
        assert classifier.midpoint_thresholds is not originals[0]
    assert (classifier.midpoint_thresholds, classifier.balanced_weights) == originals
