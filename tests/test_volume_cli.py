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
