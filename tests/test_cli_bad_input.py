"""Bad input to ``alibi-vit`` commands: one line naming the problem, exit status 2, said before the slow part.

"Before the slow part" is checked two ways: argument mistakes are answered in a fresh process that never
imported torch (what took 6-10 s), and mistakes that need a model (its patch grid) are answered before any
patch feature is computed (``patch_features`` is replaced by a function that fails the test).
"""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from alibi_vit.cli.main import main
from tests.helpers import TINY, run_in_fresh_process

TINY_ARGS = [arg for key, value in TINY.items() for arg in ("--model-arg", f"{key}={value}")]
NAME = "alibi_vit_small_patch14_reg4_dinov2"


@pytest.mark.parametrize("args, message", [
    (["probe", "--model", NAME, "--images", "noise", "--noise-count", "0"], "argument --noise-count: must be at least 1, got 0"),
    (["probe", "--model", NAME, "--images", "noise", "--fraction", "2"], "argument --fraction: must be between 0 and 1"),
    (["segment", "train", "--images", "x", "--labels", "y", "--out", "m", "--components", "0"],
     "argument --components: must be at least 1, got 0"),
    (["segment", "benchmark", "--synthetic", "--synthetic-size", "0"], "argument --synthetic-size: must be at least 1"),
    (["show", "--model", NAME, "--images", "textures", "--out", "f", "--k", "0"], "argument --k: must be at least 1"),
    (["show", "--model", NAME, "--images", "textures", "--out", "f", "--size", "448", "--query", "448", "10"],
     "--query 448 10 is outside the 448×448 px image"),
    (["robustness", "--checkpoint", "."], "probe checkpoint . is a folder: give the file"),
    (["export", "--checkpoint", ".", "--out", "x.safetensors"], "checkpoint . is a folder: give the file"),
    (["export", "--checkpoint", "a_file", "--out", "a_file/x.safetensors"], "--out a_file: a_file is an existing file; give a folder"),
])
def test_argument_mistakes_are_one_line_before_torch_is_imported(tmp_path, args, message):
    (tmp_path / "a_file").write_text("")
    result = run_in_fresh_process(args, tmp_path)
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip()
    assert "\n" not in err and err.startswith("alibi-vit ") and message in err, err
    assert result.stdout.strip() == "torch not imported"


def test_export_into_a_folder_that_cannot_be_written_is_one_line(tmp_path):
    try:
        Path("/sys/alibi-vit-test").mkdir()
    except OSError:
        pass
    else:
        Path("/sys/alibi-vit-test").rmdir()
        pytest.skip("/sys is writable here")
    (tmp_path / "run.ckpt").write_bytes(b"")
    result = run_in_fresh_process(["export", "--checkpoint", "run.ckpt", "--out", "/sys/alibi-vit-test/x.safetensors"],
                                  tmp_path)
    assert result.returncode == 2 and "--out: cannot write in /sys/alibi-vit-test" in result.stderr.strip()


@pytest.fixture
def no_features(monkeypatch):
    """Any patch feature computed fails the test."""
    import alibi_vit.features

    def refuse(*args, **kwargs):
        raise AssertionError("patch features were computed before the error")

    monkeypatch.setattr(alibi_vit.features, "patch_features", refuse)


def _one_line_error(capsys, command):
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"alibi-vit {command}: error: "), err
    return err[-1]


def test_show_k_beyond_the_patch_grid_is_said_before_any_feature(tmp_path, capsys, no_features):
    assert main(["show", "--model", NAME, *TINY_ARGS, "--images", "textures", "--size", "56", "--k", "100000",
                 "--out", str(tmp_path / "f")]) == 2
    assert "--k 100000 is more clusters than the 4×4 = 16 patches" in _one_line_error(capsys, "show")
    assert not (tmp_path / "f").exists()


def test_show_out_that_is_a_file_asks_for_a_folder(tmp_path, capsys, no_features):
    (tmp_path / "figure.png").write_bytes(b"")
    assert main(["show", "--model", NAME, *TINY_ARGS, "--images", "textures", "--size", "56",
                 "--out", str(tmp_path / "figure.png")]) == 2
    assert _one_line_error(capsys, "show") == (f"alibi-vit show: error: --out {tmp_path / 'figure.png'}: "
                                               f"{tmp_path / 'figure.png'} is an existing file; give a folder")


def test_a_model_with_no_blocks_is_refused(tmp_path, capsys, no_features):
    assert main(["probe", "--model", NAME, "--model-arg", "depth=0", "--images", "noise", "--noise-count", "2",
                 "--out", str(tmp_path / "p.csv")]) == 2
    assert "a backbone needs at least one transformer block" in _one_line_error(capsys, "probe")


