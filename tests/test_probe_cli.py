"""`alibi-vit probe` end to end on tiny models."""

import csv
from pathlib import Path

import numpy as np
import pytest
import tifffile
from PIL import Image

from alibi_vit.cli import main

TINY_ARGS = ["--model-arg", "depth=1", "--model-arg", "embed_dim=32", "--model-arg", "num_heads=2"]


def read_rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_probe_command_on_bundled_textures(tmp_path, capsys):
    out = tmp_path / "probe.csv"
    code = main(["probe", "--model", "vit_small_patch14_reg4_dinov2", "alibi_vit_small_patch14_reg4_dinov2",
                 *TINY_ARGS, "--images", "textures", "--size", "56", "--fraction", "0.3", "--repeats", "2",
                 "--out", str(out)])
    assert code == 0
    rows = read_rows(out)
    assert [r["model"] for r in rows] == ["vit_small_patch14_reg4_dinov2", "alibi_vit_small_patch14_reg4_dinov2"]
    assert all(np.isfinite(float(r[t])) for r in rows for t in ("x", "y", "diag", "radial", "xy"))
    printed = capsys.readouterr().out
    assert "alibi_vit_small_patch14_reg4_dinov2" in printed and "xy" in printed


def test_probe_command_per_layer_on_a_folder(tmp_path):
    folder = tmp_path / "micrographs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (60, 70), dtype=np.uint8)).save(folder / "a.png")
    tifffile.imwrite(folder / "b.tif", rng.integers(0, 65535, (64, 64), dtype=np.uint16))
    out = tmp_path / "layers.csv"
    assert main(["probe", "--model", "alibi_vit_small_patch14_reg4_dinov2", *TINY_ARGS, "--images", str(folder),
                 "--size", "42", "--per-layer", "--targets", "xy", "--repeats", "1", "--fraction", "0.4",
                 "--out", str(out)]) == 0
    assert [r["layer"] for r in read_rows(out)] == ["0", "final"]
    channels = read_rows(tmp_path / "layers_channels.csv")
    assert len(channels) == 2 * 32


def test_probe_writes_into_its_out_folder_not_the_current_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["probe", "--model", "alibi_vit_small_patch14_reg4_dinov2", *TINY_ARGS, "--images", "noise",
            "--noise-count", "2", "--size", "28", "--repeats", "1", "--targets", "xy", "--per-layer"]
    assert main(args) == 0  # default: a folder of its own
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "probe_results", "probe_results/probe.csv", "probe_results/probe_channels.csv"]
    assert main([*args, "--out", str(tmp_path / "runs" / "a")]) == 0  # a folder given: made, the tables inside
    assert read_rows(tmp_path / "runs" / "a" / "probe.csv")[0]["model"] == "alibi_vit_small_patch14_reg4_dinov2"
    assert (tmp_path / "runs" / "a" / "probe_channels.csv").is_file()
    (tmp_path / "notes.txt").write_text("")
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "notes.txt")]) == 2  # said before any model is built
    assert capsys.readouterr().err.strip() == (f"alibi-vit probe: error: --out {tmp_path / 'notes.txt'}: "
                                               f"{tmp_path / 'notes.txt'} is an existing file; give a folder")


