"""--figure-format and --dpi of the commands that draw plots (probe --plot, heads, segment benchmark)."""

import pytest
from PIL import Image

from alibi_vit.cli.main import main
from tests.helpers import TINY

TINY_ARGS = [arg for key, value in TINY.items() for arg in ("--model-arg", f"{key}={value}")]
HEADS = ["heads", "--model", "alibi_vit_small_patch14_reg4_dinov2", *TINY_ARGS, "--images", "noise",
         "--noise-count", "1", "--size", "28"]
MAGIC = {"svg": b"<svg", "pdf": b"%PDF"}


def test_heads_png_resolution_follows_dpi(tmp_path):
    sizes = []
    for dpi in (50, 100):
        assert main([*HEADS, "--dpi", str(dpi), "--out", str(tmp_path / f"h{dpi}.csv")]) == 0
        sizes.append(Image.open(tmp_path / f"h{dpi}.png").size)
    assert abs(sizes[1][0] - 2 * sizes[0][0]) <= 2 and abs(sizes[1][1] - 2 * sizes[0][1]) <= 2


@pytest.mark.parametrize("fmt", ["svg", "pdf"])
def test_vector_figures(tmp_path, fmt):
    assert main([*HEADS, "--figure-format", fmt, "--out", str(tmp_path / "h.csv")]) == 0
    assert MAGIC[fmt] in (tmp_path / f"h.{fmt}").read_bytes()[:400] and not (tmp_path / "h.png").exists()
    assert main(["probe", "--model", "alibi_vit_small_patch14_reg4_dinov2", *TINY_ARGS, "--images", "noise",
                 "--noise-count", "1", "--size", "112", "--repeats", "1", "--plot", "--figure-format", fmt,
                 "--out", str(tmp_path / "p.csv")]) == 0
    for name in ("p_layers", "p_fingerprint"):
        assert MAGIC[fmt] in (tmp_path / f"{name}.{fmt}").read_bytes()[:400]
    assert main(["segment", "benchmark", "--synthetic", "--synthetic-size", "64", "--synthetic-count", "1", "1",
                 "--rounds", "1", "--trees", "3", "--figure-format", fmt, "--out", str(tmp_path / "b")]) == 0
    for name in ("miou_vs_round", "examples"):
        assert MAGIC[fmt] in (tmp_path / "b" / f"{name}.{fmt}").read_bytes()[:400]
