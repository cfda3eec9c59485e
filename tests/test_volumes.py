"""Volumes: 3D features find what slices miss, blocks equal the whole volume, training reads the
labelled planes only, volumes come in as TIFF stacks, zarr and slice folders with their spacing.

References are computed without the engine: the 3D filter bank on the whole scaled volume
(itself checked against scipy.ndimage in test_volume_features.py) and the classifier on every voxel."""

from __future__ import annotations

import numpy as np
import pytest
import tifffile

from alibi_vit.chunked import open_image, open_volume
from alibi_vit.images import ImageReadError
from alibi_vit.trainable import TrainableSegmenter, VolumeSegmenter, mean_iou
from alibi_vit.trainable import classical3d
from alibi_vit.trainable.classical3d import volume_features
from alibi_vit.trainable.sources import ArraySource
from alibi_vit.trainable.stream import segment_to_files
from alibi_vit.trainable.writers import ZarrOutput

FAST = dict(classifier_params={"n_estimators": 10, "n_jobs": 2})


def z_only_phase(shape=(40, 40, 40), seed=0):
    """Two phases with the same grey-value statistics in every XY slice: white noise in the left half,
    and in the right half one noise image repeated along z. Only the third axis tells them apart.
    Returns (uint16 volume, truth 1|2, labels on the middle XY slice)."""
    rng = np.random.default_rng(seed)
    z, y, x = shape
    truth = np.ones(shape, np.uint8)
    truth[:, :, x // 2:] = 2
    columns = np.broadcast_to(rng.standard_normal((y, x)), shape)
    volume = np.where(truth == 1, rng.standard_normal(shape), columns)
    labels = np.zeros(shape, np.uint8)
    labels[z // 2, 4:y - 4, 2:x // 2 - 4] = 1
    labels[z // 2, 4:y - 4, x // 2 + 4:x - 2] = 2
    return ((volume + 5) * 4000).astype(np.uint16), truth, labels


def test_a_phase_that_differs_only_along_z_is_found_by_3d_features_and_missed_by_2d():
    volume, truth, labels = z_only_phase()
    seg3 = VolumeSegmenter(**FAST, tile=28).fit(volume, labels)
    found = seg3.predict([volume])[0]
    seg2 = TrainableSegmenter(**FAST).fit([volume[20]], [labels[20]])  # slice by slice, the same scribbles
    missed = np.stack(seg2.predict(list(volume)))
    assert mean_iou(found, truth) > 0.85
    assert mean_iou(missed, truth) < 0.6  # a coin toss per voxel gives ~0.33


@pytest.fixture(scope="module")
def trained():
    rng = np.random.default_rng(1)
    volume = (rng.random((30, 44, 38)) * 3000 + 1000).astype(np.uint16)
    volume[:, 10:30, 8:30] += 2500  # a bright box
    labels = np.zeros(volume.shape, np.uint8)
    labels[12, 15:25, 12:25] = 2
    labels[12, 2:8, 2:30] = 1
    seg = VolumeSegmenter(**FAST, tile=14, spacing=(2.0, 1.0, 1.0), sigmas=(1.0, 2.0)).fit(volume, labels)
    x = seg.scale(volume)
    feats = np.stack(volume_features(x, seg.sigmas, (2.0, 1.0, 1.0)), axis=-1)  # the whole volume at once
    proba = seg.model_.predict_proba(feats.reshape(-1, feats.shape[-1])).reshape(volume.shape + (-1,))
    return volume, labels, seg, feats, proba.astype(np.float32)


def test_blocks_equal_the_whole_volume_and_stream_into_stacks_and_ome_zarr(trained, tmp_path):
    volume, _, seg, feats, proba = trained
    assert len(seg.tile_grid(seg.source(volume))) == 3 * 4 * 3  # 14-voxel blocks
    np.testing.assert_allclose(seg.features(volume), feats, rtol=0, atol=1e-6 * np.abs(feats).max())
    tifffile.imwrite(tmp_path / "v.tif", volume, imagej=True, metadata={"spacing": 2.0, "axes": "ZYX"})
    out = segment_to_files(seg, open_volume(tmp_path / "v.tif"), tmp_path / "o", "v", "tif", proba=True,
                           progress=False)
    mask = tifffile.imread(tmp_path / "o" / "v_mask.tif")
    agree = mask == seg.classes_[proba.argmax(-1)]
    assert agree.mean() > 0.999  # a voxel on a split threshold may round the other way
    np.testing.assert_allclose(tifffile.imread(tmp_path / "o" / "v_proba_1.tif"), proba[..., 0], atol=0.11)
    assert out.size == volume.size and out.counts.sum() == volume.size
    assert [p.name for p in out.paths] == ["v_mask.tif", "v_proba_1.tif", "v_proba_2.tif"]
    segment_to_files(seg, volume, tmp_path / "z", "v", "ome-zarr", progress=False)
    stored = open_image(tmp_path / "z" / "v_mask.ome.zarr")
    assert stored.axes == "zyx" and stored.spacing == (2.0, 1.0, 1.0)  # the segmenter's spacing as the scale
    np.testing.assert_array_equal(stored.read_box(slice(None), slice(None), slice(None)), mask)
    assert [lv.shape for lv in stored.levels] == [(30, 44, 38), (30, 22, 19), (30, 11, 10)]  # y, x halve; z stays


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_one_slice_in_any_orientation_equals_that_slice_of_the_whole(trained, axis):
    volume, _, seg, feats, proba = trained
    index = 7
    got = seg.plane_proba(volume, axis, index)
    want = np.take(proba, index, axis=axis)
    assert got.shape == want.shape
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.99


def test_training_on_labels_in_xz_featurises_the_labelled_planes_only(monkeypatch):
    volume, truth, _ = z_only_phase((24, 30, 30), seed=2)
    labels = np.zeros_like(truth)
    labels[3:21, 11, 2:10] = 1  # strokes in the XZ slice y = 11
    labels[3:21, 11, 19:28] = 2
    calls = []
    real = classical3d.volume_features

    def recording(block, *args, **kwargs):
        calls.append((block.shape, kwargs.get("axis"), kwargs.get("planes")))
        return real(block, *args, **kwargs)

    monkeypatch.setattr("alibi_vit.trainable.volumes.volume_features", recording)
    seg = VolumeSegmenter(**FAST).fit(volume, labels)
    assert calls and all(axis == 1 and len(planes) == 1 for _, axis, planes in calls)  # y = 11 only
    monkeypatch.undo()
    assert mean_iou(seg.predict([volume])[0], truth) > 0.75
    assert seg.label_counts_ == {1: int((labels == 1).sum()), 2: int((labels == 2).sum())}


def test_strokes_in_a_plane_are_featurised_in_boxes_with_the_whole_blocks_values(monkeypatch):
    """Sparse strokes in one plane of a block: boxes around them, one plane thick with the filters' reach, give
    the labelled voxels the features the whole block gives them, from far fewer voxels."""
    volume, truth, _ = z_only_phase((20, 200, 200), seed=4)
    labels = np.zeros_like(truth)
    labels[9, 5:8, 4:20] = truth[9, 5:8, 4:20]  # two strokes far apart in the slice z = 9
    labels[9, 180:184, 160:185] = truth[9, 180:184, 160:185]
    seg = VolumeSegmenter(**FAST, tile=200).fit(volume, labels)
    src = seg.source(volume)
    (tile,) = list(seg.tile_grid(src))
    sel = labels[tile.core] > 0
    read = []
    real = classical3d.volume_features
    monkeypatch.setattr("alibi_vit.trainable.volumes.volume_features",
                        lambda block, *a, **k: read.append(block.size) or real(block, *a, **k))
    rows = seg._labelled_rows(src, tile, sel)
    assert len(read) == 2 and sum(read) < 0.5 * np.prod([o.stop - o.start for o in tile.outer])  # two boxes
    monkeypatch.undo()
    np.testing.assert_allclose(rows, seg._tile_features(src, tile)[sel], rtol=0, atol=1e-6)


def test_a_volume_model_saves_and_loads_with_its_spacing(trained, tmp_path):
    volume, labels, seg, _, _ = trained
    loaded = TrainableSegmenter.load(seg.save(tmp_path / "m"))
    assert isinstance(loaded, VolumeSegmenter) and loaded.sigmas == (1.0, 2.0)
    assert loaded.spacing is None and loaded.default_spacing == (2.0, 1.0, 1.0)  # a fallback, not an override
    np.testing.assert_array_equal(loaded.predict([volume])[0], seg.predict([volume])[0])
    two_d = TrainableSegmenter(**FAST).fit([volume[12]], [labels[12]]).save(tmp_path / "m2")
    with pytest.raises(ValueError, match="model of 2D images"):
        VolumeSegmenter.load(two_d)


def test_spacing_precedence_and_per_axis_halo(tmp_path):
    volume = np.zeros((6, 8, 8), np.uint16)
    tifffile.imwrite(tmp_path / "meta.tif", volume, imagej=True, metadata={"spacing": 4.0, "axes": "ZYX"})
    tifffile.imwrite(tmp_path / "bare.tif", volume)
    meta, bare = open_volume(tmp_path / "meta.tif"), open_volume(tmp_path / "bare.tif")
    seg = VolumeSegmenter()
    assert seg.spacing_of(meta) == (4.0, 1.0, 1.0) and seg.spacing_of(bare) == (1.0, 1.0, 1.0)
    seg.default_spacing = (2.0, 1.0, 1.0)  # what a loaded model was trained with
    assert seg.spacing_of(meta) == (4.0, 1.0, 1.0) and seg.spacing_of(bare) == (2.0, 1.0, 1.0)
    seg.spacing = (1.0, 3.0, 3.0)  # given explicitly: overrides the metadata
    assert seg.spacing_of(meta) == (1.0, 3.0, 3.0)
    # σ 4 at spacing (4, 1, 1) is 1 voxel along z: the block's halo is 4 + 2 there, 16 + 8 in-plane
    assert seg.tile_grid(ArraySource(np.zeros((6, 8, 8), np.float32), spacing=(4.0, 1.0, 1.0))).halos == (6, 24, 24)
    with pytest.raises(ValueError, match="positive"):
        VolumeSegmenter(spacing=(1.0, 0.0, 1.0))


def test_volumes_open_from_tiff_stacks_zarr_and_slice_folders_with_their_spacing(tmp_path):
    volume = (np.arange(5 * 12 * 10) % 997).astype(np.uint16).reshape(5, 12, 10)
    tifffile.imwrite(tmp_path / "ome.tif", volume, ome=True,
                     metadata={"axes": "ZYX", "PhysicalSizeZ": 3.0, "PhysicalSizeY": 0.5, "PhysicalSizeX": 0.5})
    tifffile.imwrite(tmp_path / "ij.tif", volume, imagej=True, resolution=(2.0, 2.0),
                     metadata={"spacing": 1.5, "unit": "um", "axes": "ZYX"})
    out = ZarrOutput(tmp_path / "v.ome.zarr", volume.shape, volume.dtype, 8, spacing=(2.5, 1.0, 1.0))
    out.write((slice(0, 5), slice(0, 12), slice(0, 10)), volume)
    out.finish()
    (tmp_path / "slices").mkdir()
    for z in range(5):  # numbered slices, listed out of order by name length
        tifffile.imwrite(tmp_path / "slices" / f"s{z * 5}.tif", volume[z])
    box = (slice(1, 4), slice(2, 11), slice(3, 9))
    for name, spacing in [("ome.tif", (3.0, 0.5, 0.5)), ("ij.tif", (1.5, 0.5, 0.5)), ("v.ome.zarr", (2.5, 1.0, 1.0)),
                          ("slices", None)]:
        v = open_volume(tmp_path / name)
        assert v.volume_shape == volume.shape and v.spacing == spacing, name
        np.testing.assert_array_equal(v.read_box(*box), volume[box])


def test_stacks_and_slices_of_another_size_or_dtype_name_the_first(tmp_path):
    with tifffile.TiffWriter(tmp_path / "bad.tif") as tif:
        for z, page in enumerate([np.zeros((8, 8), np.uint16)] * 3 + [np.zeros((8, 9), np.uint16)]):
            tif.write(page, photometric="minisblack")
    with pytest.raises(ImageReadError, match=r"page 3 is 8×9 uint16 but page 0 is 8×8 uint16"):
        open_volume(tmp_path / "bad.tif")
    (tmp_path / "slices").mkdir()
    for z in range(3):
        tifffile.imwrite(tmp_path / "slices" / f"{z:02d}.tif", np.zeros((8, 8), np.uint8 if z == 1 else np.uint16))
    with pytest.raises(ImageReadError, match=r"slice 01.tif is 8×8 uint8 but 00.tif is 8×8 uint16"):
        open_volume(tmp_path / "slices")
    tifffile.imwrite(tmp_path / "flat.tif", np.zeros((8, 8), np.uint16))
    with pytest.raises(ImageReadError, match="one 2D image .* not a volume"):
        open_volume(tmp_path / "flat.tif")


def test_labels_of_another_shape_and_2d_inputs_are_clear_errors():
    volume, truth, labels = z_only_phase((10, 20, 20))
    with pytest.raises(ValueError, match=r"labels 0 is 10×20×19 voxels .* volume \(volume 0\) is 10×20×20 voxels"):
        VolumeSegmenter(**FAST).fit(volume, labels[:, :, :19])
    seg = VolumeSegmenter(**FAST).fit(volume, labels)
    with pytest.raises(ValueError, match="a 2D image, but the model segments volumes"):
        seg.predict([volume[0]])
    with pytest.raises(ValueError, match="dense CRF is for 2D images"):
        VolumeSegmenter(crf="gentle")


def test_triplanar_vit_features_equal_in_blocks_and_mean_is_the_average_of_the_three_orientations(tmp_path):
    from tests.helpers import TINY

    volume, _, labels = z_only_phase((10, 16, 18), seed=5)
    # one 56-px backbone window per slice (the default 518-px window would be mostly padding here)
    seg = VolumeSegmenter("alibi_vit_small_patch14_reg4_dinov2", **FAST, model_kwargs=TINY, n_components=3,
                          sigmas=(1.0,), vit_tile=56, vit_overlap=14, tile=64, vit_combine="concat").fit(volume, labels)
    n_classical = len(volume_features(np.zeros((2, 2, 2), np.float32), (1.0,)))
    whole = seg.features(volume)  # one block
    assert whole.shape == volume.shape + (n_classical + 3 * 3,)
    loaded = TrainableSegmenter.load(seg.save(tmp_path / "m"))  # the backbone rebuilt from its name and seed
    assert loaded.vit_combine == "concat"
    np.testing.assert_array_equal(loaded.predict([volume])[0], seg.predict([volume])[0])
    seg.tile = 14
    assert len(seg.tile_grid(seg.source(volume))) == 1 * 2 * 2
    np.testing.assert_allclose(seg.features(volume), whole, atol=1e-5 * np.abs(whole).max())
    seg.triplanar.combine = "mean"  # the same PCA for every orientation: the mean is over the three
    vit = whole[..., n_classical:].reshape(volume.shape + (3, 3))  # orientation, component
    np.testing.assert_allclose(seg.features(volume)[..., n_classical:], vit.mean(axis=-2),
                               atol=1e-5 * np.abs(vit).max())


def test_the_modal_filter_of_a_volume_takes_the_majority_of_n_cubed_voxels(trained, tmp_path):
    from scipy import ndimage as ndi

    volume, labels, seg, _, _ = trained
    raw = seg.predict([volume])[0]

    def majority(window):  # the most frequent value, ties to the smallest (np.unique sorts)
        values, counts = np.unique(window, return_counts=True)
        return values[np.argmax(counts)]

    want = ndi.generic_filter(raw, majority, size=3, mode="reflect")
    assert (want != raw).sum() > 100  # the filter changes this mask
    seg.modal = 3
    try:
        np.testing.assert_array_equal(seg.predict([volume])[0], want)
        segment_to_files(seg, volume, tmp_path, "v", "tif", progress=False)  # streamed: a pass over the blocks
        np.testing.assert_array_equal(tifffile.imread(tmp_path / "v_mask.tif"), want)
    finally:
        seg.modal = 0