def test_probe_command_reports_bad_input(tmp_path, capsys):
    assert main(["probe", "--model", "alibi_vit_small_patch14_reg4_dinov2", *TINY_ARGS,
                 "--images", str(tmp_path / "missing"), "--out", str(tmp_path / "x.csv")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_probe_says_which_models_are_random_and_how_many_patches_it_fitted(tmp_path, capsys):
    out = tmp_path / "probe.csv"
    # 56 px: a 4×4 grid; 2.5 % of 16 patches would be 0, so 8 (half the grid) are fitted
    assert main(["probe", "--model", "alibi_vit_small_patch14_reg4_dinov2", *TINY_ARGS, "--images", "noise",
                 "--noise-count", "2", "--size", "56", "--repeats", "1", "--targets", "xy", "--out", str(out)]) == 0
    row = read_rows(out)[0]
    assert (row["weights"], row["fitted_patches"], row["patches"]) == ("random init", "8", "16")
    printed = capsys.readouterr().out
    assert "alibi_vit_small_patch14_reg4_dinov2 *" in printed and "* randomly initialised" in printed
    assert "note: fitted on 8 of 16 patches per sampling (50.0%), not --fraction 2.5% = 0" in printed


def test_probe_plot_writes_both_figures_from_the_csv_numbers(tmp_path):
    from PIL import Image

    from alibi_vit.cli.probe import plot_fingerprints, plot_r2_per_layer

    out = tmp_path / "probe.csv"
    assert main(["probe", "--model", "vit_small_patch14_reg4_dinov2", *TINY_ARGS, "--images", "noise",
                 "--noise-count", "2", "--size", "56", "--repeats", "1", "--targets", "x", "xy",
                 "--fingerprint-target", "x", "--plot", "--out", str(out)]) == 0  # --plot implies --per-layer
    for name in ("probe_layers.png", "probe_fingerprint.png"):
        with Image.open(tmp_path / name) as im:
            assert im.format == "PNG" and min(im.size) > 200 and np.asarray(im.convert("L")).std() > 5
    channels = read_rows(tmp_path / "probe_channels.csv")
    assert set(channels[0]) == {"model", "layer", "channel", "x"}  # the fingerprint target is the column

    # The figures draw exactly the CSV's numbers: heatmap = layers × channels, curves = R² per layer.
    grid = np.array([[float(r["x"]) for r in channels if r["layer"] == str(layer)] for layer in (0,)])
    fig = plot_fingerprints({"m": grid}, "x")
    image = fig.axes[0].images[0]
    np.testing.assert_array_equal(image.get_array(), grid)
    assert image.get_clim() == (0.0, 1.0)
    rows = [{"model": "m", "weights": "random init", "layer": i, "x": v} for i, v in enumerate([0.5, -3.0, 0.9])]
    line = plot_r2_per_layer(rows, ["x"]).axes[0].lines[0]
    np.testing.assert_array_equal(line.get_ydata(), [0.5, -1.0, 0.9])  # below −1 drawn at −1
    assert line.get_label().endswith("(random init)")
    # Two models with the same values stay visible (own marker, style and sideways offset), the legend
    # sits outside the panels, and the offsets keep each point within its layer.
    twins = rows + [{**r, "model": "n"} for r in rows]
    fig = plot_r2_per_layer(twins, ["x"])
    first, second = fig.axes[0].lines[:2]
    assert first.get_marker() != second.get_marker() and first.get_linestyle() != second.get_linestyle()
    assert not np.array_equal(first.get_xdata(), second.get_xdata())
    np.testing.assert_array_equal(np.round(first.get_xdata()), [0, 1, 2])
    assert fig.axes[0].get_legend() is None and len(fig.legends) == 1


def test_paper_table_runs_what_it_can_and_skips_the_rest(tmp_path, capsys, monkeypatch, no_network):
    """Offline: DINOv2-S's and the released ALiBi-Dv2's files are in the local hub cache, nothing else."""
    import huggingface_hub
    import torch
    from safetensors.torch import save_file

    from alibi_vit.models.checkpoint import create_backbone

    arch = dict(depth=1, embed_dim=32, num_heads=2)
    dinov2 = create_backbone("vit_small_patch14_reg4_dinov2", **arch, dynamic_img_size=False).state_dict()
    release = create_backbone("alibi_vit_small_patch14_reg4_dinov2", **arch).state_dict()
    del release["pos_embed"]  # the authors' files may lack it
    cache = Path(huggingface_hub.constants.HF_HUB_CACHE)
    for repo, filename in (("timm/vit_small_patch14_reg4_dinov2.lvd142m", "model.safetensors"),
                           ("rmdocherty/dino-saw", "alibi_coco_dv2_vits14_reg4.pth")):
        folder = cache / f"models--{repo.replace('/', '--')}"
        (folder / "snapshots" / "abc123").mkdir(parents=True)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text("abc123")
        if filename.endswith(".safetensors"):
            save_file({k: v.contiguous() for k, v in dinov2.items()}, folder / "snapshots" / "abc123" / filename)
        else:
            torch.save(release, folder / "snapshots" / "abc123" / filename)
    out = tmp_path / "paper.csv"
    common = ["--images", "noise", "--noise-count", "2", "--size", "112"]
    assert main(["probe", "--paper-table", *TINY_ARGS, *common, "--out", str(out)]) == 0
    rows = {r["row"]: r for r in read_rows(out)}
    assert list(rows) == ["DINOv2-S", "DINOv2-S blanked", "DINOv2-B", "DINOv3-S+", "NoPE", "ALiBi-Dv2", "ALiBi-Dv3",
                          "transform-averaged", "sin-cos"]
    measured = {k for k, r in rows.items() if not r["skipped"]}
    assert {"DINOv2-S", "ALiBi-Dv2", "transform-averaged"} <= measured
    for row in ("DINOv2-B", "DINOv3-S+", "NoPE", "ALiBi-Dv3"):  # no weights here: skipped, with the reason
        assert rows[row]["xy"] == "" and "not in the local cache" in rows[row]["skipped"]
    # the blanked baseline's channels 47..359 do not exist in a 32-channel model: skipped, saying why
    assert "out of range" in rows["DINOv2-S blanked"]["skipped"]
    assert (rows["DINOv2-S"]["paper_micrographs"], rows["ALiBi-Dv2"]["paper_noise"]) == ("0.83", "-0.85")
    printed = capsys.readouterr().out
    assert "skipped" in printed and "DINOv2-B (vit_base_patch14_reg4_dinov2)" in printed
    # the labels say what compares with what: noise images ↔ the paper's noise column, held-out vs fitted R²
    assert "*noise" in printed and "held-out R²" in printed and "47, 117, 359" in printed
    assert rows["DINOv2-S"]["compare_with"] == "paper_noise" and rows["DINOv2-S"]["repeats"] == "6"
    # 8×8 patches at 112 px: (h·w)//36 = 1, raised to the 2 a fit needs
    assert rows["DINOv2-S"]["fitted_patches"] == "2" and rows["DINOv2-S"]["size"] == "112×112"

    # The DINOv2-S row is what the plain probe reports for the same weights and images with the same fit
    # (2 patches, 6 repeats).
    ckpt = tmp_path / "dinov2_tiny.pth"
    torch.save(dinov2, ckpt)
    plain = tmp_path / "plain.csv"
    assert main(["probe", "--model", "vit_small_patch14_reg4_dinov2", "--checkpoint", str(ckpt),
                 "--model-arg", "dynamic_img_size=True", *TINY_ARGS, *common, "--targets", "xy",
                 "--repeats", "6", "--fraction", "0.03", "--min-train", "0", "--out", str(plain)]) == 0
    assert float(read_rows(plain)[0]["xy"]) == pytest.approx(float(rows["DINOv2-S"]["xy"]), abs=1e-6)

    # Without --size: the reference's sizes: noise at 518 px for patch-14 models, (h·w)//36 = 38 patches fitted
    ref = tmp_path / "reference.csv"
    assert main(["probe", "--paper-table", *TINY_ARGS, "--images", "noise", "--noise-count", "2",
                 "--out", str(ref)]) == 0
    row = {r["row"]: r for r in read_rows(ref)}["DINOv2-S"]
    assert (row["size"], row["fitted_patches"]) == ("518×518", "38")
    from alibi_vit import patch_features
    from alibi_vit.analysis.probe import positional_r2
    from alibi_vit.images import noise_images, normalize

    model = create_backbone("vit_small_patch14_reg4_dinov2", checkpoint=ckpt, dynamic_img_size=True,
                            **arch).eval()
    images = torch.stack([normalize(img) for _, img in noise_images(2, 518, 0)])
    with torch.no_grad():
        feats = patch_features(model, images)
    expected = positional_r2(feats, "xy", repeats=6, n_train=38)  # both images, 6 repeats each, seeded alike
    assert float(row["xy"]) == pytest.approx(expected, abs=1e-6)


def test_paper_table_bad_input(tmp_path, capsys):
    args = ["--images", "noise", "--noise-count", "1", "--out", str(tmp_path / "p.csv")]
    assert main(["probe", "--paper-table", "--size", "224", "--model", "vit_small_patch14_reg4_dinov2", *args]) == 2
    assert "drop --model" in capsys.readouterr().err
    assert main(["probe", "--paper-table", "--size", "140", *args]) == 2
    assert "multiple of 112" in capsys.readouterr().err
    assert main(["probe", "--size", "56", *args]) == 2
    assert "--paper-table" in capsys.readouterr().err


def test_paper_table_images_at_the_reference_sizes(tmp_path):
    """--paper-table without --size: noise at 518 px (512 for patch 16), other images native, centre-cropped."""
    import argparse

    import torch
    from PIL import Image

    from alibi_vit.cli.probe import paper_images, paper_set_of
    from alibi_vit.images import load_image, normalize

    rng = np.random.default_rng(0)
    folder = tmp_path / "micro"
    folder.mkdir()
    Image.fromarray(rng.integers(0, 255, (45, 60, 3), dtype=np.uint8)).save(folder / "a.png")
    args = argparse.Namespace(images=str(folder), size=None, noise_count=2, seed=0, intensity="auto")
    (img,) = paper_images(args, 14, {})
    # 45×60 → 42×56: the central crop of the native pixels, not resized
    torch.testing.assert_close(img, normalize(load_image(folder / "a.png"))[:, 1:43, 2:58])
    assert [tuple(i.shape[-2:]) for i in paper_images(args, 16, {})] == [(32, 48)]
    noise = argparse.Namespace(**{**vars(args), "images": "noise"})
    assert {tuple(i.shape[-2:]) for i in paper_images(noise, 14, {})} == {(518, 518)}
    assert {tuple(i.shape[-2:]) for i in paper_images(noise, 16, {})} == {(512, 512)}
    assert (paper_set_of("noise"), paper_set_of("textures"), paper_set_of(str(folder))) == \
        ("noise", "textures", "micrographs")
