"""benchmarks/bench_volumes.py: its scores and scribbles (porespy, the generator, is a bench extra:
the run itself is tested only where it is installed)."""

import numpy as np
import pytest

from tests.helpers import benchmark_module

bench = benchmark_module("bench_volumes")


def test_scores_are_mean_iou_and_volume_fraction_errors_in_points():
    truth = np.ones((2, 4, 5), np.uint8)
    truth[:, :, 3:] = 2  # 2·4·3 = 24 voxels of class 1, 2·4·2 = 16 of class 2
    truth[1, 0, 0] = 3   # one voxel of class 3: 23 / 16 / 1 of 40
    pred = truth.copy()
    pred[0, :, 3] = 1    # 4 voxels of class 2 called 1: 27 / 12 / 1
    s = bench.scores(pred, truth)
    # IoU: class 1 23/27, class 2 12/16, class 3 1/1
    assert s["miou"] == pytest.approx(np.mean([23 / 27, 12 / 16, 1.0]), abs=1e-4)
    assert s["fraction_error_pp"] == {"pore": 10.0, "matrix": 10.0, "inclusion": 0.0}  # 4 of 40 voxels moved
    assert s["max_fraction_error_pp"] == 10.0
    # Confusion, rows the true phase: every pore right; 4 of the 16 matrix voxels called pore
    np.testing.assert_allclose(s["confusion"], [[1, 0, 0], [0.25, 0.75, 0], [0, 0, 1]])
    # The signed error split by a band: the 4 moved voxels (x = 3) lie in it
    band = np.zeros(truth.shape, bool)
    band[:, :, 2:4] = True
    s = bench.scores(pred, truth, band)
    assert s["signed_fraction_error_pp_boundary"] == {"pore": 10.0, "matrix": -10.0, "inclusion": 0.0}
    assert s["signed_fraction_error_pp_interior"] == {"pore": 0.0, "matrix": 0.0, "inclusion": 0.0}


def test_boundary_band_is_the_voxels_within_reach_of_another_phase():
    truth = np.ones((1, 1, 8), np.uint8)
    truth[..., 4:] = 2  # the phases meet between x = 3 and x = 4; the volume's edge is no boundary
    np.testing.assert_array_equal(bench.near_boundary(truth, 2)[0, 0], [0, 0, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(bench.near_boundary(truth, 1)[0, 0], [0, 0, 0, 1, 1, 0, 0, 0])


def test_ideal_threshold_keeps_flat_boundaries_and_shrinks_small_grains():
    """The blur is symmetric across a flat boundary, so the nearest-grey rule puts it back where it was; a
    small ball's blurred grey falls below the midpoint at its rim, so the rule loses part of it."""
    flat = np.full((8, 8, 16), 2, np.uint8)
    flat[..., 8:] = 3  # matrix | inclusion; wrap mode makes x = 0 | 15 a second flat boundary
    np.testing.assert_array_equal(bench.ideal_threshold(flat), flat)
    ball = np.full((24, 24, 24), 2, np.uint8)
    z, y, x = np.mgrid[:24, :24, :24] - 12
    ball[z * z + y * y + x * x <= 4 * 4] = 3
    kept = (bench.ideal_threshold(ball) == 3).sum()
    assert 0 < kept < (ball == 3).sum()
    assert (bench.ideal_threshold(ball)[ball == 2] == 2).all()  # nothing outside the ball is called inclusion


def test_scribbles_lie_on_three_xy_slices_and_agree_with_the_truth():
    truth = np.ones((12, 40, 40), np.uint8)
    truth[:, :, 20:] = 2
    truth[:, 10:30, 5:15] = 3
    labels = bench.scribble_volume(truth)
    assert sorted(np.flatnonzero(labels.any(axis=(1, 2)))) == bench.label_slices(12) == [3, 6, 9]
    on = labels > 0
    np.testing.assert_array_equal(labels[on], truth[on])
    for z in (3, 6, 9):
        assert set(np.unique(labels[z])) == {0, 1, 2, 3}  # every phase scribbled on every slice


@pytest.mark.slow
def test_smoke_run():
    pytest.importorskip("porespy")
    assert bench.main(["smoke"]) == 0


def test_stroke_draws_report_gives_each_draw_and_the_range():
    def draw(d, m3, m2, fractions):
        return {"draw": d, "labelled_voxels": 10, "miou_gain_3d_over_2d": round(m3 - m2, 4),
                "3d": {"miou": m3, "fraction_true_pred": fractions,
                       "max_fraction_error_pp": round(max(100 * abs(p - t) for t, p in fractions.values()), 2)},
                "2d": {"miou": m2}}

    run = {"noise": 0.25, "seed": 0, "load_before": [1.0], "load_after": [2.0],
           "draws": [draw(0, 0.8, 0.7, {"pore": (0.35, 0.36), "matrix": (0.55, 0.55), "inclusion": (0.10, 0.09)}),
                     draw(1, 0.7, 0.68, {"pore": (0.35, 0.30), "matrix": (0.55, 0.62), "inclusion": (0.10, 0.08)})]}
    lines = bench._stroke_lines([run])
    assert "| 0.25 | 0 | 1 | 10 | 0.7000 | 0.6800 | +0.0200 | -5.00 / +7.00 / -2.00 |" in lines
    # gains 0.10 and 0.02 (median 0.06); worst errors 1 and 7 pp (median 4)
    assert lines[-1].startswith("- 2 draws: 3D − 2D from +0.0200 to +0.1000 mIoU (median +0.0600); the 3D "
                                "segmenter's worst volume-fraction error from 1.00 to 7.00 pp (median 4.00)")
    assert bench._stroke_lines([]) == []
