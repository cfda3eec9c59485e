"""The fresh-process first-segmentation benchmark (benchmarks/bench_first_segmentation.py) in its smoke mode."""

import json
import statistics

import numpy as np
import pytest

from tests.helpers import benchmark_module

pytest.importorskip("skimage")
pytest.importorskip("sklearn")
bench = benchmark_module("bench_first_segmentation")


@pytest.mark.slow
def test_smoke_run_has_every_tool_and_image_on_the_same_strokes(tmp_path):
    bench.main(["--smoke", "--images", "texture", "--out-dir", str(tmp_path),
                "--stem", "fs"])
    payload = json.loads((tmp_path / "fs.json").read_text())
    rows = payload["rows"]
    assert {(r["image"], r["tool"]) for r in rows} == {(i, t) for i in ("texture",) for t in bench.TOOLS}
    assert (tmp_path / "fs.md").read_text().count("| texture (uint8) |") == len(bench.TOOLS)
    for r in rows:
        assert len(r["runs"]) == payload["repeats"] == 1  # --smoke: one run whatever --repeats says
        for key in ("wall_s", "cpu_s", "peak_rss_mb", "miou"):
            values = [run[key] for run in r["runs"]]
            assert r["median"][key] == statistics.median(values)
        for run in r["runs"]:
            assert run["cpu_s"] >= 0 and run["wall_s"] > 0 and run["peak_rss_mb"] > 50  # a Python with numpy
            assert 0 <= run["miou"] <= 1
            assert run["strokes_given"] == r["strokes_file"]
    # one stroke file, the same for every tool
    assert len({run["strokes_given"] for r in rows for run in r["runs"]}) == 1
    # CLI: two processes, summed
    for r in rows:
        if r["tool"] == "cli":
            run = r["runs"][0]
            assert run["wall_s"] == pytest.approx(run["train_wall_s"] + run["apply_wall_s"])


@pytest.mark.slow
def test_accuracy_mode_pairs_the_two_pipelines_on_each_stroke_draw(tmp_path):
    from alibi_vit.trainable.scribbles import scribbles

    bench.main(["--smoke", "--images", "uint16", "--accuracy-seeds", "2", "--out-dir", str(tmp_path), "--stem", "fs"])
    rows = json.loads((tmp_path / "fs_accuracy.json").read_text())["rows"]
    assert [(r["image"], r["seed"]) for r in rows] == [("uint16", 0), ("uint16", 1)]
    assert all(0 <= r["ours"] <= 1 and 0 <= r["skimage"] <= 1 for r in rows)
    _, truth = bench.make_image("uint16", 128, 0)
    assert not np.array_equal(scribbles(truth, 5, rng=0), scribbles(truth, 5, rng=1))  # two different draws
    wins = sum(r["ours"] >= r["skimage"] for r in rows)
    assert f"| {wins} of 2 |" in (tmp_path / "fs_accuracy.md").read_text()


def test_median_is_the_middle_run():
    runs = [{"repeat": i, "wall_s": w, "cpu_s": c} for i, (w, c) in enumerate([(3.0, 1.0), (1.0, 5.0), (2.0, 3.0)])]
    assert bench.median_row(runs) == {"wall_s": 2.0, "cpu_s": 3.0}


def test_texture_image_phases_share_one_mean_grey_level():
    image, truth = bench.make_image("texture", 128, 0)
    assert image.dtype == np.uint8 and image.shape == truth.shape == (128, 128)
    means = [image[truth == c].mean() for c in np.unique(truth)]
    assert len(means) == 3 and max(means) - min(means) < 3  # grey levels 0..255: texture alone tells them apart
    grey16, _ = bench.make_image("uint16", 128, 0)
    assert grey16.dtype == np.uint16
