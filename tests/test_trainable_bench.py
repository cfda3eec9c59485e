"""benchmarks/bench_trainable_seg.py: its memory measurement holds the bound, and --smoke writes a report."""

import json

import numpy as np
import pytest

from alibi_vit.trainable import TrainableSegmenter, classical_feature_names, scribbles, synthetic_micrograph
from alibi_vit.trainable.segmenter import DEFAULT_FILTERS

from tests.helpers import benchmark_module

bench = benchmark_module("bench_trainable_seg")


@pytest.mark.slow
def test_tiled_prediction_memory_stays_far_below_whole_image_features():
    image, mask = synthetic_micrograph(96, seed=0)
    seg = TrainableSegmenter(classifier_params={"n_estimators": 5, "n_jobs": 1}, tile=280, filters="weka")
    seg.fit([image], [scribbles(mask, 2, rng=0)])
    mem = bench.predict_memory(seg, 1400)
    # 63 features × 1400² px in float32 would take 0.46 GB; 280-px tiles need a small fraction of that.
    assert mem["full_image_features_gb"] > 0.45
    assert 0 < mem["above_baseline_gb"] < 0.5 * mem["full_image_features_gb"], mem
    assert mem["above_baseline_gb"] < bench.TARGETS["memory_gb"]


@pytest.mark.slow
def test_smoke_run_writes_report(tmp_path):
    assert bench.main(["--smoke", "--no-vit", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "trainable_seg_cpu-smoke.json").read_text())
    res = report["results"]
    assert report["smoke"] is True and report["command"].startswith("python benchmarks/bench_trainable_seg.py")
    n_features = len(classical_feature_names(filters=DEFAULT_FILTERS))
    assert res["features_count"] == n_features and res["skimage_mbf_count"] > 0
    assert res["fit_s"] > 0 and res["predict_s_per_mp"] > 0 and res["memory"]["above_baseline_gb"] >= 0
    assert np.isfinite(res["train_pixel_accuracy"]) and res["train_pixel_accuracy"] > 0.8
    assert f"{n_features} per pixel" in (tmp_path / "trainable_seg_cpu-smoke.md").read_text()
