"""`alibi-vit channels`: a model whose positional channels are known by construction ranks them first."""

import csv
import math
from functools import partial

import numpy as np
import pytest
import torch

from alibi_vit.analysis.channels import rank_channels, rank_per_ramp, union_of_tops
from alibi_vit.analysis.probe import per_channel_r2, position_targets
from alibi_vit.cli import channels as channels_cli
from alibi_vit.models.checkpoint import create_backbone
from tests.helpers import run_subcommand

ARCH = dict(depth=1, embed_dim=32, num_heads=2, img_size=112)  # 8×8 grid at 112 px: pos_embed used as is
POSITIONAL = (5, 6, 9, 10)


run_channels = partial(run_subcommand, channels_cli)


def _model_args():
    return [a for k, v in ARCH.items() for a in ("--model-arg", f"{k}={v}")]


@pytest.fixture
def planted_checkpoint(tmp_path):
    """A tiny DINOv2 whose features carry x in channels 5, 6 and y in 9, 10, nothing positional elsewhere.

    The patch embedding is zero (image content plays no part) and the block is an identity
    (LayerScale 0), so a patch's feature is LayerNorm(pos_embed). Channels 5/6 hold
    (cos, sin) of an angle growing with x and 9/10 the same for y: their squares sum to a
    constant, so LayerNorm's per-token scale is the same everywhere and those channels stay
    monotone in position; the other channels are independent noise per patch.
    """
    model = create_backbone("vit_small_patch14_reg4_dinov2", **ARCH)
    state = model.state_dict()
    g = torch.Generator().manual_seed(0)
    n = 8
    table = 0.1 * torch.randn(n, n, ARCH["embed_dim"], generator=g)
    table -= table.mean(-1, keepdim=True)
    ang = torch.linspace(0, math.pi / 2, n)
    ys, xs = torch.meshgrid(ang, ang, indexing="ij")
    table[..., 5], table[..., 6] = 3 * xs.cos(), 3 * xs.sin()
    table[..., 9], table[..., 10] = 3 * ys.cos(), 3 * ys.sin()
    state["pos_embed"] = table.reshape(1, n * n, -1)
    for key in state:
        if key.startswith("patch_embed.proj") or key.endswith(("ls1.gamma", "ls2.gamma")):
            state[key] = torch.zeros_like(state[key])
    path = tmp_path / "planted.pth"
    torch.save(state, path)
    return path


def test_planted_positional_channels_rank_first(planted_checkpoint, tmp_path, capsys):
    out = tmp_path / "channels.csv"
    assert run_channels(["--model", "vit_small_patch14_reg4_dinov2", *_model_args(), "--checkpoint",
                         str(planted_checkpoint), "--images", "noise", "--noise-count", "2", "--size", "112",
                         "--top", "4", "--target", "xy", "--repeats", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "blank_channels: [5, 6, 9, 10]" in printed
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == ARCH["embed_dim"]  # every channel, ranked
    assert [int(r["rank"]) for r in rows] == list(range(1, ARCH["embed_dim"] + 1))
    assert {int(r["channel"]) for r in rows[:4]} == set(POSITIONAL)
    r2 = [float(r["r2"]) for r in rows]
    assert r2 == sorted(r2, reverse=True)
    # One axis each: about half of the joint (x, y) R²; noise channels explain nothing held out.
    assert min(r2[:4]) > 0.3 and max(r2[4:]) < 0.2


def test_default_ranks_per_ramp_and_blanks_the_union(planted_checkpoint, tmp_path, capsys):
    out = tmp_path / "ramps.csv"
    assert run_channels(["--model", "vit_small_patch14_reg4_dinov2", *_model_args(), "--checkpoint",
                         str(planted_checkpoint), "--images", "noise", "--noise-count", "2", "--size", "112",
                         "--repeats", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [r["target"] for r in rows[::ARCH["embed_dim"]]] == ["x", "y", "diag", "radial"]
    assert len(rows) == 4 * ARCH["embed_dim"] and {r["fit"] for r in rows} == {"ridge"}
    top2 = {t: [int(r["channel"]) for r in rows if r["target"] == t and int(r["rank"]) <= 2]
            for t in ("x", "y", "diag", "radial")}
    assert set(top2["x"]) == {5, 6} and set(top2["y"]) == {9, 10}
    union = sorted({c for cs in top2.values() for c in cs})
    assert f"blank_channels: [{', '.join(map(str, union))}]" in printed


def test_per_ramp_ranking_finds_a_radial_channel_that_xy_misses():
    # channel 3: distance from the centre; 7: x; 8: y; the rest noise. Radial is symmetric about the centre,
    # so a linear fit of x or y from it explains nothing, and the joint (x, y) ranking puts it among the noise.
    rng = np.random.default_rng(0)
    h = w = 13  # odd: the radial ramp is centred on the middle patch, symmetric in x and y
    feats = rng.normal(size=(3, 16, h, w))
    for c, target in ((3, "radial"), (7, "x"), (8, "y")):
        feats[:, c] = 4 * position_targets((h, w), target)[:, 0].reshape(h, w) + 0.05 * feats[:, c]
    options = dict(fraction=0.25, repeats=4, seed=0)
    xy = per_channel_r2(feats, "xy", **options)
    assert rank_channels(xy)[:2] in ([7, 8], [8, 7]) and 3 not in rank_channels(xy)[:3] and xy[3] < 0.05
    by_ramp = rank_per_ramp(feats, **options)
    assert list(by_ramp) == ["x", "y", "diag", "radial"]
    assert rank_channels(by_ramp["radial"])[0] == 3 and by_ramp["radial"][3] > 0.95
    chosen = union_of_tops(by_ramp, 2)
    assert 3 in chosen and {7, 8} <= set(chosen)
    assert chosen[:2] == rank_channels(by_ramp["x"])[:2]  # ramp order, then rank order, no repeats
    assert len(chosen) == len(set(chosen))
    with pytest.raises(ValueError, match="top must be at least 1"):
        union_of_tops(by_ramp, 0)


def test_rank_channels_orders_by_r2_with_nan_last():
    assert rank_channels([0.1, np.nan, 0.9, 0.1, -2.0]) == [2, 0, 3, 4, 1]


def test_bad_top_and_unknown_model_are_errors(planted_checkpoint, tmp_path):
    common = [*_model_args(), "--images", "noise", "--noise-count", "1", "--size", "112", "--repeats", "1",
              "--out", str(tmp_path / "c.csv")]
    with pytest.raises(ValueError, match="exceeds the 32 feature channels"):
        run_channels(["--model", "vit_small_patch14_reg4_dinov2", "--top", "33", *common])
    with pytest.raises(ValueError, match="--top must be at least 1"):
        run_channels(["--model", "vit_small_patch14_reg4_dinov2", "--top", "0", *common])
    with pytest.raises(ValueError, match="unknown model"):
        run_channels(["--model", "vit_smal_patch14_reg4_dinov2", *common])
