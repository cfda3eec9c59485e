"""``alibi-vit segment train|apply`` on volumes: 3D features by default for stacks, slice folders,
OME-Zarr out, the CSV's volume fractions, and the bad inputs of volumes (one-line errors, status 2).

The references are the loaded model's own predictions on the arrays (the CLI must add nothing) and
the fractions counted on the written masks."""

from __future__ import annotations

import csv
from functools import partial

import numpy as np
import pytest
import tifffile

from alibi_vit.chunked import open_image
from alibi_vit.cli import segment as segment_cli
from alibi_vit.cli.main import main
from alibi_vit.trainable import TrainableSegmenter, VolumeSegmenter, mean_iou
from tests.helpers import run_subcommand
from tests.test_volumes import z_only_phase

run = partial(run_subcommand, segment_cli)


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("alibi-vit segment: error: "), err
    return err


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("vol_cli")
    volume, truth, labels = z_only_phase((24, 32, 32), seed=4)
    for d in ("img", "lab"):
        (root / d).mkdir()
    tifffile.imwrite(root / "img" / "v.tif", volume, imagej=True, metadata={"spacing": 2.0, "axes": "ZYX"})
    tifffile.imwrite(root / "lab" / "v_labels.tif", labels)
    assert run(["train", "--images", str(root / "img"), "--labels", str(root / "lab"), "--trees", "10",
                "--out", str(root / "m")]) == 0
    return root, volume, truth, labels


def test_a_stack_trains_a_volume_model_and_apply_writes_a_mask_stack_and_volume_fractions(stack, tmp_path):
    root, volume, truth, _ = stack
    seg = TrainableSegmenter.load(root / "m")
    assert isinstance(seg, VolumeSegmenter) and seg.default_spacing == (2.0, 1.0, 1.0)  # from the ImageJ metadata
    assert run(["apply", "--model", str(root / "m"), "--images", str(root / "img"), "--out", str(tmp_path / "o")]) == 0
    mask = tifffile.imread(tmp_path / "o" / "v_mask.tif")
    np.testing.assert_array_equal(mask, seg.predict([volume])[0])
    assert mean_iou(mask, truth) > 0.8  # the z-only phase: 3D features see it
    with open(tmp_path / "o" / "area_fractions.csv") as f:
        row = next(csv.DictReader(f))
    assert row["image"] == "v.tif"  # one row per volume, not per slice
    for c in (1, 2):
        assert float(row[f"fraction_{c}"]) == pytest.approx((mask == c).mean(), abs=1e-6)
    # --spacing overrides the file's: other σ per axis, other features
    assert run(["apply", "--model", str(root / "m"), "--images", str(root / "img"), "--spacing", "4,1,1",
                "--out-format", "ome-zarr", "--out", str(tmp_path / "z")]) == 0
    stored = open_image(tmp_path / "z" / "v_mask.ome.zarr")
    assert stored.axes == "zyx" and stored.spacing == (4.0, 1.0, 1.0)
    seg.spacing = (4.0, 1.0, 1.0)
    np.testing.assert_array_equal(stored.read_box(slice(None), slice(None), slice(None)), seg.predict([volume])[0])


def test_slice_folders_are_volumes(stack, tmp_path):
    root, volume, _, labels = stack
    for name, data in (("img", volume), ("lab", labels)):
        (tmp_path / name / "v").mkdir(parents=True)
        for z, page in enumerate(data):
            tifffile.imwrite(tmp_path / name / "v" / f"slice_{z}.tif", page)
    assert run(["train", "--images", str(tmp_path / "img" / "v"), "--labels", str(tmp_path / "lab" / "v"),
                "--slice-folders", "--spacing", "2,1,1", "--trees", "10", "--out", str(tmp_path / "m")]) == 0
    assert run(["apply", "--model", str(tmp_path / "m"), "--images", str(tmp_path / "img" / "v"), "--slice-folders",
                "--out", str(tmp_path / "o")]) == 0
    from_folder = tifffile.imread(tmp_path / "o" / "v_mask.tif")
    # the same voxels, labels and spacing as the stack: the same model and masks
    np.testing.assert_array_equal(from_folder, TrainableSegmenter.load(root / "m").predict([volume])[0])


