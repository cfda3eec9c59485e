"""``alibi_vit.measure`` against answers known in closed form, not only against the libraries it wraps.

- A Boolean model on the voxel lattice (balls of a fixed digital shape D centred on lattice sites drawn
  independently with probability p): a voxel is void when no centre lies in D around it, so the porosity is
  exactly q^|D| (q = 1 - p), the void's S2 at a shift s is q^|D ∪ (D + s)|, and the probability that a
  neighbour pair differs is 2 (q^|D| - q^|D ∪ (D + e)|). The lattice makes these exact, not approximations
  of a continuum.
- A large disk and a ball: the isotropic (Crofton) interface estimate against 2πR and 4πR², the face count
  against its known 4/π and 3/2 overstatement.
- A checkerboard: interface length exact, spacing applied per axis.
- Disks of known radii: local thickness (porespy) peaks at them; chords through a disk average πR/2.
- Straight channels: tortuosity factor 1 (TauFactor); a blocked phase: infinite.
"""

from __future__ import annotations

import numpy as np
import pytest

from alibi_vit.measure.analysis import MeasureOptions, measure_mask
from alibi_vit.measure.masks import array_source


def _ball(radius: int, ndim: int) -> np.ndarray:
    grid = np.indices((2 * radius + 1,) * ndim) - radius
    return (grid ** 2).sum(axis=0) <= radius ** 2


def boolean_model(shape, radius: int, porosity: float, seed: int):
    """(mask: 1 solid, 0 void; q) of the lattice Boolean model with the given expected porosity."""
    from scipy import ndimage

    ball = _ball(radius, len(shape))
    q = porosity ** (1 / ball.sum())
    rng = np.random.default_rng(seed)
    centres = rng.random(tuple(n + 2 * radius for n in shape)) > q
    solid = ndimage.binary_dilation(centres, ball)
    crop = tuple(slice(radius, radius + n) for n in shape)
    return solid[crop].astype(np.uint8), q, ball


def _union_size(ball: np.ndarray, shift: int, axis: int) -> int:
    padded = np.pad(ball, [(0, shift if a == axis else 0) for a in range(ball.ndim)])
    return int((padded | np.roll(padded, shift, axis=axis)).sum())


def _measure(array, spacing=None, **options):
    options.setdefault("progress", False)
    return measure_mask(array_source(array, spacing), MeasureOptions(**options))


@pytest.mark.parametrize("shape, radius", [((640, 640), 5), ((96, 96, 96), 3)])
def test_boolean_model_porosity_s2_and_interfaces_match_closed_forms(shape, radius):
    mask, q, ball = boolean_model(shape, radius, porosity=0.5, seed=1)
    result = _measure(mask, metrics=("fractions", "surfaces", "s2"), radius=12)
    porosity = q ** ball.sum()
    void = result["fractions"]["phases"][0]
    assert void["fraction"] == pytest.approx(porosity, rel=0.02)
    assert void["tile_ci95_low"] < porosity < void["tile_ci95_high"]
    axes = "zyx"[3 - len(shape):]
    for row in result["s2"]:
        if row["phase"] == 0 and row["axis"] in axes and row["r"] in (1, 3, 6, 12):
            axis = axes.index(row["axis"])
            expected = q ** _union_size(ball, row["r"], axis)
            assert row["s2"] == pytest.approx(expected, rel=0.03), row
    (pair,) = result["interfaces"]
    voxels = mask.size
    for axis, name in enumerate(axes):
        differ = 2 * (q ** ball.sum() - q ** _union_size(ball, 1, axis))
        pairs = voxels * (1 - 1 / shape[axis])
        assert pair[f"faces_{name}"] / pairs == pytest.approx(differ, rel=0.03)


def test_s2_starts_at_the_fraction_and_tends_to_its_square():
    mask, _, _ = boolean_model((512, 512), 3, porosity=0.4, seed=2)
    result = _measure(mask, metrics=("fractions", "s2"), radius=40)
    for phase in (0, 1):
        curve = [r["s2"] for r in result["s2"] if r["phase"] == phase and r["axis"] == "mean"]
        fraction = result["fractions"]["phases"][phase]["fraction"]
        assert curve[0] == pytest.approx(fraction)
        assert curve[-1] == pytest.approx(fraction ** 2, abs=0.01)


def test_isotropic_interface_of_a_disk_and_a_ball_is_their_perimeter_and_area():
    disk = np.zeros((240, 260), np.uint8)
    disk[20:221, 30:231] = _ball(100, 2)
    (row,) = _measure(disk, metrics=("surfaces",))["interfaces"]
    assert row["isotropic_area"] == pytest.approx(2 * np.pi * 100, rel=0.02)
    assert row["faces_area"] == pytest.approx(4 / np.pi * 2 * np.pi * 100, rel=0.02)  # the staircase's 4/π
    ball = np.zeros((50, 50, 50), np.uint8)
    ball[4:45, 4:45, 4:45] = _ball(20, 3)
    (row,) = _measure(ball, metrics=("surfaces",), block=16)["interfaces"]
    assert row["isotropic_area"] == pytest.approx(4 * np.pi * 400, rel=0.02)
    assert row["faces_area"] == pytest.approx(1.5 * 4 * np.pi * 400, rel=0.03)


