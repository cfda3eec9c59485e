"""``alibi-vit segment train|apply|benchmark`` on small synthetic files."""

from functools import partial

import numpy as np
import pytest
import tifffile
from PIL import Image

from alibi_vit.cli import segment as segment_cli
from alibi_vit.trainable import mean_iou, scribbles, synthetic_micrograph
from tests.helpers import run_subcommand


run = partial(run_subcommand, segment_cli)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("seg")
    (root / "images").mkdir()
    (root / "labels").mkdir()
    masks = {}
    for i in range(2):
        image, mask = synthetic_micrograph((72, 90), seed=i)
        tifffile.imwrite(root / "images" / f"m{i}.tif", image)  # 16-bit TIFF
        # Palette PNG label files named <image>_labels.png, as an annotation tool would save them.
        lab = Image.fromarray(scribbles(mask, 2, rng=i).astype(np.uint8), mode="P")
        lab.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
        lab.save(root / "labels" / f"m{i}_labels.png")
        masks[f"m{i}"] = mask
    return root, masks


def test_train_then_apply_writes_masks_and_overlays(files, tmp_path):
    root, masks = files
    assert run(["train", "--images", str(root / "images"), "--labels", str(root / "labels"), "--trees", "15",
                "--out", str(tmp_path / "model")]) == 0
    assert (tmp_path / "model" / "classifier.json").is_file()
    assert run(["apply", "--model", str(tmp_path / "model"), "--images", str(root / "images"),
                "--out", str(tmp_path / "out")]) == 0
    for stem, mask in masks.items():
        pred = np.asarray(Image.open(tmp_path / "out" / f"{stem}_mask.png"))
        assert pred.shape == mask.shape and set(np.unique(pred)) <= {1, 2, 3}
        assert mean_iou(pred, mask) > 0.5  # trained on these images' scribbles
        overlay = np.asarray(Image.open(tmp_path / "out" / f"{stem}_overlay.png"))
        assert overlay.shape == mask.shape + (3,)
    assert run(["apply", "--model", str(tmp_path / "model"), "--images", str(root / "images" / "m0.tif"),
                "--out", str(tmp_path / "tif"), "--format", "tif", "--no-overlay"]) == 0
    np.testing.assert_array_equal(tifffile.imread(tmp_path / "tif" / "m0_mask.tif"),
                                  np.asarray(Image.open(tmp_path / "out" / "m0_mask.png")))
    assert not (tmp_path / "tif" / "m0_overlay.png").exists()


def test_train_errors_name_the_problem(files, tmp_path):
    root, _ = files
    bad = tmp_path / "bad"
    bad.mkdir()
    Image.fromarray(np.zeros((10, 10), np.uint8)).save(bad / "m0_labels.png")
    with pytest.raises(ValueError, match="px but its image is"):
        run(["train", "--images", str(root / "images" / "m0.tif"), "--labels", str(bad), "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="no labels file for image"):
        run(["train", "--images", str(root / "images"), "--labels", str(bad), "--out", str(tmp_path / "x")])
    with pytest.raises(FileNotFoundError, match="neither an image file nor a folder"):
        run(["train", "--images", str(tmp_path / "missing"), "--labels", str(bad), "--out", str(tmp_path / "x")])
    with pytest.raises(FileNotFoundError, match="no config.json"):
        run(["apply", "--model", str(bad), "--images", str(root / "images"), "--out", str(tmp_path / "x")])


def test_benchmark_synthetic_and_from_folders(files, tmp_path):
    assert run(["benchmark", "--synthetic", "--synthetic-size", "64", "--synthetic-count", "1", "1", "--rounds", "2",
                "--trees", "10", "--out", str(tmp_path / "b")]) == 0
    lines = (tmp_path / "b" / "benchmark.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[1].startswith("classical,1,")
    assert (tmp_path / "b" / "miou_vs_round.png").is_file() and (tmp_path / "b" / "examples.png").is_file()
    # The same run from folders of images + ground-truth masks (masks saved as 0/127/254 grey levels).
    for split, seed in (("train", 0), ("test", 1)):
        image, mask = synthetic_micrograph(64, seed=seed)
        (tmp_path / split).mkdir()
        tifffile.imwrite(tmp_path / split / "a.tif", image)
        Image.fromarray(((mask - 1) * 127).astype(np.uint8)).save(tmp_path / split / "a_mask.png")
    assert run(["benchmark", "--train-images", str(tmp_path / "train"),
                "--train-masks", str(tmp_path / "train" / "a_mask.png"),
                "--test-images", str(tmp_path / "test"), "--test-masks", str(tmp_path / "test" / "a_mask.png"),
                "--rounds", "1", "--trees", "10", "--out", str(tmp_path / "f")]) == 0
    assert (tmp_path / "f" / "benchmark.csv").read_text().count("\n") == 2
    with pytest.raises(ValueError, match="required without --synthetic"):
        run(["benchmark", "--out", str(tmp_path / "g")])