def test_features_2d_keeps_slice_by_slice_and_models_refuse_the_other_dimension(stack, tmp_path, capsys):
    root, volume, _, _ = stack
    assert run(["train", "--images", str(root / "img"), "--labels", str(root / "lab"), "--features", "2d",
                "--trees", "10", "--out", str(tmp_path / "m2")]) == 0
    flat = TrainableSegmenter.load(tmp_path / "m2")
    assert not isinstance(flat, VolumeSegmenter)
    capsys.readouterr()
    assert main(["segment", "apply", "--model", str(tmp_path / "m2"), "--images", str(root / "img"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "is a volume but the model" in _one_line_error(capsys) and not (tmp_path / "o" / "v_mask.tif").exists()
    assert run(["apply", "--model", str(tmp_path / "m2"), "--images", str(root / "img"), "--features", "2d",
                "--out", str(tmp_path / "o")]) == 0
    masks = tifffile.imread(tmp_path / "o" / "v_mask.tif")
    for z in (0, 13):
        np.testing.assert_array_equal(masks[z], flat.predict([volume[z]])[0])
    tifffile.imwrite(tmp_path / "flat.tif", volume[0])
    assert main(["segment", "apply", "--model", str(root / "m"), "--images", str(tmp_path / "flat.tif"),
                 "--out", str(tmp_path / "o3")]) == 2
    assert "is a 2D image but the model" in _one_line_error(capsys)


@pytest.mark.parametrize("extra, message", [(["--spacing", "1,0,1"], "three positive numbers"),
                                            (["--spacing", "1,-2,1"], "three positive numbers"),
                                            (["--spacing", "1,1"], "three positive numbers")])
def test_bad_spacing_is_a_one_line_error(stack, tmp_path, capsys, extra, message):
    root = stack[0]
    with pytest.raises(SystemExit) as exit_:  # argparse's own one-line usage error
        main(["segment", "train", "--images", str(root / "img"), "--labels", str(root / "lab"), *extra,
              "--out", str(tmp_path / "m")])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_labels_of_another_shape_and_mismatched_pages_are_named(stack, tmp_path, capsys):
    root, volume, _, labels = stack
    for d in ("img", "lab"):
        (tmp_path / d).mkdir()
    tifffile.imwrite(tmp_path / "img" / "v.tif", volume)
    tifffile.imwrite(tmp_path / "lab" / "v_labels.tif", labels[:, :, :30])
    assert main(["segment", "train", "--images", str(tmp_path / "img"), "--labels", str(tmp_path / "lab"),
                 "--out", str(tmp_path / "m")]) == 2
    err = _one_line_error(capsys)
    assert "24×32×30" in err and "24×32×32" in err
    with tifffile.TiffWriter(tmp_path / "img" / "v.tif") as tif:
        for page in [volume[0]] * 2 + [volume[0, :, :20]]:
            tif.write(page, photometric="minisblack")
    assert main(["segment", "train", "--images", str(tmp_path / "img"), "--labels", str(tmp_path / "lab"),
                 "--out", str(tmp_path / "m")]) == 2
    assert "page 2 is 32×20 uint16 but page 0 is 32×32 uint16" in _one_line_error(capsys)


def test_the_feature_hook_is_feature_fn_and_its_former_spelling_still_works(tmp_path, capsys):
    import json

    from alibi_vit.trainable import scribbles, synthetic_micrograph

    (tmp_path / "img").mkdir()
    image, mask = synthetic_micrograph(48, seed=0)
    tifffile.imwrite(tmp_path / "img" / "a.tif", image)
    tifffile.imwrite(tmp_path / "img" / "a_labels.tif", scribbles(mask, 1, rng=0).astype(np.uint8))
    hook = "tests.test_trainable_segmenter:user_features"
    for flag, out in (("--feature-fn", "new"), ("--features", "old")):
        assert run(["train", "--images", str(tmp_path / "img"), "--labels", str(tmp_path / "img"), flag, hook,
                    "--trees", "5", "--out", str(tmp_path / out)]) == 0
        assert json.loads((tmp_path / out / "config.json").read_text())["feature_fn"] == hook
    assert f"note: --features {hook} is read as --feature-fn" in capsys.readouterr().err
    assert main(["segment", "train", "--images", str(tmp_path / "img"), "--labels", str(tmp_path / "img"),
                 "--features", "4d", "--out", str(tmp_path / "x")]) == 2
    assert "--features must be one of auto, 2d, 3d, got '4d'" in _one_line_error(capsys)


def test_a_volume_on_a_local_cluster_writes_the_model_prediction_with_the_given_spacing(stack, tmp_path):
    """--scheduler local:2: the volume is one unit on a worker process, which loads the model from its
    files and must still take --spacing (other spacing: other 3D features, other masks)."""
    root, volume, _, _ = stack
    assert run(["apply", "--model", str(root / "m"), "--images", str(root / "img"), "--spacing", "4,1,1",
                "--scheduler", "local:2", "--proba", "--out", str(tmp_path / "o")]) == 0
    seg = TrainableSegmenter.load(root / "m")
    seg.spacing = (4.0, 1.0, 1.0)
    expected = seg.predict_proba([volume])[0]
    mask = tifffile.imread(tmp_path / "o" / "v_mask.tif")
    np.testing.assert_array_equal(mask, seg.classes_[expected.argmax(-1)])
    for i, c in enumerate(seg.classes_):
        np.testing.assert_allclose(tifffile.imread(tmp_path / "o" / f"v_proba_{c}.tif"), expected[..., i], atol=1e-6)
    with open(tmp_path / "o" / "area_fractions.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["image"] for r in rows if r["image"] not in ("mean", "std")] == ["v.tif"]  # one row per volume
    assert float(rows[0]["fraction_1"]) == pytest.approx((mask == 1).mean(), abs=1e-6)


def _ngff_store(path, data, axes, scale):
    """An NGFF 0.4 OME-Zarr image of ``data`` with the named ``axes`` and a level-0 ``scale`` transform."""
    import zarr

    group = zarr.open_group(str(path), mode="w", zarr_format=2)
    group.create_array("0", shape=data.shape, chunks=data.shape, dtype=data.dtype)[:] = data
    kinds = {"t": "time", "c": "channel"}
    group.attrs["multiscales"] = [{"version": "0.4", "axes": [{"name": a, "type": kinds.get(a, "space")} for a in axes],
                                   "datasets": [{"path": "0", "coordinateTransformations": [
                                       {"type": "scale", "scale": list(scale)}]}]}]


def test_an_ngff_tczyx_volume_of_one_time_point_and_channel_is_a_volume(stack, tmp_path, capsys):
    root, volume, _, _ = stack
    _ngff_store(tmp_path / "t.ome.zarr", volume[None, None], "tczyx", (1, 1, 2, 1, 1))
    assert open_image(tmp_path / "t.ome.zarr").is_volume  # the singleton t and c axes are dropped
    assert main(["segment", "apply", "--model", str(root / "m"), "--images", str(tmp_path / "t.ome.zarr"),
                 "--out", str(tmp_path / "o")]) == 0
    mask = open_image(tmp_path / "o" / "t_mask.ome.zarr").read_box(slice(None), slice(None), slice(None))
    np.testing.assert_array_equal(mask, TrainableSegmenter.load(root / "m").predict([volume])[0])
    # A model of 2D images names it as a volume; --features 2d says what it takes slice by slice.
    assert run(["train", "--images", str(root / "img"), "--labels", str(root / "lab"), "--features", "2d",
                "--trees", "3", "--out", str(tmp_path / "m2")]) == 0
    for extra, said in (([], "t.ome.zarr is a volume but the model"),
                        (["--features", "2d"], "t.ome.zarr is a zarr volume: --features 2d segments TIFF stacks")):
        assert main(["segment", "apply", "--model", str(tmp_path / "m2"), "--images", str(tmp_path / "t.ome.zarr"),
                     *extra, "--out", str(tmp_path / "o3")]) == 2
        assert said in _one_line_error(capsys)
    # Several time points stay planes along t: refused by the volume model, named as such.
    _ngff_store(tmp_path / "tt.ome.zarr", np.stack([volume[None]] * 2), "tczyx", (1, 1, 2, 1, 1))
    assert main(["segment", "apply", "--model", str(root / "m"), "--images", str(tmp_path / "tt.ome.zarr"),
                 "--out", str(tmp_path / "o2")]) == 2
    assert "tt.ome.zarr is 48 planes along tz (axes tczyx)" in _one_line_error(capsys)


def test_a_volume_model_names_uneven_pages_and_a_colour_image(stack, tmp_path, capsys):
    root, volume, _, _ = stack
    with tifffile.TiffWriter(tmp_path / "uneven.tif") as tif:
        for page in [volume[0]] * 2 + [volume[0, :, :20]]:
            tif.write(page, photometric="minisblack")
    assert main(["segment", "apply", "--model", str(root / "m"), "--images", str(tmp_path / "uneven.tif"),
                 "--out", str(tmp_path / "o")]) == 2
    assert _one_line_error(capsys) == (f"alibi-vit segment: error: {tmp_path / 'uneven.tif'}: page 2 is 32×20 uint16 "
                                       "but page 0 is 32×32 uint16: the pages of a stack must share one size and dtype")
    tifffile.imwrite(tmp_path / "rgb.tif", np.zeros((32, 32, 3), np.uint8), photometric="rgb")
    assert main(["segment", "apply", "--model", str(root / "m"), "--images", str(tmp_path / "rgb.tif"),
                 "--out", str(tmp_path / "o")]) == 2
    assert (f"{tmp_path / 'rgb.tif'} is one 2D RGB image (3 samples per pixel, axes yxc), not a grey volume, but the "
            "model") in _one_line_error(capsys)
    assert not (tmp_path / "o").exists()


def test_the_voxel_spacing_used_is_said_and_recorded_per_volume(stack, tmp_path, capsys):
    import json

    root = stack[0]
    for extra, spacing, origin in (([], [2.0, 1.0, 1.0], "the file's metadata"),
                                   (["--spacing", "4,1,1"], [4.0, 1.0, 1.0], "--spacing")):
        out = tmp_path / f"o{len(extra)}"
        assert main(["segment", "apply", "--model", str(root / "m"), "--images", str(root / "img"), *extra,
                     "--out", str(out)]) == 0
        said = f"voxel spacing z,y,x {','.join(f'{v:g}' for v in spacing)} ({origin}): v.tif\n"
        assert said in capsys.readouterr().err
        manifest = json.loads((out / "segment_run.json").read_text())
        assert manifest["images"]["v.tif"]["voxel_spacing"] == spacing
