"""The image options of `alibi-vit probe/show`: --images as a file, a folder or a set; --intensity."""

import argparse

import numpy as np
import pytest
import tifffile
import torch

from alibi_vit.cli import main
from alibi_vit.cli.options import add_image_arguments, images_from_args
from alibi_vit.images import BUNDLED_SETS

TINY_ARGS = ["--model-arg", "depth=1", "--model-arg", "embed_dim=32", "--model-arg", "num_heads=2"]


def parse(argv):
    parser = argparse.ArgumentParser()
    add_image_arguments(parser, default_size=28)
    return parser.parse_args(argv)


def test_intensity_option_reaches_the_reader(tmp_path):
    twelve_bit = np.array([[0, 1000], [2000, 4000]], dtype=np.uint16)
    tifffile.imwrite(tmp_path / "cam.tif", twelve_bit)
    args = parse(["--images", str(tmp_path / "cam.tif"), "--size", "2"])
    assert args.intensity == "auto"
    [(name, auto)] = images_from_args(args)
    assert name == "cam" and float(auto.max()) == 1.0  # stretched by default
    [(_, raw)] = images_from_args(parse(["--images", str(tmp_path / "cam.tif"), "--size", "2", "--intensity", "dtype"]))
    torch.testing.assert_close(raw[0], torch.from_numpy(twelve_bit / 65535).float())
    [(_, mm)] = images_from_args(parse(["--images", str(tmp_path / "cam.tif"), "--size", "2", "--intensity", "minmax"]))
    torch.testing.assert_close(mm[0], torch.tensor([[0.0, 0.25], [0.5, 1.0]]))
    with pytest.raises(SystemExit):
        parse(["--images", "textures", "--intensity", "gamma"])


def test_probe_on_a_single_image_file(tmp_path):
    tifffile.imwrite(tmp_path / "one.tif", np.random.default_rng(0).integers(0, 4096, (40, 40), dtype=np.uint16))
    out = tmp_path / "probe.csv"
    assert main(["probe", "--model", "alibi_vit_small_patch14_reg4_dinov2", *TINY_ARGS, "--images",
                 str(tmp_path / "one.tif"), "--size", "84", "--intensity", "percentile", "--targets", "xy",
                 "--repeats", "1", "--fraction", "0.5", "--out", str(out)]) == 0
    assert "one.tif" in out.read_text()


def test_typo_in_a_set_name_is_one_line_listing_the_sets(capsys):
    assert main(["probe", "--model", "alibi_vit_small_patch14_reg4_dinov2", *TINY_ARGS,
                 "--images", "textrues"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'textures'" in err
    assert all(name in err for name in BUNDLED_SETS)