@pytest.mark.parametrize("command", ["probe", "heads"])
def test_a_size_below_one_patch_suggests_one_size(tmp_path, capsys, no_features, command):
    assert main([command, "--model", NAME, *TINY_ARGS, "--images", "noise", "--noise-count", "1", "--size", "10",
                 "--out", str(tmp_path / "x.csv")]) == 2
    err = _one_line_error(capsys, command)
    assert err.endswith("--size 10 is not a multiple of the patch size 14 px; use e.g. 14"), err


def test_a_tiny_image_blown_up_to_the_probe_size_is_warned_about(tmp_path, capsys):
    Image.fromarray(np.full((1, 1), 128, np.uint8)).save(tmp_path / "dot.png")
    assert main(["probe", "--model", NAME, *TINY_ARGS, "--images", str(tmp_path / "dot.png"), "--size", "56",
                 "--repeats", "1", "--out", str(tmp_path / "p.csv")]) == 0
    assert "image dot is 1×1 px: upscaled 56× to 56×56 px" in capsys.readouterr().err
    from alibi_vit.images import load_image_set

    with pytest.warns(UserWarning) as record:  # 4× is the bound: 14 px to 56 px is not warned about
        Image.fromarray(np.zeros((14, 14), np.uint8)).save(tmp_path / "small.png")
        load_image_set(str(tmp_path / "small.png"), 56)
        load_image_set(str(tmp_path / "dot.png"), 56)
    assert len(record) == 1


@pytest.fixture(scope="module")
def micrographs(tmp_path_factory):
    """Two 16-bit micrographs with scribble labels, and a label file whose image is missing."""
    import tifffile

    from alibi_vit.trainable import scribbles, synthetic_micrograph

    root = tmp_path_factory.mktemp("micrographs")
    (root / "images").mkdir()
    (root / "labels").mkdir()
    for i in range(2):
        image, mask = synthetic_micrograph((48, 64), seed=i)
        tifffile.imwrite(root / "images" / f"m{i}.tif", image)
        Image.fromarray(scribbles(mask, 2, rng=i).astype(np.uint8)).save(root / "labels" / f"m{i}_labels.png")
        Image.fromarray(mask.astype(np.uint8)).save(root / "labels" / f"m{i}_mask.png")
    Image.fromarray(np.ones((48, 64), np.uint8)).save(root / "labels" / "m7_labels.png")  # no m7 image
    return root


def test_a_misspelt_backbone_is_named_as_unknown_not_as_without_weights(micrographs, tmp_path, capsys):
    assert main(["segment", "train", "--images", str(micrographs / "images"), "--labels", str(micrographs / "labels"),
                 "--backbone", "alibi_vit_smal_patch14_reg4_dinov2", "--out", str(tmp_path / "m")]) == 2
    err = _one_line_error(capsys, "segment")
    assert "unknown model 'alibi_vit_smal_patch14_reg4_dinov2'; did you mean" in err and "no weights" not in err


def test_label_files_without_an_image_are_named(micrographs, tmp_path, capsys):
    labels = tmp_path / "labels"
    labels.mkdir()
    for name in ("m0_labels.png", "m1_labels.png", "m7_labels.png"):
        (labels / name).write_bytes((micrographs / "labels" / name).read_bytes())
    assert main(["segment", "train", "--images", str(micrographs / "images"), "--labels", str(labels), "--trees", "3",
                 "--out", str(tmp_path / "m")]) == 0
    assert "1 labels file(s) match no image and are not used: m7_labels.png" in capsys.readouterr().err


def test_benchmark_with_test_classes_missing_from_training_is_refused(micrographs, tmp_path, capsys):
    masks = tmp_path / "train_masks"
    masks.mkdir()
    for i in range(2):  # training masks that never show class 3
        mask = np.asarray(Image.open(micrographs / "labels" / f"m{i}_mask.png")).copy()
        mask[mask == 3] = 1
        Image.fromarray(mask).save(masks / f"m{i}_mask.png")
    images = str(micrographs / "images")
    assert main(["segment", "benchmark", "--train-images", images, "--train-masks", str(masks), "--test-images",
                 images, "--test-masks", str(micrographs / "labels" / "m0_mask.png"),
                 str(micrographs / "labels" / "m1_mask.png"), "--out", str(tmp_path / "b")]) == 2
    assert "the test masks hold class(es) 3 that no training mask has" in _one_line_error(capsys, "segment")
    assert not (tmp_path / "b").exists()


def test_benchmark_on_images_smaller_than_the_filters_is_warned_about(tmp_path, capsys):
    assert main(["segment", "benchmark", "--synthetic", "--synthetic-size", "24", "--synthetic-count", "1", "1",
                 "--rounds", "1", "--trees", "3", "--out", str(tmp_path / "b")]) == 0
    assert "--synthetic-size 24: images under 64 px are smaller than the filters' reach" in capsys.readouterr().err
