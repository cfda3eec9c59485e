"""``alibi-vit segment train|apply|benchmark`` on small synthetic files."""

from functools import partial

import numpy as np
import pytest
import tifffile
import torch
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
    # The model holds the intensity range fitted on the training files and apply uses it: its masks
    # are the loaded segmenter's predictions on the raw 16-bit arrays.
    from alibi_vit.trainable import TrainableSegmenter

    seg = TrainableSegmenter.load(tmp_path / "model")
    pooled = np.concatenate([tifffile.imread(root / "images" / f"{s}.tif").ravel() for s in masks]).astype(float)
    np.testing.assert_allclose(seg.intensity_range, np.percentile(pooled, (0.01, 99.99)), rtol=1e-6)
    for stem in masks:
        np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "out" / f"{stem}_mask.png")),
                                      seg.predict([tifffile.imread(root / "images" / f"{stem}.tif")])[0])


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
    jpeg = tmp_path / "jpeg"
    jpeg.mkdir()
    Image.fromarray(np.asarray(Image.open(root / "labels" / "m0_labels.png"))).save(jpeg / "m0_labels.jpg")
    with pytest.raises(ValueError, match=r"m0_labels.jpg is a JPEG: .*save labels as PNG or TIFF"):
        run(["train", "--images", str(root / "images" / "m0.tif"), "--labels", str(jpeg), "--out", str(tmp_path / "x")])
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


def test_benchmark_composition_shift_compares_intensity_modes(tmp_path, capsys):
    assert run(["benchmark", "--composition-shift", "--synthetic-size", "64", "--synthetic-count", "1", "1",
                "--rounds", "1", "--trees", "5", "--out", str(tmp_path / "c")]) == 0
    lines = (tmp_path / "c" / "benchmark.csv").read_text().splitlines()
    assert lines[0] == "method,round,scribbled_pixels,miou,pixel_accuracy"
    assert [line.split(",")[0] for line in lines[1:]] == [
        f"classical [intensity={m}]" for m in ("training", "percentile", "minmax", "dtype")]
    assert "pixel accuracy" in capsys.readouterr().out


TINY_VIT = ["--backbone", "alibi_vit_small_patch14_reg4_dinov2", "--model-arg", "depth=1", "--model-arg",
            "embed_dim=32", "--model-arg", "num_heads=2", "--components", "3", "--trees", "5"]


def _one_line_error(capsys, command="segment"):
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"alibi-vit {command}: error: ") and "\n" not in err, err
    return err


def test_random_init_backbone_must_be_asked_for_and_is_seeded(files, tmp_path, capsys):
    from safetensors.torch import load_file

    from alibi_vit.cli.main import main

    root, _ = files
    common = ["segment", "train", "--images", str(root / "images"), "--labels", str(root / "labels"), *TINY_VIT]
    assert main([*common, "--out", str(tmp_path / "m")]) == 2
    assert "--allow-random-init" in _one_line_error(capsys)
    assert not (tmp_path / "m").exists()
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        assert main([*common, "--allow-random-init", "--seed", seed, "--out", str(tmp_path / name)]) == 0
    weights = {name: load_file(str(tmp_path / name / "backbone.safetensors")) for name in "abc"}
    mode = (tmp_path / "a" / "backbone.safetensors").stat().st_mode & 0o777
    assert mode == (tmp_path / "a" / "config.json").stat().st_mode & 0o777  # not safetensors' private 0600
    assert all(torch.equal(weights["a"][k], weights["b"][k]) for k in weights["a"])  # same seed, same model
    assert any(not torch.equal(weights["a"][k], weights["c"][k]) for k in weights["a"])


def test_images_and_labels_in_one_folder_pair_by_suffix(files, tmp_path, capsys):
    from alibi_vit.cli.main import main

    root, _ = files
    both = tmp_path / "both"
    both.mkdir()
    for p in [*(root / "images").iterdir(), *(root / "labels").iterdir()]:
        (both / p.name).write_bytes(p.read_bytes())
    assert main(["segment", "train", "--images", str(both), "--labels", str(both), "--trees", "5",
                 "--out", str(tmp_path / "model")]) == 0
    assert "trained on 2 image(s)" in capsys.readouterr().out
    only_images = tmp_path / "only_images"
    only_images.mkdir()
    for p in (root / "images").iterdir():
        (only_images / p.name).write_bytes(p.read_bytes())
    assert main(["segment", "train", "--images", str(only_images), "--labels", str(only_images),
                 "--out", str(tmp_path / "x")]) == 2
    assert "found no labels to pair among 2 file(s) (m0.tif, m1.tif)" in _one_line_error(capsys)


