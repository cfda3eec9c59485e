"""`alibi-vit probe` end to end on tiny models."""

import csv

import numpy as np
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


def test_probe_command_reports_bad_input(tmp_path, capsys):
    assert main(["probe", "--model", "alibi_vit_small_patch14_reg4_dinov2", *TINY_ARGS,
                 "--images", str(tmp_path / "missing"), "--out", str(tmp_path / "x.csv")]) == 2
    assert "does not exist" in capsys.readouterr().err
