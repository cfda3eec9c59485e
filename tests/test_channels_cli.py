"""`alibi-vit channels`: a model whose positional channels are known by construction ranks them first."""

import csv
import math
from functools import partial

import numpy as np
import pytest
import torch

from alibi_vit.analysis.channels import rank_channels
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
                         "--top", "4", "--repeats", "3", "--out", str(out)]) == 0
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