def test_checkerboard_interface_length_is_exact_with_spacing():
    squares, side = 6, 10
    board = (np.add.outer(np.arange(squares * side) // side, np.arange(squares * side) // side) % 2).astype(np.uint8)
    sy, sx = 2.0, 0.5
    (row,) = _measure(board, spacing=(sy, sx), metrics=("surfaces",), block=16)["interfaces"]
    length = squares * side
    # (squares - 1) boundaries across x, each the image's height long, and as many across y
    expected = (squares - 1) * length * sy + (squares - 1) * length * sx
    assert row["faces_area"] == pytest.approx(expected, rel=1e-12)
    assert row["faces_x"] == row["faces_y"] == (squares - 1) * length
    cube = (np.indices((12, 12, 12)) // 4).sum(axis=0) % 2
    (row,) = _measure(cube.astype(np.uint8), spacing=(3.0, 1.0, 1.0), metrics=("surfaces",), block=8)["interfaces"]
    # 2 internal planes per axis of 144 faces; a face across z is 1×1, across y or x 3×1
    assert row["faces_area"] == pytest.approx(2 * 144 * 1 + 2 * 2 * 144 * 3)


def test_local_thickness_peaks_at_the_disks_radii():
    pytest.importorskip("porespy", reason="local thickness uses porespy: pip install 'alibi-vit[measure]'")
    from alibi_vit.measure.sizes import local_thickness

    mask = np.zeros((1, 120, 200), np.uint8)
    yy, xx = np.mgrid[:120, :200]
    for (cy, cx), radius in (((60, 50), 10), ((60, 140), 25)):
        mask[0][(yy - cy) ** 2 + (xx - cx) ** 2 <= radius ** 2] = 1
    radii = local_thickness(mask, 1, (1, 1, 1))
    for (cy, cx), radius in (((60, 50), 10), ((60, 140), 25)):
        inside = mask[0].astype(bool) & ((yy - cy) ** 2 + (xx - cx) ** 2 <= radius ** 2)
        values = radii[inside[mask[0].astype(bool)]]
        assert np.median(values) == radius
        assert np.mean(values == radius) > 0.95  # a few staircase pixels at the rim get a smaller ball
    result = _measure(mask[0], spacing=(0.5,), metrics=("thickness",))
    assert result["thickness"][1]["peak"] == pytest.approx(2 * 25 * 0.5, rel=0.02)  # diameter, volume-weighted


def test_chords_through_a_disk_average_pi_r_over_2():
    from alibi_vit.measure.sizes import chord_lengths

    mask = np.zeros((1, 100, 100), np.uint8)
    mask[0, 10:91, 10:91] = _ball(40, 2)
    for axis in (1, 2):
        lengths = chord_lengths(mask, 1, axis)
        assert len(lengths) == 81
        assert lengths.mean() == pytest.approx(np.pi * 40 / 2, rel=0.02)
    # runs cut by the border are left out: the void around the disk touches both ends of every line
    assert len(chord_lengths(mask, 0, 2)) == 0


@pytest.mark.parametrize("shape", [(16, 16, 16), (24, 24)])
def test_straight_channels_have_tortuosity_one(shape):
    pytest.importorskip("taufactor", reason="the tortuosity factor uses TauFactor: pip install 'alibi-vit[measure]'")
    from alibi_vit.measure.transport import tortuosity

    mask = np.zeros((1,) + shape if len(shape) == 2 else shape, np.uint8)
    mask[..., 4:8, :] = 1  # channels along x (and z in 3D), blocked along y
    axes = (0, 2) if len(shape) == 3 else (2,)
    for axis in axes:
        assert tortuosity(mask, 1, axis, (1, 1, 1), device="cpu")["tau"] == pytest.approx(1, abs=1e-3)
    assert tortuosity(mask, 1, 1, (1, 1, 1), device="cpu")["tau"] == float("inf")


def test_percolation_of_channels_and_islands():
    mask = np.zeros((40, 60), np.uint8)
    mask[10:14, :] = 1  # spans x
    mask[20:25, 5:10] = 1  # an island
    rows = {(r["phase"], r["axis"]): r for r in _measure(mask, metrics=("percolation",), block=16)["percolation"]}
    assert rows[(1, "x")]["percolates"] and not rows[(1, "y")]["percolates"]
    assert rows[(1, "x")]["percolating_fraction"] == pytest.approx(4 * 60 / (4 * 60 + 25))
    assert rows[(0, "y")]["percolates"] is False and rows[(0, "x")]["percolates"]


def test_a_phase_filling_the_region_has_no_thickness_and_tortuosity_one():
    pytest.importorskip("porespy", reason="local thickness uses porespy: pip install 'alibi-vit[measure]'")
    pytest.importorskip("taufactor", reason="the tortuosity factor uses TauFactor: pip install 'alibi-vit[measure]'")
    result = _measure(np.full((10, 12, 14), 2, np.uint8), metrics=("thickness", "tortuosity"), device="cpu")
    assert result["thickness"][2]["share"] == []  # no interface: no ball size to tell
    assert [row["tau"] for row in result["tortuosity"]] == pytest.approx([1, 1, 1], abs=1e-3)
