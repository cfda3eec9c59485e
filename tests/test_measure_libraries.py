"""``alibi_vit.measure`` beside the libraries called directly on the same mask: porespy's chords and local
thickness, TauFactor's solver, and S2 beside a plain count of pairs (the definition, written out). The
porespy and TauFactor checks skip, saying so, where ``pip install "alibi-vit[measure]"`` was not run."""

from __future__ import annotations

import numpy as np
import pytest
from test_measure_chunks import smooth_phases

from alibi_vit.measure.analysis import MeasureOptions, measure_mask
from alibi_vit.measure.masks import array_source
from alibi_vit.measure.sizes import chord_lengths

NO_EXTRA = "not installed: pip install 'alibi-vit[measure]'"


def test_s2_equals_the_pair_count_written_out():
    mask = smooth_phases((30, 34, 28), seed=7)
    result = measure_mask(array_source(mask), MeasureOptions(progress=False, metrics=("s2",), radius=9, block=8))
    for row in result["s2"]:
        if row["axis"] == "mean":
            continue
        axis, r = "zyx".index(row["axis"]), row["r"]
        first = np.take(mask, np.arange(mask.shape[axis] - r), axis=axis) == row["phase"]
        second = np.take(mask, np.arange(r, mask.shape[axis]), axis=axis) == row["phase"]
        assert row["s2"] == pytest.approx((first & second).mean(), abs=1e-12)


@pytest.mark.parametrize("axis", [0, 1])
def test_chords_equal_porespy_apply_chords(axis):
    porespy = pytest.importorskip("porespy", reason=f"porespy {NO_EXTRA}")
    from scipy import ndimage

    image = smooth_phases((90, 110), seed=8, phases=2) == 1
    chords = porespy.filters.apply_chords(image, spacing=1, axis=axis, trim_edges=True)
    line = np.zeros((3, 3), bool)
    line[:, 1] = True
    line = line if axis == 0 else line.T
    labels, _ = ndimage.label(chords > 0, structure=line)
    theirs = np.sort(np.bincount(labels.ravel())[1:])
    # porespy draws every second line and, trimming, also drops the chords on the first and last lines drawn
    other = 1 - axis
    kept = np.arange(0, image.shape[other], 2)[1:-1]
    sampled = np.take(image, kept, axis=other).astype(np.uint8)[None]
    ours = np.sort(chord_lengths(sampled, 1, axis + 1))
    np.testing.assert_array_equal(ours, theirs)


def test_local_thickness_equals_porespy():
    porespy = pytest.importorskip("porespy", reason=f"porespy {NO_EXTRA}")
    mask = smooth_phases((80, 90), seed=9, phases=2)
    result = measure_mask(array_source(mask), MeasureOptions(progress=False, metrics=("thickness",)))
    direct = porespy.filters.local_thickness(mask == 1)
    assert result["thickness"][1]["mean"] == pytest.approx(2 * direct[mask == 1].mean())


def test_tortuosity_equals_taufactor():
    taufactor = pytest.importorskip("taufactor", reason=f"TauFactor {NO_EXTRA}")
    mask = smooth_phases((20, 20, 20), seed=10, phases=2)
    result = measure_mask(array_source(mask), MeasureOptions(progress=False, metrics=("tortuosity",), device="cpu"))
    rows = {(r["phase"], r["axis"]): r for r in result["tortuosity"]}
    solver = taufactor.Solver(np.transpose(mask == 1, (2, 0, 1)).astype(np.uint8), device="cpu")
    direct = float(np.ravel(solver.solve(verbose=False, iter_limit=20000, conv_crit=1e-2))[0])
    assert rows[(1, "x")]["tau"] == pytest.approx(direct, rel=1e-6)
    assert 1 < rows[(1, "x")]["tau"] < 10