def test_out_that_is_a_file_fails_before_training(files, tmp_path, capsys, monkeypatch):
    from alibi_vit.cli.main import main
    from alibi_vit.trainable import TrainableSegmenter

    def no_training(*args, **kwargs):
        raise AssertionError("training started before the output was checked")

    monkeypatch.setattr(TrainableSegmenter, "fit", no_training)
    root, _ = files
    taken = tmp_path / "model"
    taken.write_text("a file, not a folder")
    assert main(["segment", "train", "--images", str(root / "images"), "--labels", str(root / "labels"),
                 "--out", str(taken)]) == 2
    assert f"--out {taken}: {taken} is an existing file" in _one_line_error(capsys)
    assert main(["segment", "train", "--images", str(root / "images"), "--labels", str(root / "labels"),
                 "--out", str(taken / "inside")]) == 2
    assert f"--out {taken / 'inside'}: {taken} is an existing file" in _one_line_error(capsys)


@pytest.fixture(scope="module")
def trained_model(files, tmp_path_factory):
    root, _ = files
    out = tmp_path_factory.mktemp("model") / "model"
    assert run(["train", "--images", str(root / "images"), "--labels", str(root / "labels"), "--trees", "5",
                "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("damaged", ["classifier.json", "config.json"])
def test_damaged_model_files_are_named(files, trained_model, tmp_path, capsys, damaged):
    import shutil

    from alibi_vit.cli.main import main

    root, _ = files
    model = tmp_path / "model"
    shutil.copytree(trained_model, model)
    (model / damaged).write_text('{"learner": {"truncated')
    assert main(["segment", "apply", "--model", str(model), "--images", str(root / "images"),
                 "--out", str(tmp_path / "out")]) == 2
    err = _one_line_error(capsys)
    assert f"{model / damaged} is not" in err and "damaged" in err and ".cc:" not in err


def test_apply_skips_unreadable_images_writes_the_rest_and_fails(files, trained_model, tmp_path, capsys):
    from alibi_vit.cli.main import main

    root, _ = files
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for p in (root / "images").iterdir():
        (mixed / p.name).write_bytes(p.read_bytes())
    (mixed / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    assert main(["segment", "apply", "--model", str(trained_model), "--images", str(mixed),
                 "--out", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert "segmented 2 of 3 image(s)" in captured.out
    assert "warning: skipped" in captured.err and "broken.png" in captured.err
    assert captured.err.strip().splitlines()[-1] == \
        "alibi-vit segment: error: 1 image(s) could not be segmented: broken.png"
    assert sorted(p.name for p in (tmp_path / "out").glob("*_mask.png")) == ["m0_mask.png", "m1_mask.png"]


def test_apply_writes_palette_masks_probabilities_and_area_fractions(files, trained_model, tmp_path):
    import csv

    from alibi_vit.trainable import TrainableSegmenter
    from alibi_vit.trainable.io import palette

    root, masks = files
    assert run(["apply", "--model", str(trained_model), "--images", str(root / "images"), "--proba",
                "--out", str(tmp_path / "out")]) == 0
    seg = TrainableSegmenter.load(trained_model)
    rows = {r["image"]: r for r in csv.DictReader(open(tmp_path / "out" / "area_fractions.csv"))}
    fractions = []
    for stem in masks:
        png = Image.open(tmp_path / "out" / f"{stem}_mask.png")
        assert png.mode == "P"  # shown in the class colours by any viewer
        pred = np.asarray(png)  # the indices are the class values
        rgb = np.asarray(png.convert("RGB"))
        for c in (1, 2, 3):
            if (pred == c).any():
                np.testing.assert_array_equal(rgb[pred == c][0], palette(3)[c])
        proba = np.stack([tifffile.imread(tmp_path / "out" / f"{stem}_proba_{c}.tif") for c in (1, 2, 3)], -1)
        np.testing.assert_allclose(proba.sum(-1), 1, atol=1e-5)
        np.testing.assert_array_equal(seg.classes_[proba.argmax(-1)], pred)
        row = rows[f"{stem}.tif"]
        for c in (1, 2, 3):  # fractions are pixel counts over the image's size
            assert int(row[f"pixels_{c}"]) == (pred == c).sum()
            assert float(row[f"fraction_{c}"]) == pytest.approx((pred == c).sum() / pred.size, abs=1e-6)
        fractions.append([(pred == c).mean() for c in (1, 2, 3)])
    key = np.asarray(Image.open(tmp_path / "out" / "colour_key.png").convert("RGB"))
    for c in (1, 2, 3):  # one swatch per class, in the masks' colours
        assert (key == palette(3)[c]).all(-1).sum() > 100
    fractions = np.array(fractions)
    for c in (1, 2, 3):
        assert float(rows["mean"][f"fraction_{c}"]) == pytest.approx(fractions[:, c - 1].mean(), abs=1e-6)
        assert float(rows["std"][f"fraction_{c}"]) == pytest.approx(fractions[:, c - 1].std(ddof=1), abs=1e-6)


def test_colour_model_on_colour_files_and_grey_files_are_an_error(tmp_path, capsys):
    from alibi_vit.cli.main import main
    from alibi_vit.trainable.io import palette

    for d in ("img", "lab", "grey"):
        (tmp_path / d).mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        _, mask = synthetic_micrograph(48, seed=i)
        colours = np.array([[0, 0, 0], [200, 60, 160], [60, 150, 140], [120, 120, 120]], np.float64)
        rgb = np.clip(colours[mask] + rng.normal(0, 6, mask.shape + (3,)), 0, 255).astype(np.uint8)
        Image.fromarray(rgb).save(tmp_path / "img" / f"c{i}.png")
        Image.fromarray(scribbles(mask, 2, rng=i).astype(np.uint8)).save(tmp_path / "lab" / f"c{i}_labels.png")
        Image.fromarray(rgb[..., 0]).save(tmp_path / "grey" / f"g{i}.png")
    assert run(["train", "--images", str(tmp_path / "img"), "--labels", str(tmp_path / "lab"), "--trees", "10",
                "--out", str(tmp_path / "m")]) == 0
    assert run(["apply", "--model", str(tmp_path / "m"), "--images", str(tmp_path / "img" / "c1.png"),
                "--out", str(tmp_path / "out")]) == 0
    rgb = np.asarray(Image.open(tmp_path / "img" / "c1.png")).astype(np.float64)
    mask = np.asarray(Image.open(tmp_path / "out" / "c1_mask.png"))
    expected = (0.6 * rgb + 0.4 * palette(3)[mask]).round()  # the overlay keeps the image's own colours
    np.testing.assert_allclose(np.asarray(Image.open(tmp_path / "out" / "c1_overlay.png")), expected, atol=1)
    capsys.readouterr()
    assert main(["segment", "apply", "--model", str(tmp_path / "m"), "--images", str(tmp_path / "grey"),
                 "--out", str(tmp_path / "out2")]) == 2
    assert "is grayscale but the model was trained on colour images" in _one_line_error(capsys)


def test_stacks_with_features_2d_are_segmented_slice_by_slice_and_written_back_as_stacks(tmp_path):
    from alibi_vit.trainable import TrainableSegmenter

    for d in ("img", "lab", "new"):
        (tmp_path / d).mkdir()
    pairs = [synthetic_micrograph(48, seed=s) for s in range(3)]
    stack = np.stack([p[0] for p in pairs])
    labels = np.stack([scribbles(pairs[0][1], 2, rng=0), np.zeros((48, 48), np.uint8), scribbles(pairs[2][1], 2, rng=2)])
    tifffile.imwrite(tmp_path / "img" / "vol.tif", stack, photometric="minisblack")
    tifffile.imwrite(tmp_path / "lab" / "vol_labels.tif", labels.astype(np.uint8), photometric="minisblack")
    assert run(["train", "--images", str(tmp_path / "img"), "--labels", str(tmp_path / "lab"), "--trees", "10",
                "--features", "2d", "--out", str(tmp_path / "m")]) == 0  # the middle slice has no labels: fine
    assert run(["apply", "--model", str(tmp_path / "m"), "--images", str(tmp_path / "img"), "--proba",
                "--features", "2d", "--out", str(tmp_path / "out")]) == 0
    masks = tifffile.imread(tmp_path / "out" / "vol_mask.tif")
    assert masks.shape == stack.shape
    seg = TrainableSegmenter.load(tmp_path / "m")
    for z in range(3):  # each slice as the model segments that slice alone
        np.testing.assert_array_equal(masks[z], seg.predict([stack[z]])[0])
    assert tifffile.imread(tmp_path / "out" / "vol_proba_1.tif").shape == stack.shape
    rows = (tmp_path / "out" / "area_fractions.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:4]] == ["vol.tif[0]", "vol.tif[1]", "vol.tif[2]"]
    # Labels for slices that do not exist: an error naming both counts.
    tifffile.imwrite(tmp_path / "lab" / "vol_labels.tif", np.concatenate([labels, labels]).astype(np.uint8),
                     photometric="minisblack")
    with pytest.raises(ValueError, match="is a stack of 6 slices but image .* is a stack of 3 slices"):
        run(["train", "--images", str(tmp_path / "img"), "--labels", str(tmp_path / "lab"), "--features", "2d",
             "--out", str(tmp_path / "m2")])


def test_modal_option_filters_the_written_masks(files, tmp_path):
    from alibi_vit.trainable.segmenter import modal_filter

    root, _ = files
    assert run(["train", "--images", str(root / "images"), "--labels", str(root / "labels"), "--trees", "5",
                "--modal", "5", "--out", str(tmp_path / "m")]) == 0
    image = str(root / "images" / "m0.tif")
    assert run(["apply", "--model", str(tmp_path / "m"), "--images", image, "--out", str(tmp_path / "a")]) == 0
    assert run(["apply", "--model", str(tmp_path / "m"), "--images", image, "--modal", "0",
                "--out", str(tmp_path / "b")]) == 0
    filtered, raw = (np.asarray(Image.open(tmp_path / d / "m0_mask.png")) for d in ("a", "b"))
    np.testing.assert_array_equal(filtered, modal_filter(raw, 5))
    with pytest.raises(ValueError, match="--modal must be 0 or an odd"):
        run(["apply", "--model", str(tmp_path / "m"), "--images", image, "--modal", "4", "--out", str(tmp_path / "c")])


def test_recursive_apply_mirrors_subfolders(files, trained_model, tmp_path):
    root, masks = files
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "m0.tif").write_bytes((root / "images" / "m0.tif").read_bytes())
    (tmp_path / "in" / "sub" / "m1.tif").write_bytes((root / "images" / "m1.tif").read_bytes())
    assert run(["apply", "--model", str(trained_model), "--images", str(tmp_path / "in"), "--out", str(tmp_path / "a")]) == 0
    assert not (tmp_path / "a" / "sub").exists()  # not recursive by default
    assert run(["apply", "--model", str(trained_model), "--images", str(tmp_path / "in"), "--recursive",
                "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "m0_mask.png").is_file() and (tmp_path / "b" / "sub" / "m1_mask.png").is_file()
    assert (tmp_path / "b" / "sub" / "m1_overlay.png").is_file()
    names = [r.split(",")[0] for r in (tmp_path / "b" / "area_fractions.csv").read_text().splitlines()[1:]]
    assert names == ["m0.tif", "sub/m1.tif", "mean", "std"]


def _last_error(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("alibi-vit segment: error: "), err
    return err[-1]


def test_tifffile_notes_are_one_warning_naming_the_file(tmp_path, capsys):
    """tifffile logs what it cannot parse (here ImageJ metadata promising 5 slices in a 1-page file) and reads
    the pixels regardless: one warning of the command naming the file, not tifffile's bare log lines."""
    from alibi_vit.cli.main import main

    image, mask = synthetic_micrograph((48, 64), seed=0)
    tifffile.imwrite(tmp_path / "ij.tif", image, description="ImageJ=1.11a\nimages=5\nslices=5\n", metadata=None)
    Image.fromarray(scribbles(mask, 2, rng=0).astype(np.uint8)).save(tmp_path / "ij_labels.png")
    assert main(["segment", "train", "--images", str(tmp_path / "ij.tif"), "--labels", str(tmp_path / "ij_labels.png"),
                 "--trees", "3", "--out", str(tmp_path / "m")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "ImageJ" in line]
    assert lines == ["alibi-vit segment: warning: ij.tif: ImageJ series metadata invalid or corrupted file (tifffile)"]


def test_out_equal_to_images_does_not_segment_its_own_outputs(files, trained_model, tmp_path, capsys):
    from alibi_vit.cli.main import main

    root, masks = files
    folder = tmp_path / "both"
    folder.mkdir()
    for p in (root / "images").iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    for _ in range(2):  # the second run finds the first one's masks, overlays and colour key in --images
        assert main(["segment", "apply", "--model", str(trained_model), "--images", str(folder),
                     "--out", str(folder)]) == 0
    captured = capsys.readouterr()
    assert "note: 5 file(s) in --out" in captured.err and "segmented 2 of 2 image(s)" in captured.out
    names = [r.split(",")[0] for r in (folder / "area_fractions.csv").read_text().splitlines()[1:]]
    assert names == ["m0.tif", "m1.tif", "mean", "std"]
    assert not list(folder.glob("*_mask_*")) and not list(folder.glob("*_overlay_*"))


def test_shard_values_starting_with_a_dash_and_bad_memory_sizes_name_the_option(files, trained_model, tmp_path,
                                                                                capsys):
    from alibi_vit.cli.main import main

    root, _ = files
    common = ["segment", "apply", "--model", str(trained_model), "--images", str(root / "images"),
              "--out", str(tmp_path / "out")]
    assert main([*common, "--shard", "-1/2"]) == 2  # argparse alone: "expected one argument"
    assert _last_error(capsys) == "alibi-vit segment: error: --shard -1/2: the share I must be in 0..1"
    for option in ("--worker-memory", "--slurm-memory"):
        with pytest.raises(SystemExit) as stop:
            main([*common, option, "lots"])
        assert stop.value.code == 2
        assert f"argument {option}: expected a size such as 2GB, 512MiB or 1.5G, got 'lots'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_colour_key_is_legible_and_fits_its_text(files, trained_model, tmp_path):
    from alibi_vit.trainable.io import palette

    root, _ = files
    assert run(["apply", "--model", str(trained_model), "--images", str(root / "images" / "m0.tif"),
                "--out", str(tmp_path / "out")]) == 0
    key = np.asarray(Image.open(tmp_path / "out" / "colour_key.png").convert("RGB")).astype(int)
    swatches = np.zeros(key.shape[:2], bool)
    for c in (1, 2, 3):
        swatches |= (key == palette(3)[c]).all(-1)
    text = key.max(-1) < 100  # dark pixels right of the swatches: the class names
    text[:, : np.where(swatches.any(0))[0].max() + 3] = False
    rows = np.where(text.any(1))[0]
    runs = np.split(rows, np.where(np.diff(rows) > 1)[0] + 1)
    assert len(runs) == 3  # one name per class
    assert all(len(r) >= 12 for r in runs), [len(r) for r in runs]  # letters at least 12 px tall
    cols = np.where(text.any(0))[0]
    assert cols.max() < key.shape[1] - 2 and rows.max() < key.shape[0] - 2  # nothing cut off at the edges


def test_overlay_tints_each_class_across_row_bands():
    """overlay() blends band by band: pixels on both sides of every band edge get alpha·colour + (1 - alpha)·grey
    (hand-computed for white under class 1 and class 2), class 0 stays the grey, an RGB image keeps its colours."""
    from alibi_vit.trainable.io import OVERLAY_BAND, overlay

    rows = 2 * OVERLAY_BAND + 3
    image = np.ones((rows, 4), np.float32)
    image[:, 3] = 0.2
    mask = np.zeros((rows, 4), np.uint8)
    mask[:, 0] = 1
    mask[:, 1] = 2
    out = overlay(image, mask, 0.4, 2)
    # 0.6 * 255 = 153; class 1 = (230, 25, 75), class 2 = (60, 180, 75)
    assert (out[:, 0] == [153 + 92, 153 + 10, 153 + 30]).all()
    assert (out[:, 1] == [153 + 24, 153 + 72, 153 + 30]).all()
    assert (out[:, 2] == 255).all() and (out[:, 3] == 51).all()
    rgb = np.zeros((rows, 2, 3), np.float32)
    rgb[..., 0] = 1.0
    rgb_out = overlay(rgb, mask[:, :2], 0.4, 2)
    assert (rgb_out[:, 0] == [153 + 92, 10, 30]).all() and (rgb_out[:, 1] == [153 + 24, 72, 30]).all()
